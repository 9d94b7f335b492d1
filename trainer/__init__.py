"""The training application: Hydra entrypoint, SFT and GRPO loops, the built-in task."""
# Imported first so its guard against torch's device-extension auto-loading runs before torch.
import polyfsdp.backends  # noqa: F401

"""The shared FSDP engine core: jagged batches, fused log-probs, adapters, FSDP2, losses, checkpoints."""
# Imported first so its guard against torch's device-extension auto-loading runs before torch.
import polyfsdp.backends  # noqa: F401

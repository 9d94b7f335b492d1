"""Per-model patches applied per instance, isolated, reversible, toggled by config."""
# Imported first so its guard against torch's device-extension auto-loading runs before torch.
import polyfsdp.backends  # noqa: F401

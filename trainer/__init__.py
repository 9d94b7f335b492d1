"""The training application: Hydra entrypoint, SFT and RL loops, the built-in task."""
from .startup import interrupted_while_starting

try:
    # Imported first so its guard against torch's device-extension auto-loading runs before torch.
    import polyfsdp.backends  # noqa: F401
except KeyboardInterrupt:
    # Ctrl-C during `import torch` (seconds): the console script imports this package before
    # main() runs, so this is the only place that can turn it into one line and status 130.
    raise interrupted_while_starting() from None

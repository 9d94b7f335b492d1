"""HCCL's timeouts, set before the process group starts: polyfsdp's defaults where the user set
none, the user's values checked against their documented ranges, and one line saying which.

- ``HCCL_CONNECT_TIMEOUT``: seconds ranks wait for each other while the communicator is built;
  CANN's default 120, documented range 120..7200
  (https://www.hiascend.com/document/detail/zh/canncommercial/83RC1/maintenref/envvar/envref_07_0149.html).
  polyfsdp: 1800, as MindSpeed-RL/MindSpeed-LLM set it: the first collective of a large job can
  wait for the slowest host to load a model.
- ``HCCL_EXEC_TIMEOUT``: seconds a rank waits inside a collective for its peers; CANN's default
  1836, range 0..2147483647 on Atlas A2/A3 (0: never), (0, 17340] on Atlas training series,
  capped at 1091 in HCCL's AIV expansion mode
  (https://www.hiascend.com/document/detail/zh/canncommercial/900/maintenref/envvar/envref_07_0078.html).
  polyfsdp: 3600, because an RL step keeps ranks apart for a whole rollout (the fastest rank
  waits at the next collective while the slowest still generates).
- torch's process-group timeout: the HCCL execution timeout plus a minute, so HCCL's own report
  (which names the rank that did not arrive) comes before torch's watchdog aborts the group.
"""
from __future__ import annotations

from typing import MutableMapping

CONNECT, EXEC = "HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT"
DEFAULTS = {CONNECT: 1800, EXEC: 3600}
RANGES = {CONNECT: (120, 7200), EXEC: (0, 2147483647)}
# With HCCL_EXEC_TIMEOUT=0 (never) the process group still needs a finite timeout: one day.
NEVER_TIMEOUT_S = 86400.0
MARGIN_S = 60.0


def _user_value(environ: MutableMapping[str, str], name: str) -> int:
    raw = environ[name]
    low, high = RANGES[name]
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ValueError(f"{name}={raw!r} must be a whole number of seconds in {low}..{high} (CANN's documented "
                         f"range); unset it for polyfsdp's default {DEFAULTS[name]}")
    return value


def apply_hccl_settings(environ: MutableMapping[str, str]) -> tuple[float, str]:
    """Set the defaults HCCL reads at start-up where ``environ`` has none, check the user's values;
    return (torch's process-group timeout in seconds, one line saying what is in effect)."""
    parts = []
    values = {}
    for name, default in DEFAULTS.items():
        if name in environ:
            values[name] = _user_value(environ, name)
            parts.append(f"{name}={values[name]} (yours)")
        else:
            environ[name] = str(default)
            values[name] = default
            parts.append(f"{name}={default} (polyfsdp default; set it to override)")
    timeout_s = NEVER_TIMEOUT_S if values[EXEC] == 0 else values[EXEC] + MARGIN_S
    return timeout_s, f"hccl: {', '.join(parts)}; process-group timeout {timeout_s:g} s"

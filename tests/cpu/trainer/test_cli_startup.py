"""``polyfsdp-train --help`` and configuration mistakes answer before torch and transformers
load (seconds): checked in a fresh interpreter, by what it imported, not by a clock."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "peft")
PROBE = """
import json, sys
from polyfsdp.trainer.train import main
status = main(sys.argv[1:])
print(json.dumps({"status": status, "loaded": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def _probe(*args: str) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.parametrize("args, status, line", [
    (["--help"], 0, None),
    (["algo.actor.lr=1"], 2, "did you mean algo.actor.optim.lr?"),   # an unknown key
    (["model=gpt9"], 2, "model=gpt9: no such option"),             # an unknown option of a group
    (["trainer.seed=-1"], 2, "trainer.seed: expected at least 0"),  # a value outside its bounds
    (["--verbose"], 2, "unknown option '--verbose'"),
])
def test_help_and_config_errors_do_not_import_torch(args, status, line):
    result, stderr = _probe(*args)
    assert result["status"] == status
    if line is not None:
        assert line in stderr and len(stderr.strip().splitlines()) == 1
    assert result["loaded"] == []


def test_a_valid_config_still_imports_torch_for_the_job():
    """The probe can see an import: --cfg validates the whole config, which needs the engine's dataclasses."""
    result, _ = _probe("--cfg")
    assert result["status"] == 0 and "torch" in result["loaded"]

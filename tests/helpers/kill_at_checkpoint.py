"""Run ``polyfsdp-train`` (through cli_kill_child.py, which holds still after the chosen checkpoint)
and SIGKILL it once that checkpoint is announced: the kill lands at a known point however loaded
the machine is. Shared by the kill -9 + resume tests."""
import os
import signal
import subprocess
import sys


def kill_after_checkpoint(overrides, phase: str = "rl", step: int = 2, before_kill=None):
    """``(process, lines it printed)`` after the kill; ``before_kill()`` runs while the run holds at
    the checkpoint (e.g. to look at what it started)."""
    command = [sys.executable, os.path.join(os.path.dirname(__file__), "cli_kill_child.py"), phase, str(step),
               *overrides]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("checkpoint saved:") and f"(phase {phase}, step {step}," in line:
                if before_kill is not None:
                    before_kill()
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.stdin.close()  # a child that was not killed ends here instead of waiting forever
        proc.wait(timeout=300)
    return proc, seen

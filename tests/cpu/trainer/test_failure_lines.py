"""Failures that used to end in a traceback (or a silent rc 0) are one polyfsdp line with a
non-zero exit: a hung or exiting reward, a full disk while appending metrics or exporting,
Ctrl-C while starting, a dead peer rank, ranks reading different data, symbolic links in
the output directory, and group filtering that left a step without a loss."""
from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys

import pytest
from tests.cpu.trainer.test_cli import TINY
from tests.helpers.ctrl_c import ctrl_c_raises

from polyfsdp.trainer.errors import MetricsWriteError
from polyfsdp.trainer.tracking.metrics import MetricsLogger, read_metrics
from polyfsdp.trainer.train import main

# SFT only: the held-out evaluation before the first step already calls the reward.
FAST = [*TINY, "algo=sft", "trainer.plot=false", "trainer.export=false", "trainer.checkpoint_interval=0"]


def _error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _reward(tmp_path, body: str) -> str:
    path = tmp_path / "reward_under_test.py"
    path.write_text("import sys\n\n\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n" + body)
    return f"reward.fn={path}:score"


def test_a_hung_reward_stops_the_run_with_one_line_naming_the_key(tmp_path, capsys):
    code = main([*FAST, _reward(tmp_path, "    while True:\n        pass\n"), "reward.timeout_s=0.5",
                 f"trainer.output_dir={tmp_path / 'out'}"])
    err = _error_lines(capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("polyfsdp-train: error: reward.fn=") and "took longer than reward.timeout_s=0.5 s " \
        "(record " in err[0], err[0]


def test_a_reward_calling_sys_exit_0_is_not_a_successful_run(tmp_path, capsys):
    code = main([*FAST, _reward(tmp_path, "    sys.exit(0)\n"), f"trainer.output_dir={tmp_path / 'out'}"])
    err = _error_lines(capsys)
    assert code == 2 and len(err) == 1 and "called sys.exit(0) (record " in err[0], err


def test_filter_groups_with_no_informative_group_finishes_and_plots(tmp_path, capsys):
    out = tmp_path / "out"
    code = main([*TINY, "algo.actor.group_size=2", "trainer.sft_steps=0", "trainer.rl_steps=2",
                 "trainer.checkpoint_interval=0", "trainer.export=false", "trainer.plot=true",
                 "algo.actor.filter_groups=true", "algo.actor.max_sample_batches=1", _reward(tmp_path, "    return 0.5\n"),
                 f"trainer.output_dir={out}"])
    assert code == 0, _error_lines(capsys)
    grpo = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["phase"] == "rl"]
    assert len(grpo) == 2 and all("loss" not in r for r in grpo)  # no group carried a signal: nothing trained
    assert (out / "curves.png").stat().st_size > 0


def _full_after(limit_bytes: int):
    """An os.write that fills the disk after ``limit_bytes``: the write that crosses it lands partly, then ENOSPC."""
    real_write, written = os.write, [0]

    def write(fd, data):
        room = limit_bytes - written[0]
        if room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done = real_write(fd, bytes(data[:room]))
        written[0] += done
        return done
    return write


def test_a_metrics_record_is_appended_whole_or_not_at_all(tmp_path, monkeypatch):
    from polyfsdp.trainer.tracking import metrics

    logger = MetricsLogger(str(tmp_path / "metrics.jsonl"))
    logger.start(None)
    logger.log({"phase": "sft", "step": 1, "loss": 1.5})
    monkeypatch.setattr(metrics.os, "write", _full_after(10))
    with pytest.raises(MetricsWriteError, match="No space left on device"):
        logger.log({"phase": "sft", "step": 2, "loss": 1.25, "note": "x" * 100})
    monkeypatch.undo()
    assert read_metrics(logger.path) == [{"phase": "sft", "step": 1, "loss": 1.5}]
    assert logger.lines == 1
    logger.log({"phase": "sft", "step": 2, "loss": 1.25})
    assert [r["step"] for r in read_metrics(logger.path)] == [1, 2]


def test_a_full_disk_during_a_run_is_one_line_and_leaves_whole_records(tmp_path, monkeypatch, capsys):
    from polyfsdp.trainer.tracking import metrics

    monkeypatch.setattr(metrics.os, "write", _full_after(700))
    out = tmp_path / "out"
    code = main([*FAST, f"trainer.output_dir={out}"])
    monkeypatch.undo()
    err = _error_lines(capsys)
    assert code == 2 and len(err) == 1 and "No space left on device" in err[0], err
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n") and all(json.loads(line) for line in text.splitlines())


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/disk/model.safetensors"),
                                     RuntimeError("Error while serializing: I/O error: No space left on device "
                                                  "(os error 28)")], ids=["oserror", "safetensors"])
def test_a_full_disk_during_the_export_is_one_line_and_no_partial_export(tmp_path, monkeypatch, capsys, failure):
    import transformers.modeling_utils

    real = transformers.modeling_utils.safe_save_file

    def full_for_the_export(state, filename, **kwargs):
        if "final.tmp" in str(filename):
            raise failure
        return real(state, filename, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_for_the_export)
    out = tmp_path / "out"
    code = main([*TINY, "algo=sft", "trainer.plot=false", "trainer.checkpoint_interval=0",
                 f"trainer.output_dir={out}"])
    err = _error_lines(capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("polyfsdp-train: error: No space left on device ("), err
    assert (out / "sft_model").exists() is False and (out / "checkpoints").exists() is False
    assert not (out / "final").exists() and not (out / "final.tmp").exists()


def test_symbolic_links_to_an_old_export_and_checkpoint_are_replaced_not_followed(tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "export").mkdir(parents=True)
    (elsewhere / "export" / "keep.txt").write_text("kept")
    out = tmp_path / "out"
    base = [*TINY, "algo=sft", "trainer.plot=false", "trainer.checkpoint_interval=1", f"trainer.output_dir={out}"]
    assert main([*base, "trainer.keep_checkpoints=2", "trainer.export=false"]) == 0
    sft = out / "checkpoints" / "sft"
    # An old checkpoint moved to other storage, linked back; the export a link to an old one. (Not
    # the newest: a run resumes only from checkpoints inside its directory, test_checkpoint_paths.py.)
    os.replace(sft / "step_000001", elsewhere / "step_000001")
    (sft / "step_000001").symlink_to(elsewhere / "step_000001")
    (out / "final").symlink_to(elsewhere / "export")
    code = main([*base, "trainer.keep_checkpoints=1", "trainer.sft_steps=3"])
    assert code == 0, _error_lines(capsys)
    assert sorted(p.name for p in sft.iterdir()) == ["latest", "step_000003"]  # the link pruned, not its target
    assert (elsewhere / "step_000001").is_dir() and (elsewhere / "export" / "keep.txt").read_text() == "kept"
    assert not (out / "final").is_symlink() and (out / "final" / "config.json").is_file()


INTERRUPT_AT_IMPORT = """
import sys

INTERRUPTED_MODULE = sys.argv[1]


class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == INTERRUPTED_MODULE:
            raise KeyboardInterrupt


sys.meta_path.insert(0, CtrlC())
sys.argv = ["polyfsdp-train", "trainer.output_dir=" + sys.argv[2], "trainer.sft_steps=1", "trainer.rl_steps=0"]
import runpy
runpy.run_module("polyfsdp.trainer.train", run_name="__main__")
"""


SIGTERM_AT_IMPORT = """
import os, signal, sys

TERMINATED_MODULE = sys.argv[1]


class Sigterm:
    def find_spec(self, name, path=None, target=None):
        if name == TERMINATED_MODULE:
            os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends, into polyfsdp-train's first seconds


sys.meta_path.insert(0, Sigterm())
sys.argv = ["polyfsdp-train", "trainer.output_dir=" + sys.argv[2], "trainer.sft_steps=1", "trainer.rl_steps=0"]
import runpy
runpy.run_module("polyfsdp.trainer.train", run_name="__main__")
"""


@pytest.mark.parametrize("module", ["hydra", "torch"])
def test_sigterm_while_starting_is_one_line_and_status_143(tmp_path, module):
    proc = subprocess.run([sys.executable, "-c", SIGTERM_AT_IMPORT, module, str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 143, (proc.returncode, proc.stderr)
    # Worded as a SIGTERM during the run ("stopped by SIGTERM after rl step 2; ..."), nothing to continue.
    assert proc.stderr.strip() == "polyfsdp-train: stopped by SIGTERM while starting (nothing ran, nothing was written)"
    assert not (tmp_path / "out").exists()


def test_the_startup_sigterm_handler_hands_over_to_the_job_and_is_restored(tmp_path, monkeypatch):
    import signal

    from polyfsdp.trainer.run import job
    from polyfsdp.trainer.run.stop import StopRequest

    seen, during_run = [], []
    monkeypatch.setattr(job.Job, "run", lambda self: during_run.append(signal.getsignal(signal.SIGTERM)))
    previous = signal.signal(signal.SIGTERM, lambda *args: seen.append("the caller's handler"))
    try:
        assert main([*FAST, "trainer.sft_steps=1", f"trainer.output_dir={tmp_path / 'out'}"]) == 0
        # While the job runs, its StopRequest's flag (finish the step, checkpoint); after main, the caller's.
        assert [isinstance(getattr(h, "__self__", None), StopRequest) for h in during_run] == [True]
        signal.raise_signal(signal.SIGTERM)
        assert seen == ["the caller's handler"]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_while_a_lost_peer_is_reported_does_not_end_the_rank_before_its_line(tmp_path, monkeypatch, capsys):
    """torchrun sends SIGTERM to the survivors as soon as it sees a worker die: the rank that is
    still looking for which peer was lost must keep the job's flag handler until it said so."""
    import signal

    from polyfsdp.backends import distributed
    from polyfsdp.trainer.run import job
    from polyfsdp.trainer.run.stop import StopRequest

    def collective_fails(self):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234")

    handlers = []

    def looking_for_the_peer(exc):
        handlers.append(signal.getsignal(signal.SIGTERM))
        if isinstance(getattr(handlers[-1], "__self__", None), StopRequest):  # (the default action would end pytest)
            signal.raise_signal(signal.SIGTERM)  # the launcher's SIGTERM lands here
        return "lost rank 1 (pid 4242): its process ended during a collective"

    monkeypatch.setattr(job.Job, "run", collective_fails)
    monkeypatch.setattr(distributed, "collective_failure", looking_for_the_peer)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        code = main([*FAST, "trainer.sft_steps=1", f"trainer.output_dir={tmp_path / 'out'}"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert [isinstance(getattr(h, "__self__", None), StopRequest) for h in handlers] == [True]
    err = _error_lines(capsys)
    assert code == 2 and err == ["polyfsdp-train: error: lost rank 1 (pid 4242): its process ended during a collective"]


@pytest.mark.parametrize("module", ["torch", "transformers"])
def test_ctrl_c_while_importing_is_one_line_and_status_130(tmp_path, module):
    proc = subprocess.run([sys.executable, "-c", INTERRUPT_AT_IMPORT, module, str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == "polyfsdp-train: interrupted while starting (nothing ran, nothing was written)"
    assert not (tmp_path / "out").exists()


LOSES_A_CTRL_C = """\
    import os
    import signal

    class Finalizer:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100_000):  # the handler runs in here: CPython drops its KeyboardInterrupt
                pass

    if not hasattr(score, "lost"):
        score.lost = True
        Finalizer()
    return 0.0
"""


def test_a_ctrl_c_whose_exception_python_dropped_still_stops_the_run(tmp_path, capsys, monkeypatch):
    """A KeyboardInterrupt raised while a finalizer or weakref callback runs is printed as
    'Exception ignored in ...' and dropped: on CI a Ctrl-C landing in DCP's WeakSet callback let
    the run go on for hundreds of steps. The job's handler keeps a flag that the next step
    boundary raises."""
    dropped = []  # what CPython reports as "Exception ignored in ..."
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(unraisable.exc_type))
    with ctrl_c_raises():
        code = main([*FAST, "trainer.sft_steps=3", _reward(tmp_path, LOSES_A_CTRL_C),
                     f"trainer.output_dir={tmp_path / 'out'}"])
    err = _error_lines(capsys)
    assert dropped == [KeyboardInterrupt]
    assert code == 130 and err[-1].startswith("polyfsdp-train: interrupted before the first step; no checkpoint yet; "
                                              "continue with: polyfsdp-train "), err


def test_the_process_group_timeout_is_set_from_the_config(tmp_path, monkeypatch):
    from polyfsdp.backends import distributed, get_backend
    from polyfsdp.trainer.run import job

    asked = []
    real = job.init_distributed
    monkeypatch.setattr(job, "init_distributed",
                        lambda backend, **kwargs: (asked.append(kwargs), real(backend, **kwargs))[1])
    assert main([*FAST, "trainer.sft_steps=1", "trainer.dist_timeout_s=42.5", f"trainer.output_dir={tmp_path / 'out'}"]) == 0
    assert asked == [{"timeout_s": 42.5, "sp_size": 1}]
    # ... and init_distributed hands it to init_process_group (as a fresh process would create it).
    seen = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda *args, **kwargs: seen.append(kwargs["timeout"]))
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda *args: 1)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    distributed.init_distributed(get_backend("cpu"), timeout_s=42.5)
    assert [t.total_seconds() for t in seen] == [42.5]


def test_a_dead_peer_rank_is_named_by_the_survivors(monkeypatch):
    from polyfsdp.backends import distributed

    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    peer.kill()
    os.waitid(os.P_PID, peer.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: a zombie, as a killed worker is
    try:
        monkeypatch.setattr(distributed, "_PEERS", [(socket.gethostname(), os.getpid()),
                                                    (socket.gethostname(), peer.pid)])
        gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                            "[127.0.0.1]:41234")
        line = distributed.collective_failure(gloo)
        assert line.startswith(f"lost rank 1 (pid {peer.pid}): its process ended during a collective"), line
        assert distributed.collective_failure(ValueError("Connection closed by peer")) is None
        assert distributed.collective_failure(RuntimeError("shape mismatch")) is None
    finally:
        peer.wait()
    monkeypatch.setattr(distributed, "_PEERS", [(socket.gethostname(), os.getpid()), ("other-host", 1)])
    assert distributed.collective_failure(gloo).startswith("a collective failed because a peer rank stopped answering")


def test_ranks_that_read_different_records_stop_with_one_line(monkeypatch):
    from polyfsdp.trainer import rank_errors
    from polyfsdp.trainer.config.job import load_config
    from polyfsdp.trainer.data.example import Example
    from polyfsdp.trainer.errors import ConfigError

    class Source:
        def __init__(self, answers):
            self.train_examples = [Example(prompt="p", answer=a) for a in answers]
            self.eval_examples = self.train_examples[:1]

    mine, peers = Source(["a", "b"]), Source(["a", "c"])
    monkeypatch.setattr(rank_errors, "current_world_size", lambda: 2)
    monkeypatch.setattr(rank_errors, "all_gather_object", lambda value: [value, rank_errors._fingerprint(peers)])
    with pytest.raises(ConfigError, match=r"^data: rank 1 read different records than rank 0 \(2 training and 1 "):
        rank_errors.check_same_data(mine, load_config([]).data)
    monkeypatch.setattr(rank_errors, "all_gather_object", lambda value: [value, value])
    rank_errors.check_same_data(mine, load_config([]).data)

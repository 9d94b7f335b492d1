"""A judge that drips its answer, at the level of ``polyfsdp-train`` (child processes): with a small
``reward.judge.timeout_s`` the run fails in one line at that deadline; with a large one, SIGTERM
ends it with status 143 and Ctrl-C with 130, each with its one stop line, the request still
blocked. The drip (one byte every 0.5 s, 300 bytes) outlasts each child's timeout (60 s), so a
deadline or a stop that does not hold fails the test instead of passing late."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
from tests.helpers.child_exit import finish_within
from tests.helpers.ctrl_c import as_at_a_terminal
from tests.helpers.misbehaving_http import MODEL, MisbehavingJudge

CHILD_TIMEOUT_S = 60  # far above the deadline below, far below the drip's 150 s
JOB = ["trainer.sft_steps=0", "trainer.rl_steps=2", "trainer.prompts_per_step=2", "algo.actor.group_size=2",
       "trainer.progress=off", "trainer.plot=false", "trainer.export=false", "trainer.checkpoint_interval=0",
       "data.eval_size=2", "reward.fn=char_match", "reward.weight=0.5"]


@pytest.fixture
def drip():
    server = MisbehavingJudge("drip-body", interval_s=0.5, count=300)
    yield server
    server.close()


def _start(drip, tmp_path, timeout_s: float, **kwargs) -> subprocess.Popen:
    judge = f"reward.judge={{url:'{drip.url}',model:{MODEL},timeout_s:{timeout_s},retries:0}}"
    return subprocess.Popen([sys.executable, "-m", "polyfsdp.trainer.train", *JOB, judge,
                             f"trainer.output_dir={tmp_path / 'run'}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "POLYFSDP_BACKEND": "cpu"}, **kwargs)


def test_a_dripping_judge_fails_the_run_in_one_line_at_timeout_s(drip, tmp_path):
    code, lines = finish_within(_start(drip, tmp_path, timeout_s=2), CHILD_TIMEOUT_S)
    assert code == 2 and len(lines) == 1, lines
    assert re.fullmatch(rf"polyfsdp-train: error: reward\.judge \({re.escape(drip.url)}\) POST /chat/completions: no "
                        rf"answer within reward\.judge\.timeout_s=2 s \(record .+\)", lines[0]), lines


@pytest.mark.parametrize("signum,code,how", [(signal.SIGTERM, 143, "stopped by SIGTERM while waiting for "
                                                                     "reward.judge ({url})"),
                                             (signal.SIGINT, 130, "interrupted")])
def test_a_stop_ends_a_run_whose_judge_is_dripping(drip, tmp_path, signum, code, how):
    proc = _start(drip, tmp_path, timeout_s=600, preexec_fn=as_at_a_terminal)
    try:
        assert drip.post_seen.wait(240), "the run never asked the judge"
    finally:
        if proc.poll() is None:
            proc.send_signal(signum)
    status, lines = finish_within(proc, CHILD_TIMEOUT_S)
    assert status == code and len(lines) == 1, (status, lines)
    assert lines[0].startswith(f"polyfsdp-train: {how.format(url=drip.url)} before the first step; no checkpoint "
                               f"yet; continue with: polyfsdp-train "), lines

"""HCCL's timeouts reach the environment before the process group starts, and torch's
process-group timeout follows them (checked on gloo, without hardware); the vLLM sleep-mode
conflict of expandable_segments is one line."""
from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from polyfsdp.backends import destroy_distributed, init_distributed
from polyfsdp.backends.cpu import CPUBackend
from polyfsdp.backends.cuda import CUDABackend
from polyfsdp.backends.hccl_settings import apply_hccl_settings
from polyfsdp.backends.npu import NPUBackend


def test_defaults_fill_only_what_the_user_left_unset():
    environ = {}
    timeout_s, line = apply_hccl_settings(environ)
    assert environ == {"HCCL_CONNECT_TIMEOUT": "1800", "HCCL_EXEC_TIMEOUT": "3600"}
    assert timeout_s == 3660
    assert line == ("hccl: HCCL_CONNECT_TIMEOUT=1800 (polyfsdp default; set it to override), HCCL_EXEC_TIMEOUT=3600 "
                    "(polyfsdp default; set it to override); process-group timeout 3660 s")
    environ = {"HCCL_EXEC_TIMEOUT": "7200"}
    timeout_s, line = apply_hccl_settings(environ)
    assert environ["HCCL_EXEC_TIMEOUT"] == "7200" and environ["HCCL_CONNECT_TIMEOUT"] == "1800"
    assert timeout_s == 7260 and "HCCL_EXEC_TIMEOUT=7200 (yours)" in line
    assert apply_hccl_settings({"HCCL_EXEC_TIMEOUT": "0"})[0] == 86400  # 0: HCCL never times out


@pytest.mark.parametrize("name,value", [("HCCL_CONNECT_TIMEOUT", "60"), ("HCCL_CONNECT_TIMEOUT", "7201"),
                                        ("HCCL_EXEC_TIMEOUT", "-1"), ("HCCL_EXEC_TIMEOUT", "1h")])
def test_a_value_outside_the_documented_range_is_one_line_naming_it(name, value):
    with pytest.raises(ValueError) as info:
        apply_hccl_settings({name: value})
    message = str(info.value)
    assert message.startswith(f"{name}={value!r} must be a whole number of seconds in ") and "\n" not in message


class _GlooWithHcclSettings(CPUBackend):
    """The CPU backend (gloo) preparing its process group as the NPU backend does."""

    prepare_process_group = NPUBackend.prepare_process_group


def test_init_distributed_applies_the_settings_before_the_group_starts(monkeypatch, caplog):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "HCCL_CONNECT_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "1200")
    seen = {}
    real_init = dist.init_process_group

    def recording_init(*args, **kwargs):
        seen["timeout_s"] = kwargs["timeout"].total_seconds()
        seen["connect"] = os.environ.get("HCCL_CONNECT_TIMEOUT")
        return real_init(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", recording_init)
    destroy_distributed(wait_for_peers=False)  # an earlier test's one-rank group would skip the start
    caplog.set_level("INFO", logger="polyfsdp.backends.distributed")
    init_distributed(_GlooWithHcclSettings())
    try:
        assert seen == {"timeout_s": 1260.0, "connect": "1800"}
        assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("hccl: ")] == [
            "hccl: HCCL_CONNECT_TIMEOUT=1800 (polyfsdp default; set it to override), HCCL_EXEC_TIMEOUT=1200 (yours); "
            "process-group timeout 1260 s"]
    finally:
        destroy_distributed()


def test_other_backends_keep_their_process_group_timeout(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    assert CPUBackend().prepare_process_group({}) == (600.0, None)
    environ = {}
    CPUBackend().prepare_process_group(environ)
    assert environ == {}


def test_expandable_segments_with_the_vllm_rollout_is_one_line():
    npu = NPUBackend()
    conf = {"PYTORCH_NPU_ALLOC_CONF": "page_size:1g,expandable_segments:True"}
    line = npu.vllm_sleep_mode_conflict(True, conf)
    assert line.startswith("PYTORCH_NPU_ALLOC_CONF='page_size:1g,expandable_segments:True' turns on "
                           "expandable_segments, which vLLM's sleep mode cannot run with") and "\n" not in line
    assert npu.vllm_sleep_mode_conflict(False, conf) is None
    assert npu.vllm_sleep_mode_conflict(True, {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:False"}) is None
    assert npu.vllm_sleep_mode_conflict(True, {}) is None
    # The same conflict on GPUs, through torch's CUDA allocator variable; the CPU has none.
    assert CUDABackend().vllm_sleep_mode_conflict(True, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert CPUBackend().vllm_sleep_mode_conflict(True, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) is None

"""The terms issue 42 (item 3) added to ``--estimate``, against arithmetic on a tiny model:
FSDP2's unsharded copies on a sharded model, AdamW's step temporaries, the process baseline and
glibc's heap slack on the CPU (``peak(live=True)`` leaves them out), a colocated vLLM engine's
weights and KV cache (without importing vLLM), and the line saying what activation
checkpointing would leave of a peak its activations dominate (and that the checkpointed job
is counted the same way)."""
import json
import sys

import pytest

from polyfsdp.engines.config import EngineConfig, ModelConfig
from polyfsdp.engines.memory import HOST_HEAP_SLACK, HOST_HEAP_SLACK_CHURN, HOST_PROCESS_BYTES, MIB, ModelMemory
from polyfsdp.engines.presets import preset_config
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.run.estimate import _hf_config, _Lengths, estimate_job
from tests.cpu.trainer.run.test_job_memory_estimate import QWEN2_7B

TINY = "llama-tiny"  # no biases, untied embeddings (the job's llama ties them)
RL = ["trainer.prompts_per_step=8", "algo.actor.group_size=4", "algo.actor.max_new_tokens=16"]


def _shapes(c=None):
    """``(config, parameters of a decoder layer, of the root)`` of llama-tiny or ``c`` (a llama)."""
    c = c or preset_config(TINY)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv, h = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim, c.hidden_size
    layer = h * q + 2 * h * kv + q * h + 3 * h * c.intermediate_size + 2 * h  # projections, MLP, two norms
    root = c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + h         # embedding(s), final norm
    return c, layer, root


def _steps(est, phase="grpo"):
    return {s.name: s for s in est.steps[phase]}


def test_fsdp2_copies_are_the_root_and_two_layers_and_their_gradients():
    c, layer, root = _shapes()
    model = ModelConfig(preset=TINY)
    assert ModelMemory(model, EngineConfig(), 1).fsdp_forward == 0  # one rank, no casts: the plain model
    two = ModelMemory(model, EngineConfig(), 2)
    assert two.fsdp_forward == (root + 2 * layer) * 4
    assert two.fsdp_backward == (root + layer) * 4
    bf16 = ModelMemory(model, EngineConfig(param_dtype="bfloat16", reduce_dtype="float32"), 1)  # casts: sharded
    assert (bf16.fsdp_forward, bf16.fsdp_backward) == ((root + 2 * layer) * 2, (root + layer) * 4)
    never = ModelMemory(model, EngineConfig(reshard_policy="never"), 2)
    assert never.fsdp_forward == (root + c.num_hidden_layers * layer) * 4
    # A training micro-batch counts them; a no-grad pass counts the forward's.
    assert two.train_step(64, False) - ModelMemory(model, EngineConfig(), 1).train_step(64, False) == \
        two.fsdp_forward + two.fsdp_backward


def test_adamw_step_temporaries_follow_the_kernel():
    c, _, root = _shapes()
    memory = ModelMemory(ModelConfig(preset=TINY), EngineConfig(), 1)
    largest = c.vocab_size * c.hidden_size * 4  # an embedding
    assert memory.optimizer_step("for_loop", host_backend=False) == 2 * largest  # sqrt and its quotient
    assert memory.optimizer_step("auto", host_backend=True) == 2 * largest       # torch's choice on the CPU
    assert memory.optimizer_step("foreach", host_backend=False) == memory.grads  # sqrt of every shard
    assert memory.optimizer_step("auto", host_backend=False) == memory.grads
    assert memory.optimizer_step("fused", host_backend=False) == 0
    offload = ModelMemory(ModelConfig(preset=TINY), EngineConfig(offload="optimizer"), 1)
    assert offload.optimizer_step("auto", host_backend=False) == 0  # stepped on the host


@pytest.mark.parametrize("extra, churn", [([], False), (["model.lora.rank=4"], True),
                                          (["engine.gradient_checkpointing=true"], True)],
                         ids=["full", "lora", "checkpointed"])
def test_cpu_counts_the_process_and_the_heap_slack_of_a_backward(extra, churn):
    if "model.lora.rank=4" in extra:
        pytest.importorskip("peft", reason="LoRA needs peft (pip install -e '.[lora]')")
    est = estimate_job(load_config(["backend=cpu", *RL, *extra]), world_size=1)
    assert est.state["grpo"]["process baseline (python, torch, ...)"] == HOST_PROCESS_BYTES == est.process
    steps = _steps(est)
    update = steps["actor update micro-batch"]
    share = HOST_HEAP_SLACK_CHURN if churn else HOST_HEAP_SLACK
    assert update.heap == int(update.activations * share) > 0
    assert all(s.heap == 0 for s in steps.values() if "update" not in s.name)  # no-grad passes, generation
    peak, where = est.peak()
    live, _ = est.peak(live=True)
    assert where == "grpo: actor update micro-batch" and peak - live == HOST_PROCESS_BYTES + update.heap
    # A GPU's rows are device memory: no process row, no heap slack.
    gpu = estimate_job(load_config(["backend=cuda", *RL, *extra]), world_size=1)
    assert gpu.process == 0 and "process baseline (python, torch, ...)" not in gpu.state["grpo"]
    assert gpu.peak()[0] == gpu.peak(live=True)[0] == live


def test_vllm_row_is_its_weights_and_kv_cache_and_vllm_is_not_imported():
    rl = ["model=llama", *RL]
    job = load_config(rl)
    c, layer, root = _shapes(_hf_config(job, _Lengths(job).tokenizer))  # the job's model: its vocabulary sized
    assert c.tie_word_embeddings
    weights = (root + c.num_hidden_layers * layer + c.vocab_size * c.hidden_size) * 4  # its output embedding untied
    cpu = estimate_job(load_config(["backend=cpu", "rollout.engine=vllm", *rl]), world_size=1)
    assert cpu.state["grpo"]["vLLM (weights + 512 MiB KV cache)"] == weights + 512 * MIB  # held throughout on the CPU
    steps = _steps(cpu)
    assert steps["rollout generation (vLLM)"].transient == 0 and steps["held-out evaluation (vLLM)"].transient == 0
    assert "rollout generation (KV cache)" not in steps  # vLLM samples, not the decoding loop
    # A GPU: vLLM sleeps (level 2) while the trainer steps and wakes with its KV cache to sample.
    gpu = estimate_job(load_config(["backend=cuda", "rollout.engine=vllm", "rollout.vllm.kv_cache_mb=64", *rl]),
                       world_size=1)
    assert gpu.state["grpo"]["vLLM (weights + 64 MiB KV cache)"] == 0
    assert _steps(gpu)["rollout generation (vLLM)"].transient == weights + 64 * MIB
    awake = estimate_job(load_config(["backend=cuda", "rollout.engine=vllm", "rollout.vllm.kv_cache_mb=64",
                                      "rollout.vllm.sleep_level=0", *rl]), world_size=1)
    assert awake.state["grpo"]["vLLM (weights + 64 MiB KV cache)"] == weights + 64 * MIB
    assert "vllm" not in sys.modules


def test_checkpointing_line_when_activations_dominate_and_the_checkpointed_job_is_counted(tmp_path):
    base = ["backend=cuda", "trainer.prompts_per_step=32", "algo.actor.group_size=8", "algo.actor.max_new_tokens=64"]
    est = estimate_job(load_config(base), world_size=1)
    update = _steps(est)["actor update micro-batch"]
    line = next(n for n in est.notes if "engine.gradient_checkpointing=true would cut them" in n)
    assert f"{update.checkpointed / 2 ** 30:.2f} GiB" in line and update.checkpointed < update.activations
    on = estimate_job(load_config([*base, "engine.gradient_checkpointing=true"]), world_size=1)
    counted = _steps(on)["actor update micro-batch"]
    assert counted.activations == update.checkpointed and counted.checkpointed is None  # the same figure, counted
    assert f"(peak {on.peak()[0] / 2 ** 30:.2f} GiB)" in line
    assert not any("gradient_checkpointing" in n for n in on.notes)
    # Model state dominates (a 7B model, one prompt): no line.
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_7B))
    small = estimate_job(load_config([f"model.path={tmp_path}", "backend=cuda", "trainer.prompts_per_step=1",
                                      "algo.actor.group_size=2", "algo.actor.max_new_tokens=1"]), world_size=1)
    assert not any("gradient_checkpointing" in n for n in small.notes)

"""vLLM (rollout.engine=vllm, trainer/rollout/vllm.py) with images, on tiny Qwen2-VL and Qwen2.5-VL
checkpoints (head size 32, as vLLM's CPU attention needs): prompts with 0, 1 and 2 images decode
greedily to our loop's tokens; after a GRPO step through vLLM (the tower's weights change and are
synced), the log-probs vLLM reports for the tokens it sampled equal an independent reference,
Hugging Face's forward of each sequence alone renormalized without the image placeholders (which
neither sampler draws), to 1e-5."""
import random
import warnings

import pytest
import torch

from polyfsdp.backends.registry import get_backend
from polyfsdp.trainer.algos.rl_step import RLContext, StepSeeds, rl_step
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.config.sections import RolloutSection
from polyfsdp.trainer.data.chat import PromptEncoder
from polyfsdp.trainer.data.count_squares import CountSquaresTask
from polyfsdp.trainer.rollout.build import build_rollout_engine
from polyfsdp.trainer.rollout.decode import decode
from polyfsdp.trainer.rollout.drivers.single_turn import SingleTurnDriver
from polyfsdp.trainer.rollout.engines import SamplingParams
from polyfsdp.trainer.rollout.generate import _left_padded
from tests.helpers.vllm_cases import require_vllm
from tests.helpers.vllm_images import PRESETS, TOK, image_prompts, reference_log_probs, vlm_policy

warnings.filterwarnings("ignore", message=".*torchvision.*")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``preset -> (policy, vLLM engine, processor)``, built on first use, closed at the end."""
    require_vllm()
    built = {}

    def get(preset):
        if preset not in built:
            policy, processor = vlm_policy(preset, tmp_path_factory.mktemp(preset))
            engine = build_rollout_engine(RolloutSection(engine="vllm", check_sync_tol=1e-5), get_backend(),
                                          processor_factory=lambda: processor)
            built[preset] = policy, engine, processor
        return built[preset]

    yield get
    for _, engine, _ in built.values():
        engine.close()


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_completions_with_images_equal_the_builtin_loop(served, preset):
    policy, vllm, processor = served(preset)
    rows = image_prompts(processor)
    assert rows[0].prompt_ids == rows[3].prompt_ids  # same tokens, other pixels
    params = SamplingParams(10, greedy=True, stop_token_ids=(TOK.eos_token_id,), pad_token_id=TOK.pad_token_id)
    vllm.update_weights(policy)
    served_rows = vllm.generate([list(r.prompt_ids) for r in rows], params, images=rows).token_ids
    ids, mask = _left_padded([list(r.prompt_ids) for r in rows], TOK.pad_token_id)
    ours = decode(policy.module.eval(), ids, mask, params, images=rows)
    assert served_rows == ours
    assert served_rows[0] != served_rows[3] or served_rows[0] != served_rows[2]  # the pixels reach the model


@pytest.mark.parametrize("preset", PRESETS)
def test_sampled_log_probs_equal_the_reference_after_a_grpo_step(served, preset):
    policy, vllm, processor = served(preset)
    cfg = load_config(["algo.actor.group_size=4", "trainer.prompts_per_step=2", "algo.actor.kl_coef=0",
                       "algo.actor.max_new_tokens=6"])
    encoder = PromptEncoder(TOK, processor=processor)
    task = CountSquaresTask()
    examples = [encoder.encode(task.sample(random.Random(i))) for i in range(2)]
    tower = [p.detach().clone() for n, p in policy.module.named_parameters() if "visual" in n]
    rl_step(RLContext(policy, TOK, cfg.algo, cfg.algo.actor_loss(4), driver=SingleTurnDriver(vllm)), examples,
            StepSeeds(0))
    moved = max((p.detach() - b).abs().max().item()
                for p, b in zip([p for n, p in policy.module.named_parameters() if "visual" in n], tower))
    assert moved > 1e-4  # the tower trained: the sync below must carry it
    rows = image_prompts(processor)
    params = SamplingParams(8, temperature=1.0, stop_token_ids=(TOK.eos_token_id,), pad_token_id=TOK.pad_token_id,
                            return_log_probs=True)
    vllm.update_weights(policy)  # syncs the step, checks the text probe
    out = vllm.generate([list(r.prompt_ids) for r in rows], params, seeds=[11, 12, 13, 14], images=rows)
    model = policy.module.eval()
    for row, completion, sampled in zip(rows, out.token_ids, out.log_probs):
        reference = reference_log_probs(model, row, completion)
        assert max(abs(a - b) for a, b in zip(sampled, reference)) < 1e-5, (row.where, sampled, reference)


def test_the_image_probe_catches_a_tower_vllm_serves_stale(served, monkeypatch):
    """check_sync's second probe runs the tower: vLLM reusing image features encoded before a sync
    (its encoder cache, what the sync resets) stops the run, as a missed sync would."""
    from polyfsdp.trainer.errors import ConfigError
    from polyfsdp.trainer.rollout import vllm_adapter

    policy, vllm, _ = served("qwen2-vl-tiny")
    vllm.update_weights(policy)
    vllm.check(policy)  # the probe's picture, encoded with these weights, is in vLLM's encoder cache
    monkeypatch.setattr(vllm_adapter, "drop_stale_caches", lambda llm: llm.reset_prefix_cache())
    with torch.no_grad():
        for name, parameter in policy.module.named_parameters():
            if "visual.blocks" in name:
                parameter.add_(0.05 * torch.randn_like(parameter))
    policy.weights_version += 1  # what an optimizer step does
    with pytest.raises(ConfigError, match=r"rollout.check_sync: after weight sync \d+, vLLM's log-probs of the probe"):
        vllm.update_weights(policy)


def test_a_prompt_whose_images_vllm_expands_otherwise_is_one_line(served):
    """vLLM ran the prompt's images as other image tokens than the trainer's sequence holds (here:
    the prompt lost one): nothing it samples would match what the trainer trains on, so it stops."""
    from polyfsdp.trainer.errors import ConfigError

    policy, vllm, processor = served("qwen2-vl-tiny")
    vllm.update_weights(policy)
    row = image_prompts(processor)[0]
    prompt = list(row.prompt_ids)
    prompt.remove(policy.module.config.image_token_id)
    params = SamplingParams(2, greedy=True, stop_token_ids=(TOK.eos_token_id,), pad_token_id=TOK.pad_token_id)
    with pytest.raises(ConfigError, match=r"^rollout.engine=vllm: vLLM's processor ran the prompt as \d+ tokens "
                                          r"\(\d+ image tokens\), the trainer's sequence holds \d+ \(\d+\), first "
                                          r"different at position \d+: vLLM must load the run's processor"):
        vllm.generate([prompt], params, [1], images=[row])

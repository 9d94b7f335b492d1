"""``rollout.engine=vllm_server`` with images (trainer/rollout/servers/: vision_serving.py,
completions.py) on a tiny Qwen2-VL checkpoint served by a real vLLM server polyfsdp starts: prompts
with 0, 1 and 2 images decode greedily to our loop's tokens; after a GRPO step through the server
(the vision tower trains and is pushed), the log-probs the server reports for the tokens it sampled
equal an independent reference (Hugging Face's forward of each sequence alone, renormalized
without the placeholders) to 1e-5, and the sync's check (its image probe included) holds at
1e-5; a round sampled ahead on a background thread (asynchronous RL) carries the images as the
driver's own call does; a server whose processor sizes an image otherwise is one line; and
``polyfsdp-train`` runs SFT + asynchronous GRPO on images through a server it starts."""
import random
import warnings

import pytest
import torch

from polyfsdp.backends.registry import get_backend
from polyfsdp.trainer.algos.rl_step import RLContext, StepSeeds, rl_step
from polyfsdp.trainer.algos.sample_ahead import BackgroundRound
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.config.sections import RolloutSection
from polyfsdp.trainer.data.chat import PromptEncoder
from polyfsdp.trainer.data.count_squares import CountSquaresTask
from polyfsdp.trainer.rollout.build import build_rollout_engine
from polyfsdp.trainer.rollout.decode import decode
from polyfsdp.trainer.rollout.drivers.single_turn import SingleTurnDriver
from polyfsdp.trainer.rollout.engines import SamplingParams
from polyfsdp.trainer.rollout.generate import _left_padded
from polyfsdp.trainer.rollout.servers.engine import ServerRolloutEngine
from polyfsdp.trainer.rollout.servers.http import ServerError
from polyfsdp.trainer.tracking.metrics import read_metrics
from polyfsdp.trainer.train import main
from tests.helpers.vllm_cases import require_vllm
from tests.helpers.vllm_images import SIZES, TOK, image_prompts, reference_log_probs, vlm_policy

warnings.filterwarnings("ignore", message=".*torchvision.*")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(policy, server engine, processor)`` on one started server (~40 s to start)."""
    require_vllm()
    policy, processor = vlm_policy("qwen2-vl-tiny", tmp_path_factory.mktemp("qwen2-vl-tiny"))
    section = RolloutSection(engine="vllm_server", check_sync_tol=1e-5, vllm={"kv_cache_mb": 64})
    engine = build_rollout_engine(section, get_backend(), log_dir=str(tmp_path_factory.mktemp("logs")),
                                  processor_factory=lambda: processor)
    yield policy, engine, processor
    engine.close()


def _sampled(max_new_tokens=8):
    return SamplingParams(max_new_tokens, temperature=1.0, stop_token_ids=(TOK.eos_token_id,),
                          pad_token_id=TOK.pad_token_id, return_log_probs=True)


def test_greedy_completions_with_images_equal_the_builtin_loop(served):
    policy, engine, processor = served
    rows = image_prompts(processor)
    params = SamplingParams(10, greedy=True, stop_token_ids=(TOK.eos_token_id,), pad_token_id=TOK.pad_token_id)
    engine.update_weights(policy)  # starts the server; check_sync runs both probes at 1e-5
    assert engine.last_sync_error < 1e-5
    served_rows = engine.generate([list(r.prompt_ids) for r in rows], params, images=rows).token_ids
    ids, mask = _left_padded([list(r.prompt_ids) for r in rows], TOK.pad_token_id)
    assert served_rows == decode(policy.module.eval(), ids, mask, params, images=rows)
    assert served_rows[0] != served_rows[3] or served_rows[0] != served_rows[2]  # the pixels reach the model


def test_sampled_log_probs_equal_the_reference_after_a_grpo_step(served):
    policy, engine, processor = served
    cfg = load_config(["algo.actor.group_size=4", "trainer.prompts_per_step=2", "algo.actor.kl_coef=0",
                       "algo.actor.max_new_tokens=6"])
    encoder = PromptEncoder(TOK, processor=processor)
    examples = [encoder.encode(CountSquaresTask().sample(random.Random(i))) for i in range(2)]
    tower = {n: p.detach().clone() for n, p in policy.module.named_parameters() if "visual" in n}
    rl_step(RLContext(policy, TOK, cfg.algo, cfg.algo.actor_loss(4), driver=SingleTurnDriver(engine)), examples,
            StepSeeds(0))
    moved = max((p.detach() - tower[n]).abs().max().item() for n, p in policy.module.named_parameters() if n in tower)
    assert moved > 1e-4  # the tower trained: the sync below must carry it
    version = engine.weight_version
    engine.update_weights(policy)  # pushes the step; both probes checked at 1e-5
    assert engine.weight_version == version + 1 and engine.last_sync_error < 1e-5
    rows = image_prompts(processor)
    out = engine.generate([list(r.prompt_ids) for r in rows], _sampled(), seeds=[11, 12, 13, 14], images=rows)
    model = policy.module.eval()
    for row, completion, sampled in zip(rows, out.token_ids, out.log_probs):
        reference = reference_log_probs(model, row, completion)
        assert max(abs(a - b) for a, b in zip(sampled, reference)) < 1e-5, (row.where, sampled, reference)


def test_a_round_sampled_ahead_carries_the_images(served):
    policy, engine, processor = served
    engine.update_weights(policy)
    rows = image_prompts(processor)
    prompts, seeds = [list(r.prompt_ids) for r in rows], [5, 6, 7, 8]
    direct = engine.generate(prompts, _sampled(), seeds, images=rows)
    ahead = BackgroundRound(engine, prompts, _sampled(), seeds, SingleTurnDriver.row_images(rows, 1)).wait()
    assert ahead.token_ids == direct.token_ids and _largest_gap(ahead, direct) < 1e-6
    # Negative control: the same rows without their images (the tiny model's near-uniform draws may
    # pick the same tokens, but not with the same log-probs).
    blind = BackgroundRound(engine, prompts, _sampled(), seeds).wait()
    assert blind.token_ids != direct.token_ids or _largest_gap(blind, direct) > 1e-3


def _largest_gap(a, b) -> float:
    return max(abs(x - y) for p, q in zip(a.log_probs, b.log_probs) for x, y in zip(p, q))


def test_a_server_whose_processor_sizes_an_image_otherwise_is_one_line(served):
    """The server's processor made more image tokens of a prompt's image than the trainer's (here:
    the prompt lost one): nothing it samples would match the trainer's sequence, so it stops."""
    policy, engine, processor = served
    engine.update_weights(policy)
    row = image_prompts(processor)[0]
    image = policy.module.config.image_token_id
    prompt = list(row.prompt_ids)
    prompt.remove(image)
    with pytest.raises(ServerError, match=r"^rollout server 0 \(http://[\d.:]+\): vLLM's processor ran the prompt as "
                                          r"\d+ tokens \(\d+ image tokens\), the trainer's sequence holds \d+ \(\d+\), "
                                          r"first different at position \d+: vLLM must load the run's processor"):
        engine.generate([prompt], _sampled(2), [1], images=[row])


def test_an_sft_and_asynchronous_grpo_job_samples_every_round_with_its_images(tmp_path, monkeypatch):
    """The job hands the server engine the run's processor; every round, the ones sampled ahead on the
    background thread (rollout.max_staleness=1) included, carries its rows' images; the first GRPO
    step's mismatch is the placeholders' known gap (trained and sampled with the same weights)."""
    require_vllm()
    calls, generate = [], ServerRolloutEngine.generate

    def spy(self, prompts, params, seeds=None, images=None):
        calls.append(images is not None and all(ex.images for ex in images))
        return generate(self, prompts, params, seeds, images)

    monkeypatch.setattr(ServerRolloutEngine, "generate", spy)
    threads = torch.get_num_threads()
    try:
        assert main(["model=qwen2_vl", *(f"+model.overrides.{k}={v}" for k, v in SIZES.items() if k != "rope_parameters"),
                     "+model.overrides.rope_parameters={rope_type:default,rope_theta:10000.0,mrope_section:[4,6,6]}",
                     "data.task=count_squares", "rollout.engine=vllm_server", "rollout.vllm.kv_cache_mb=64",
                     "rollout.max_staleness=1", "trainer.sft_steps=1", "trainer.rl_steps=3", "data.eval_size=4",
                     "algo.actor.max_new_tokens=4", "algo.rollout_correction.report_mismatch=true",
                     "trainer.progress=off", "trainer.plot=false", "trainer.export=false",
                     f"trainer.output_dir={tmp_path}"]) == 0
    finally:
        torch.set_num_threads(threads)
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["async/staleness"] for r in rl] == [0.0, 1.0, 1.0] and rl[0]["async/overlapped"] == 1.0
    assert len(calls) >= 4 and all(calls), calls  # 3 evaluations + 3 GRPO batches, 2 of them sampled ahead
    # -log(1 - the placeholders' mass): 2 of 128 tokens of a random model, about 1/64 (docs/vision-language.md).
    assert 0.005 < rl[0]["rollout_mismatch_abs_mean"] < 0.03, rl[0]["rollout_mismatch_abs_mean"]

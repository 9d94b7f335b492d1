"""The sampling controls beyond temperature (issue 42, item 4): top-k, top-p and repetition
penalty (trainer/rollout/controls/logits_shaping.py) against Hugging Face's own logits processors, vLLM's
own functions and a float64 filter written here; in our decoding loop and HF ``generate`` the
log-probs recorded are those of the filtered distribution the token was drawn from; stop
strings end a completion at the token completing them (trainer/rollout/controls/stop_strings.py); the
defaults leave the sampler's numbers bit for bit as they were."""
import math

import pytest
import torch

from polyfsdp.trainer.rollout.decode import decode, prompt_tokens_seen
from polyfsdp.trainer.rollout.engines import SamplingParams
from polyfsdp.trainer.rollout.generate import _hf_generate, _left_padded
from polyfsdp.trainer.rollout.controls.logits_shaping import shape_logits
from polyfsdp.trainer.rollout.row_seeds import RowSeeds
from polyfsdp.trainer.rollout.controls.stop_strings import StopStrings, cut_completions

from tests.cpu.trainer.rollout.test_decode_loop import PROMPTS, TOK, _engine, _params

VOCAB = 50


def _logits_and_seen(rows: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * 3
    ids = torch.randint(0, VOCAB, (rows, 12), generator=g)
    seen = torch.zeros(rows, VOCAB, dtype=torch.bool)
    seen[torch.arange(rows)[:, None], ids] = True
    return logits, ids, seen


def _reference_probs(logits, seen, temperature, top_k, top_p, penalty):
    """The controls as their definitions read, in float64, row by row: penalise the seen tokens,
    divide by the temperature, keep the k largest, then the fewest most likely tokens whose
    probability reaches top_p (a token whose cumulative mass from the least likely side is
    <= 1 - p goes); the kept tokens' renormalised probabilities."""
    out = torch.zeros(logits.shape, dtype=torch.float64)
    for r in range(logits.shape[0]):
        x = logits[r].double().tolist()
        x = [(v / penalty if v > 0 else v * penalty) if seen[r, i] else v for i, v in enumerate(x)]
        x = [v / temperature for v in x]
        order = sorted(range(VOCAB), key=lambda i: -x[i])
        kept = order[:top_k] if top_k > 0 else order
        z = sum(math.exp(x[i]) for i in kept)
        p = {i: math.exp(x[i]) / z for i in kept}
        ascending, mass, dropped = sorted(kept, key=lambda i: p[i]), 0.0, set()
        for i in ascending[:-1]:
            mass += p[i]
            if mass <= 1 - top_p:
                dropped.add(i)
        z = sum(p[i] for i in kept if i not in dropped)
        for i in kept:
            if i not in dropped:
                out[r, i] = p[i] / z
    return out


CONTROLS = [dict(top_k=5), dict(top_p=0.8), dict(repetition_penalty=1.5), dict(repetition_penalty=0.7),
            dict(top_k=10, top_p=0.6, repetition_penalty=1.3, temperature=0.7)]


@pytest.mark.parametrize("controls", CONTROLS)
def test_each_control_equals_a_float64_filter_written_from_its_definition(controls):
    logits, _, seen = _logits_and_seen()
    params = SamplingParams(4, **{"temperature": 1.0, **controls})
    ours = torch.softmax(shape_logits(logits, params, seen), -1).double()
    ref = _reference_probs(logits, seen, params.temperature, params.top_k, params.top_p, params.repetition_penalty)
    assert torch.equal(ours > 0, ref > 0)  # the same tokens kept
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("controls", CONTROLS)
def test_each_control_equals_hugging_faces_logits_processors(controls):
    from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                              TopKLogitsWarper, TopPLogitsWarper)

    logits, ids, seen = _logits_and_seen(seed=1)
    params = SamplingParams(4, **{"temperature": 1.0, **controls})
    hf = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(params.repetition_penalty),
                              TemperatureLogitsWarper(params.temperature)]
                             + ([TopKLogitsWarper(params.top_k)] if params.top_k > 0 else [])
                             + ([TopPLogitsWarper(params.top_p)] if params.top_p < 1 else []))
    torch.testing.assert_close(shape_logits(logits, params, seen), hf(ids, logits.clone()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("controls", CONTROLS)
def test_each_control_equals_vllms_own_functions(controls):
    vllm_ops = pytest.importorskip("vllm._custom_ops")
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    logits, _, seen = _logits_and_seen(seed=2)
    params = SamplingParams(4, **{"temperature": 1.0, **controls})
    theirs = logits.clone()
    rows = logits.shape[0]
    vllm_ops.apply_repetition_penalties_torch(theirs, seen, torch.zeros_like(seen),
                                              torch.full((rows,), params.repetition_penalty))
    theirs = theirs / params.temperature
    k = torch.full((rows,), params.top_k) if params.top_k > 0 else None
    p = torch.full((rows,), params.top_p) if params.top_p < 1 else None
    theirs = apply_top_k_top_p_pytorch(theirs, k, p)
    torch.testing.assert_close(shape_logits(logits, params, seen), theirs, rtol=1e-6, atol=1e-6)


def test_the_defaults_are_logits_over_temperature_bit_for_bit():
    logits, _, _ = _logits_and_seen()
    assert torch.equal(shape_logits(logits, SamplingParams(4, temperature=0.7)), logits.float() / 0.7)
    assert torch.equal(shape_logits(logits, SamplingParams(4, greedy=True)), logits.float())
    assert torch.equal(shape_logits(logits, SamplingParams(4, top_k=-1)), logits.float())


def _recomputed(model, prompt, row, params):
    """Each token's log-prob under the shaped distribution, from one plain forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + row])).logits[0, len(prompt) - 1:-1]
    out = []
    for t, tok in enumerate(row):
        seen = torch.zeros(1, logits.shape[-1], dtype=torch.bool)
        seen[0, prompt + row[:t]] = True
        out.append(float(torch.log_softmax(shape_logits(logits[t:t + 1], params, seen), -1)[0, tok]))
    return out


@pytest.mark.parametrize("loop", ["builtin", "hf"])
def test_sampled_log_probs_are_the_filtered_distributions_and_both_loops_draw_alike(loop):
    model = _engine("qwen2-tiny").module.eval()
    prompts = PROMPTS * 2
    params = _params(8, TOK.encode("a")[0], temperature=0.9, log_probs=True, top_k=8, top_p=0.9,
                     repetition_penalty=1.4)
    seeds = RowSeeds(4, 1).rows(0, len(prompts), 1)
    ids, mask = _left_padded(prompts, TOK.pad_token_id)
    ours = decode(model, ids, mask, params, row_seeds=seeds)
    rows, log_probs = ours if loop == "builtin" else _hf_generate(model, ids, mask, params, False, row_seeds=seeds)
    if loop == "hf":
        cut = [r[:len(h)] for r, h in zip(ours[0], rows)]  # HF drops a trailing sampled pad
        assert cut == rows
    for prompt, row, lp in zip(prompts, rows, log_probs):
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(_recomputed(model, prompt, row, params)),
                                   rtol=1e-4, atol=1e-4)
        assert all(math.isfinite(x) for x in lp)  # every drawn token was inside the filter


def test_top_k_1_samples_the_greedy_completion():
    model = _engine("qwen2-tiny").module.eval()
    ids, mask = _left_padded(PROMPTS, TOK.pad_token_id)
    greedy = decode(model, ids, mask, _params(6, TOK.eos_token_id, greedy=True))
    assert decode(model, ids, mask, _params(6, TOK.eos_token_id, top_k=1)) == greedy


def test_greedy_repetition_penalty_equals_hf_generates_own_per_prompt():
    """HF's own processor over an unpadded prompt (it counts pad tokens of a padded batch as seen,
    ours never does) against our loop over the padded batch."""
    from transformers import GenerationConfig

    model = _engine("qwen2-tiny").module.eval()
    params = _params(8, TOK.eos_token_id, greedy=True, repetition_penalty=1.8)
    ids, mask = _left_padded(PROMPTS, TOK.pad_token_id)
    ours = decode(model, ids, mask, params)
    plain = decode(model, ids, mask, _params(8, TOK.eos_token_id, greedy=True))
    assert ours != plain  # the penalty changes what greedy picks
    for prompt, row in zip(PROMPTS, ours):
        config = GenerationConfig(max_new_tokens=8, do_sample=False, repetition_penalty=1.8,
                                  eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)
        out = model.generate(input_ids=torch.tensor([prompt]), generation_config=config)
        assert out[0, len(prompt):].tolist() == row


def test_prompt_tokens_seen_skips_left_padding():
    ids, mask = _left_padded([[5, 6], [7]], TOK.pad_token_id)
    seen = prompt_tokens_seen(ids, mask, 10)
    assert seen[0].nonzero().flatten().tolist() == [5, 6]
    assert seen[1].nonzero().flatten().tolist() == [7]


def test_a_stop_string_ends_the_completion_at_the_token_completing_it():
    model = _engine("qwen2-tiny").module.eval()
    ids, mask = _left_padded(PROMPTS, TOK.pad_token_id)
    free = decode(model, ids, mask, _params(12, TOK.eos_token_id, greedy=True))
    text = TOK.decode(free[0])
    stop = text[2:4]  # two characters: completed by the fourth token at the latest
    params = _params(12, TOK.eos_token_id, greedy=True, stop=(stop,))
    stopped = decode(model, ids, mask, params)
    for row, full in zip(stopped, free):
        end = next((k for k in range(1, len(full) + 1) if stop in TOK.decode(full[:k])), None)
        assert row == (full if end is None else full[:end])
    assert stopped[0] == free[0][:text.index(stop) + 2]
    # The HF path (and every engine without a tokenizer) cuts after sampling: the same rows.
    assert cut_completions(free, None, params)[0] == stopped
    hf = _hf_generate(model, ids, mask, _params(12, TOK.eos_token_id, greedy=True), False)
    assert cut_completions(hf, None, params)[0] == stopped


def test_stop_strings_without_a_detokenizer_are_refused_and_log_probs_are_cut_alike():
    with pytest.raises(ValueError, match="detokenize"):
        StopStrings(SamplingParams(4, stop=("x",)))
    params = SamplingParams(4, stop=("bc",), detokenize=TOK.decode)
    tokens, log_probs = cut_completions([TOK.encode("abcd"), TOK.encode("ad")], [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0]],
                                        params)
    assert tokens == [TOK.encode("abc"), TOK.encode("ad")] and log_probs == [[1.0, 2.0, 3.0], [5.0, 6.0]]

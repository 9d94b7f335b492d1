"""Our decoding loop (trainer/rollout/decode.py) against Hugging Face: greedy completions equal
``generate``'s token for token (EOS cut and max_new_tokens included), sampled tokens carry
the log-probs a plain per-sequence forward gives them, and what is drawn follows the
model's distribution, also after finished rows have left the batch."""
import pytest
import torch

from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig
from polyfsdp.trainer.rollout.decode import _fsdp_free, _preallocated_cache, _ready_mask_ok, decode
from polyfsdp.trainer.rollout.engines import SamplingParams
from polyfsdp.trainer.rollout.generate import _hf_generate, _left_padded, generate
from polyfsdp.trainer.rollout.row_seeds import RowSeeds
from polyfsdp.trainer.data.tokenizers import CharTokenizer

TOK = CharTokenizer()
PROMPTS = [[TOK.bos_token_id] + TOK.encode(s) for s in ("abc=", "ba=", "hgfe=", "a=", "dcba+ab=")]


def _params(max_new_tokens: int, eos: int, greedy: bool = False, temperature: float = 1.0,
            log_probs: bool = False, **controls) -> SamplingParams:
    """The decoding loop's parameters: one stop token, the character tokenizer's pad."""
    return SamplingParams(max_new_tokens, greedy=greedy, temperature=temperature, stop_token_ids=(eos,),
                          return_log_probs=log_probs, pad_token_id=TOK.pad_token_id, detokenize=TOK.decode, **controls)


def _engine(preset: str, seed: int = 3):
    return FSDPEngine(ModelConfig(preset=preset, seed=seed, vocab_size=TOK.vocab_size), EngineConfig()).initialize()


def _mid_sequence_token(rows: list[list[int]]) -> int:
    """A token some greedy rows emit early and others never: as EOS it ends rows at
    different steps (finished rows leave the batch while others go on)."""
    counts = {}
    for row in rows:
        for tok in set(row[1:-1]):
            counts[tok] = counts.get(tok, 0) + 1
    partial = [t for t, c in counts.items() if 0 < c < len(rows)]
    assert partial, rows
    return partial[0]


@pytest.mark.parametrize("preset", ["qwen2-tiny", "qwen3-tiny", "llama-tiny", "gemma2-tiny"])
def test_greedy_completions_equal_hf_generate(preset):
    engine = _engine(preset)
    model = engine.module.eval()
    # Both step-mask paths are covered: a ready 4D mask (SDPA, full attention) and transformers'
    # own mask building (gemma2: sliding-window layers, eager attention for its softcap).
    assert _ready_mask_ok(model, _preallocated_cache(model, 8)) == (preset != "gemma2-tiny")
    ids, mask = _left_padded(PROMPTS, TOK.pad_token_id)
    free = _hf_generate(model, ids, mask, _params(12, TOK.unk_token_id, greedy=True), False)
    eos = _mid_sequence_token(free)
    hf = _hf_generate(model, ids, mask, _params(12, eos, greedy=True), False)
    ours = decode(model, ids, mask, _params(12, eos, greedy=True))
    assert ours == hf
    ended = [row for row in ours if row[-1] == eos]
    assert ended and len(ended) < len(ours)  # some rows stopped at EOS, others ran on
    assert all(row.count(eos) == 1 for row in ended)
    assert all(len(row) == 12 for row in ours if row[-1] != eos)
    # Through the rollout entry point too (the engine's eval mode, one rank).
    tok = CharTokenizer()
    tok.eos_token_id = eos
    assert generate(engine, PROMPTS, SamplingParams.for_tokenizer(tok, 12, greedy=True)).token_ids == hf


def test_max_new_tokens_bounds_and_zero():
    model = _engine("qwen2-tiny").module.eval()
    ids, mask = _left_padded(PROMPTS, TOK.pad_token_id)
    for n in (1, 5):
        out = decode(model, ids, mask, _params(n, TOK.eos_token_id))
        assert all(1 <= len(row) <= n for row in out)
        assert all(len(row) == n for row in out if row[-1] != TOK.eos_token_id)
    assert decode(model, ids, mask, _params(0, TOK.eos_token_id)) == [[] for _ in PROMPTS]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_match_a_plain_forward_per_sequence(temperature):
    model = _engine("qwen2-tiny").module.eval()
    ids, mask = _left_padded(PROMPTS * 3, TOK.pad_token_id)
    torch.manual_seed(0)
    eos = TOK.encode("a")[0]  # frequent: rows end at many different steps
    rows, log_probs = decode(model, ids, mask, _params(10, eos, temperature=temperature, log_probs=True))
    assert len({len(r) for r in rows}) > 2
    for prompt, row, lp in zip(PROMPTS * 3, rows, log_probs):
        seq = torch.tensor([prompt + row])
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0, len(prompt) - 1:-1].float() / temperature
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(row)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lp), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("draw", ["process_generator", "row_seeds", "hf_row_seeds"])
def test_sampling_follows_the_model_distribution_after_rows_leave(draw):
    """Frequencies of the first and (over rows still going) second token against the exact
    probabilities from plain forwards; a wrong temperature is told apart (negative control).
    Drawn from the process's generator, or per row (trainer/rollout/row_sampler.py) in our loop and
    through HF ``generate``'s logits processor."""
    model = _engine("qwen2-tiny").module.eval()
    with torch.no_grad():  # a peaked law (a random model's is near uniform): EOS likely, temperature visible
        model.get_output_embeddings().weight.mul_(12.0)
    prompt = [TOK.bos_token_id] + TOK.encode("ab=")
    n, temperature = 4000, 0.8
    ids, mask = _left_padded([prompt] * n, TOK.pad_token_id)
    with torch.no_grad():
        first = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        eos = int(first.argmax())  # the likeliest first token ends the row: many rows leave after step 1
        nexts = torch.softmax(model(input_ids=torch.tensor([prompt + [t] for t in range(TOK.vocab_size)]))
                              .logits[:, -1] / temperature, -1)
    go_on = first.clone()
    go_on[eos] = 0
    second = (go_on / go_on.sum()) @ nexts  # second token's law given the first was not EOS
    torch.manual_seed(1)
    seeds = None if draw == "process_generator" else RowSeeds(1, 0).rows(0, n, 1)
    if draw == "hf_row_seeds":
        rows = _hf_generate(model, ids, mask, _params(2, eos, temperature=temperature), False, row_seeds=seeds)
    else:
        rows = decode(model, ids, mask, _params(2, eos, temperature=temperature), row_seeds=seeds)
    seen_first = torch.bincount(torch.tensor([r[0] for r in rows]), minlength=TOK.vocab_size).float() / n
    later = [r[1] for r in rows if len(r) == 2]
    assert 0 < len(later) < n
    seen_second = torch.bincount(torch.tensor(later), minlength=TOK.vocab_size).float() / len(later)
    # 4.5 standard errors at the largest probability: a wrong law at these sizes is far off.
    tol = lambda p, m: 4.5 * float((p * (1 - p)).max().sqrt()) / m ** 0.5  # noqa: E731
    assert (seen_first - first).abs().max() < tol(first, n)
    assert (seen_second - second).abs().max() < tol(second, len(later))
    wrong = torch.softmax(torch.log(first) * temperature, -1)  # temperature 1 instead of 0.8
    assert (seen_first - wrong).abs().max() > tol(first, n)


def test_inference_mode_only_for_the_fsdp_free_model():
    """The plain one-rank model decodes in inference mode; an FSDP2-sharded one must not
    (its gathered weights outlive the call)."""
    assert _fsdp_free(_engine("qwen2-tiny").module)
    sharded = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=3, vocab_size=TOK.vocab_size),
                         EngineConfig(shard_single_rank=True)).initialize()
    assert not _fsdp_free(sharded.module)
    torch.manual_seed(0)
    assert generate(sharded, PROMPTS, SamplingParams.for_tokenizer(TOK, 4), unshard=True).token_ids  # sharded: no_grad


@pytest.mark.parametrize("preset", ["qwen2-tiny", "gemma2-tiny"])
def test_rows_sharing_a_prompt_prefill_it_once_and_decode_as_hf_generate(preset):
    """A GRPO batch holds each prompt group_size times: the prefill runs on the distinct prompts
    and copies their cache rows (our preallocated layers; gemma2: sliding-window layers too)."""
    model = _engine(preset).module.eval()
    prompts = [p for p in PROMPTS for _ in range(3)][::-1] + [PROMPTS[0]]
    ids, mask = _left_padded(prompts, TOK.pad_token_id)
    rows_seen = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: rows_seen.append(kw["input_ids"].shape), with_kwargs=True)
    eos = _mid_sequence_token(_hf_generate(model, ids, mask, _params(12, TOK.unk_token_id, greedy=True), False))
    rows_seen.clear()
    ours = decode(model, ids, mask, _params(12, eos, greedy=True))
    hook.remove()
    assert rows_seen[0] == (len(PROMPTS), ids.shape[1])  # the prefill: one row per distinct prompt
    assert ours == _hf_generate(model, ids, mask, _params(12, eos, greedy=True), False)
    seeds = RowSeeds(4, 0).rows(0, len(prompts), 1)
    sampled = decode(model, ids, mask, _params(6, eos, log_probs=True), row_seeds=seeds)
    hf = _hf_generate(model, ids, mask, _params(6, eos, log_probs=True), False, row_seeds=seeds)
    assert sampled[0] == hf[0]
    for ours_lp, hf_lp in zip(sampled[1], hf[1]):
        torch.testing.assert_close(torch.tensor(ours_lp), torch.tensor(hf_lp), rtol=1e-5, atol=1e-5)

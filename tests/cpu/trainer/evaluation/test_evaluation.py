"""trainer/evaluation/held_out.py against an independent computation on the same sampled completions:
pass@k by enumerating every k-subset, maj@n by counting votes, per data source; the table rows;
and the eval config's refusals."""
from __future__ import annotations

import itertools
from collections import Counter

import pytest

from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.evaluation.held_out import EvalSettings, evaluate
from polyfsdp.trainer.rollout.engines import SamplingParams
from polyfsdp.trainer.rollout.generate import generate
from polyfsdp.trainer.rewards.reward_fn import Scorer
from polyfsdp.trainer.rollout.row_seeds import eval_row_seeds
from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.data.example import Example

LETTERS = "abcdefgh"


def first_letter_in_answer(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 when the completion starts with a letter of the answer; its first character is the vote."""
    first = solution_str[:1]
    return {"score": float(bool(first) and first in ground_truth), "pred": first or None}


def _brute_pass_at_k(correct: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_sampled_evaluation_matches_an_independent_count_of_the_same_completions():
    tok = CharTokenizer()
    engine = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=5, vocab_size=tok.vocab_size),
                        EngineConfig()).initialize()
    examples = [Example(prompt=w + "=", answer=w[::-1], data_source="short" if len(w) < 4 else "long")
                for w in ("abc", "hg", "defg", "ab", "cdeh", "fa")]
    n, settings = 4, EvalSettings(n_samples=4, temperature=1.0, seed=18, rows=2)
    result = evaluate(engine, tok, examples, 3, Scorer(first_letter_in_answer, "first"), settings)

    # The same draw by hand: each row is seeded by its example's index and settings.seed.
    prompts = [[tok.bos_token_id] + tok.encode(ex.prompt) for ex in examples for _ in range(n)]
    seeds = eval_row_seeds(settings.seed, list(range(len(examples))), n)
    texts = [tok.decode(r) for r in generate(engine, prompts, SamplingParams.for_tokenizer(tok, 3, temperature=1.0),
                                             row_seeds=seeds).token_ids]
    per_prompt = [texts[i * n:(i + 1) * n] for i in range(len(examples))]
    rewards = [[first_letter_in_answer("", t, ex.answer)["score"] for t in group]
               for ex, group in zip(examples, per_prompt)]
    assert 0 < sum(map(sum, rewards)) < n * len(examples), "the check needs both outcomes"

    def expected(indices):
        out = {f"mean@{n}": sum(sum(rewards[i]) for i in indices) / (n * len(indices))}
        for k in (1, 2, 4):
            out[f"pass@{k}"] = sum(_brute_pass_at_k([r == 1.0 for r in rewards[i]], k) for i in indices) / len(indices)
        majority = []
        for i in indices:
            votes = Counter(t[:1] for t in per_prompt[i] if t[:1])
            if not votes:
                majority.append(0.0)
                continue
            top = max(votes.values())
            winner = next(t[:1] for t in per_prompt[i] if t[:1] and votes[t[:1]] == top)
            majority.append(float(winner in examples[i].answer))
        out[f"maj@{n}"] = sum(majority) / len(indices)
        return out

    want = expected(range(len(examples)))
    for source in ("short", "long"):
        want.update({f"{source}/{k}": v for k, v in
                     expected([i for i, ex in enumerate(examples) if ex.data_source == source]).items()})
        want[f"{source}/reward"] = want[f"{source}/mean@{n}"]
    assert result.reward == pytest.approx(want[f"mean@{n}"])
    assert result.metrics == pytest.approx(want)
    assert result.rows == [[ex.prompt, group[0], ex.answer, r[0]]
                           for ex, group, r in list(zip(examples, per_prompt, rewards))[:2]]


def test_eval_settings_are_validated():
    assert load_config([]).eval.n_samples == 1 and load_config([]).eval.temperature == 0.0
    assert load_config(["eval.n_samples=8", "eval.temperature=0.7"]).eval.n_samples == 8
    with pytest.raises(ConfigError, match="eval.n_samples=4: greedy completions"):
        load_config(["eval.n_samples=4"])
    with pytest.raises(ConfigError, match="eval.n_samples"):
        load_config(["eval.n_samples=0", "eval.temperature=1.0"])
    with pytest.raises(ConfigError, match="eval.temperature"):
        load_config(["eval.temperature=-1"])
    with pytest.raises(ConfigError, match="trainer.log_val_generations"):
        load_config(["trainer.log_val_generations=-1"])


def test_builtin_rules_name_the_answer_they_compare_and_dicts_may_name_theirs():
    from polyfsdp.trainer.rewards.reward_fn import load_reward_fn

    example = Example(prompt="q", answer="#### 42")
    for name, text, answer in [("gsm8k", "so 40 + 2 = 42.0 #### 42", "42"), ("gsm8k", "no number", None),
                               ("math_boxed", "thus \\boxed{\\dfrac{1}{2}}", "1/2"),
                               ("math_boxed", "\\boxed{x+1}", "x+1"),
                               ("exact_match", "  hello ", "hello")]:
        assert Scorer(load_reward_fn(name), name).score_with_answer(example, text, [])[2] == answer, (name, text)
    scorer = Scorer(first_letter_in_answer, "mine")
    assert scorer.score_with_answer(Example(prompt="q", answer="ab"), "bz", []) == (1.0, {}, "b")

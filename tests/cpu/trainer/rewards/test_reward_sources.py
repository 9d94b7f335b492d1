"""Several weighted reward sources (trainer/rewards/sources.py) and reward.model
(trainer/rewards/reward_model.py): YAML defaults equal the dataclasses'; the weighted sum,
routing by data_source and the per-source logs against sums by hand; a reward model's scores
against Hugging Face's forward of the same checkpoint on the same texts (the policy's ids passed
through, a chat template's text re-tokenized, plain text); a GRPO job with reward.fn and
reward.model logs both and trains, each logged rollout reward equal to 0.5 x char_match + 2 x the HF
model's score of its text; one-line errors naming the source and the record."""
import dataclasses
import json

import pytest
import torch
from polyfsdp.trainer.config.composition import compose, to_container
from transformers import AutoModelForSequenceClassification

from polyfsdp.backends.registry import get_backend
from polyfsdp.engines.presets import preset_config
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.config.sections import RewardModelSection, RewardSection
from polyfsdp.trainer.data.example import Example
from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.errors import ConfigError, RewardError
from polyfsdp.trainer.rewards.reward_fn import Scorer
from polyfsdp.trainer.rewards.reward_model import build_reward_model_source
from polyfsdp.trainer.rewards.rules import char_match
from polyfsdp.trainer.rewards.sources import FunctionSource, WeightedReward
from polyfsdp.trainer.train import main

TOL = 1e-5


def write_reward_model(directory, tokenizer, seed=0, **overrides) -> str:
    """A tiny random Qwen2ForSequenceClassification for ``tokenizer``, saved with it."""
    config = preset_config("qwen2-tiny", vocab_size=tokenizer.vocab_size, num_labels=1,
                           pad_token_id=tokenizer.pad_token_id, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config)
        torch.nn.init.normal_(model.score.weight, std=1.0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def hf_scores(path, sequences):
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, 0].item() for ids in sequences]


def test_reward_yaml_defaults_equal_the_dataclasses():
    shipped = to_container(compose([]))["reward"]
    assert shipped["model"] == dataclasses.asdict(RewardModelSection())
    expected = {f.name: getattr(RewardSection(), f.name) for f in dataclasses.fields(RewardSection) if f.name != "model"}
    assert {k: v for k, v in shipped.items() if k != "model"} == expected


class Recorder:
    """A collective source: 10 x the number in its text (else its length), and when it was called."""

    collective, name, weight = True, "judge", 2.0

    def __init__(self, data_sources, calls):
        self.data_sources, self.calls = data_sources, calls

    def score_all(self, examples, texts, responses, group=1):
        self.calls.append(list(texts))
        return [10.0 * len(t) if not t.isdigit() else 10.0 * float(t) for t in texts], {}


def test_weighted_sum_routing_and_logs():
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise ValueError("no")
        return {"score": float(solution_str) / 10, "pred": solution_str, "len": 1.0}

    examples = [Example("p0", "a", data_source="math"), Example("p1", "a", data_source="chat")]
    calls = []
    reward = WeightedReward([FunctionSource(Scorer(fn, "f"), 0.5, ["math"]), Recorder(["chat", "math"], calls)])
    answers = []
    texts = ["1", "2", "3", "4"]  # group 2: rows 0-1 answer p0 (math), rows 2-3 p1 (chat)
    rewards, extras = reward.score_all(examples, texts, [[1]] * 4, group=2, answers=answers)
    assert rewards == [0.5 * 0.1 + 2 * 10, 0.5 * 0.2 + 2 * 20, 2 * 30, 2 * 40]
    assert extras == {"judge": [10.0, 20.0, 30.0, 40.0], "fn": [0.1, 0.2], "len": [1.0, 1.0]}
    assert answers == ["1", "2", None, None]
    assert reward.name == "0.5*f + 2*judge"
    calls.clear()
    with pytest.raises(RewardError, match="reward.fn=f raised ValueError"):
        reward.score_all(examples, ["boom", "2"], [[1]] * 2)
    assert calls == [["boom", "2"]]  # the collective source ran before the function's error


@pytest.fixture(scope="module")
def char_rm(tmp_path_factory):
    return write_reward_model(tmp_path_factory.mktemp("rm"), CharTokenizer())


def _source(path, template="auto", policy=None, **engine):
    cfg = load_config([f"engine.{k}={v}" for k, v in engine.items()])
    section = RewardModelSection(path=path, template=template)
    return build_reward_model_source(section, cfg, policy or CharTokenizer(), get_backend("cpu"))


@pytest.mark.parametrize("pad_mode", ["no_padding", "left_right"])
def test_reward_model_texts_equal_hf_on_the_same_texts(char_rm, tmp_path, pad_mode):
    tok = CharTokenizer()
    chat = Example("abc=", "cba", messages=({"role": "user", "content": "abc="},), prompt_ids=(1, 5, 6), where="r:1")
    plain = Example("hgf=", "fgh", where="r:2")
    texts, responses = ["cba", "x"], [tok.encode("cba") + [tok.eos_token_id], tok.encode("x")]
    # Same tokenizer: the policy's ids (the prompt's and the sampled ones, eos included) pass through.
    through = _source(char_rm, pad_mode=pad_mode, max_tokens_per_micro_batch=6)
    assert through.pass_through
    got, _ = through.score_all([chat, plain], texts, responses)
    want = hf_scores(char_rm, [[1, 5, 6] + responses[0], [tok.bos_token_id] + tok.encode("hgf=") + responses[1]])
    assert max(abs(a - b) for a, b in zip(got, want)) <= TOL and abs(want[0] - want[1]) > 100 * TOL
    # Another tokenizer (more characters, other ids): the chat rendered and re-tokenized by the model's.
    other = CharTokenizer(tok.chars[::-1] + "@")
    other_rm = write_reward_model(tmp_path / "other", other, seed=1)
    chat_source = _source(other_rm, pad_mode=pad_mode)
    assert not chat_source.pass_through and chat_source.chat
    got, _ = chat_source.score_all([chat, plain], texts, responses)
    rendered = [other.apply_chat_template([*(ex.messages or [{"role": "user", "content": ex.prompt}]),
                                           {"role": "assistant", "content": t}], add_generation_prompt=False)
                for ex, t in zip([chat, plain], texts)]
    assert max(abs(a - b) for a, b in zip(got, hf_scores(other_rm, rendered))) <= TOL
    got, _ = _source(other_rm, template="none", pad_mode=pad_mode).score_all([chat, plain], texts, responses)
    plain_ids = [[other.bos_token_id] + other.encode(ex.prompt + t) for ex, t in zip([chat, plain], texts)]
    assert max(abs(a - b) for a, b in zip(got, hf_scores(other_rm, plain_ids))) <= TOL


def test_one_line_errors_name_the_source_and_the_record(char_rm, tmp_path):
    short = write_reward_model(tmp_path / "short", CharTokenizer(), max_position_embeddings=8)
    with pytest.raises(RewardError, match=r"reward.model \(model, .*short\): record data.jsonl:3 is 11 tokens for "
                                          r"the reward model, more than its max_position_embeddings=8"):
        _source(short).score_all([Example("abcdefgh=", "x", where="data.jsonl:3")], ["x"], [[5]])
    with pytest.raises(RewardError, match="record r:9 has token id 500, outside the reward model's embedding"):
        _source(char_rm).score_all([Example("a=", "x", prompt_ids=(1, 500), where="r:9")], ["x"], [[5]])
    with pytest.raises(ConfigError, match="reward.model.path: '/nope' is not a Hugging Face checkpoint directory"):
        load_config(["reward.model.path=/nope"])
    with pytest.raises(ConfigError, match="reward.fn=none: no reward function, no reward.model.path and no reward.judge"):
        load_config(["reward.fn=none"])


def test_grpo_job_with_two_weighted_sources_logs_each_and_trains(char_rm, tmp_path):
    out = tmp_path / "run"
    assert main(["trainer.sft_steps=0", "trainer.rl_steps=2", "trainer.prompts_per_step=2", "algo.actor.group_size=2",
          "trainer.progress=off", "trainer.plot=false", "trainer.export=false", "trainer.checkpoint_interval=0",
          "data.eval_size=2", "trainer.log_rollout_samples=2", "reward.fn=char_match", "reward.weight=0.5",
          f"reward.model.path={char_rm}", "reward.model.weight=2", "reward.model.template=none", f"trainer.output_dir={out}"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["phase"] == "rl"]
    assert len(steps) == 2
    for r in steps + [r for r in records if r["phase"] == "eval"]:
        assert abs(r["reward"] - (0.5 * r["reward/fn"] + 2 * r["reward/model"])) <= TOL
    assert all(s["grad_norm"] > 0 and abs(s["loss"]) < 1e3 for s in steps)
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()
            if json.loads(line)["tag"] == "rollout"]
    tok = CharTokenizer()
    scores = hf_scores(char_rm, [[tok.bos_token_id] + tok.encode(r["prompt"]) + tok.encode(r["completion"])
                                 for r in rows])
    for row, score in zip(rows, scores):
        assert abs(row["reward"] - (0.5 * char_match("", row["completion"], row["ground_truth"]) + 2 * score)) <= TOL


def test_estimate_counts_the_reward_model(char_rm):
    from polyfsdp.trainer.run.estimate import estimate_job

    est = estimate_job(load_config([f"reward.model.path={char_rm}"]), 1)
    params = sum(p.numel() * p.element_size()
                 for p in AutoModelForSequenceClassification.from_pretrained(char_rm).parameters())
    assert all(rows["reward model parameters (model)"] == params for rows in est.state.values())
    scoring = [s for s in est.steps["grpo"] if s.name == "reward model scoring (no grad)"]
    assert len(scoring) == 1 and scoring[0].transient > 0
    assert "reward model parameters (model)" not in estimate_job(load_config([]), 1).state["grpo"]

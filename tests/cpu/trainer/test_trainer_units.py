"""Trainer building blocks against hand-computed values: tokenizer, reward, advantages,
batch alignment, data determinism and errors, config validation (no model runs here)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.engine_reference import per_sequence

from polyfsdp.engines import jagged
from polyfsdp.trainer.data.batch import build_batch
from polyfsdp.trainer.errors import ConfigError, DataError
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.data.sources import BuiltinSource, FileSource, read_jsonl, read_parquet
from polyfsdp.trainer.algos.advantages import group_advantages
from polyfsdp.trainer.data.tokenizers import CharTokenizer, load_tokenizer
from polyfsdp.trainer.data.task import ReverseTask, reward


def test_char_tokenizer_round_trips_and_reloads_from_directory(tmp_path):
    tok = CharTokenizer("ab=")
    assert tok.vocab_size == 7  # 4 specials + 3 chars
    assert tok.encode("ba=") == [5, 4, 6]
    assert tok.encode("x") == [tok.unk_token_id]
    assert tok.decode([tok.bos_token_id, 5, 4, tok.eos_token_id, 4]) == "ba"  # stops at eos
    tok.save_pretrained(str(tmp_path))
    again = load_tokenizer(str(tmp_path))
    assert isinstance(again, CharTokenizer) and again.vocab == tok.vocab


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer found"):
        load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("completion,answer,expected", [
    ("dcba", "dcba", 1.0),
    ("dcbx", "dcba", 0.75),
    ("dc", "dcba", 0.5),          # shorter: 2 right of 4
    ("dcbaaa", "dcba", 4 / 6),    # longer: penalised by the extra characters
    ("", "dcba", 0.0),
    ("", "", 1.0),
])
def test_reward_gives_partial_credit_in_unit_interval(completion, answer, expected):
    assert reward(completion, answer) == pytest.approx(expected)


def test_group_advantages_match_hand_computed_values():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.2])
    adv = group_advantages(rewards, group_size=2)
    # Group (1, 0): mean 0.5, unbiased std sqrt(0.5); identical rewards give 0.
    s = 0.5 ** 0.5
    expected = torch.tensor([0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.0, 0.0, 0.0, 0.0])
    assert torch.allclose(adv, expected, atol=1e-6)
    centred = group_advantages(rewards, group_size=3, norm_by_std=False)
    assert torch.allclose(centred, torch.tensor([0.5, -0.5, 0.0, 0.2, -0.1, -0.1]), atol=1e-6)
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(rewards, group_size=4)


PAIRS = [([1, 10, 11], [12, 2]), ([1, 10], [13, 14, 2])]
# response_mask[t] = 1 iff token t+1 is a response token.
EXPECTED_MASKS = [[0, 0, 1, 1, 0], [0, 1, 1, 1, 0]]


def test_no_padding_batch_is_jagged_with_response_mask_shifted_by_one():
    batch = build_batch(PAIRS, "no_padding", pad_token_id=0)
    ids = batch["input_ids"]
    assert ids.is_nested and ids.layout == torch.jagged
    assert jagged.offsets(ids).tolist() == [0, 5, 10]
    assert [t.tolist() for t in ids.unbind()] == [[1, 10, 11, 12, 2], [1, 10, 13, 14, 2]]
    assert [t.tolist() for t in batch["response_mask"].unbind()] == EXPECTED_MASKS


def test_left_right_batch_pads_prompts_left_and_responses_right():
    batch = build_batch(PAIRS, "left_right", pad_token_id=0,
                        token_fields={"advantages": [torch.full((5,), 1.5), torch.full((5,), -2.0)]})
    assert batch["input_ids"].tolist() == [[1, 10, 11, 12, 2, 0], [0, 1, 10, 13, 14, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]]
    assert batch["response_mask"].tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0]]
    assert batch["advantages"].tolist() == [[1.5] * 5 + [0.0], [0.0] + [-2.0] * 5]
    back = per_sequence(batch["response_mask"], batch, "left_right")
    assert [t.tolist() for t in back] == EXPECTED_MASKS


def test_builtin_batches_are_deterministic_by_step_and_never_use_eval_prompts():
    task = ReverseTask(alphabet="ab", min_len=2, max_len=3)  # 12 prompts: eval takes a large share
    a, b = BuiltinSource(task, seed=3, eval_size=5), BuiltinSource(task, seed=3, eval_size=5)
    assert a.batch("sft", 7, 16) == b.batch("sft", 7, 16)
    assert a.batch("sft", 7, 16) != a.batch("sft", 8, 16)
    eval_prompts = {ex.prompt for ex in a.eval_examples}
    assert len(eval_prompts) == 5
    for step in range(20):
        assert not eval_prompts & {ex.prompt for ex in a.batch("grpo", step, 16)}
    for ex in a.batch("sft", 0, 16):
        assert ex.answer == ex.prompt[:-1][::-1]


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_jsonl_source_holds_out_the_tail_and_cycles_through_the_rest(tmp_path):
    rows = [{"prompt": f"p{i}=", "answer": str(i)} for i in range(10)]
    records = read_jsonl(_write_jsonl(tmp_path / "d.jsonl", rows))
    source = FileSource(records, seed=0, eval_size=3, path="d.jsonl")
    assert [ex.answer for ex in source.eval_examples] == ["7", "8", "9"]
    epoch = source.batch("sft", 0, 7)
    assert sorted(ex.answer for ex in epoch) == [str(i) for i in range(7)]  # one full epoch, no eval rows
    assert source.batch("sft", 0, 7) == epoch


def test_jsonl_missing_field_names_the_line_and_field(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a=", "answer": "a"}, {"prompt": "b="}])
    with pytest.raises(DataError, match=r"line 2: missing field 'answer'"):
        read_jsonl(path)


def test_parquet_without_a_reader_says_what_to_install(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_parquet(name, *args, **kwargs):
        if name.split(".")[0] in ("pyarrow", "pandas"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_parquet)
    with pytest.raises(DataError, match="needs pyarrow or pandas"):
        read_parquet(str(tmp_path / "x.parquet"))


@pytest.mark.parametrize("overrides,expected", [
    (["engine.use_remov_padding=false"], "engine.use_remov_padding: unknown key"),
    (["+engine.foo=1"], "engine.foo: unknown key"),
    (["+trainer.sft_stepz=1"], "trainer.sft_stepz: unknown key"),
    (["engine.pad_mode=diagonal"], "engine.pad_mode: got 'diagonal'; allowed values: 'no_padding', 'left_right'"),
    (["backend=tpu"], "backend=tpu: no such option; choose one of auto, cpu, cuda, npu"),
    (["model=gpt5"], "model=gpt5: no such option; choose one of llama, qwen2, qwen2_vl, qwen3"),
    (["algo.actor.kl_type=k9"], "algo.actor.kl_type: got 'k9'; allowed values: k1, k3"),
    (["trainer.sft_steps=many"], "trainer.sft_steps: expected int, got 'many'"),
    (["engine.lr=1"], "engine.lr: unknown key"),
    (["algo.sft.optim.lr=-1"], "algo.sft.optim.lr: expected a finite number >= 0, got -1"),
    (["algo.actor.optim.lr_scheduler=linear"], "algo.actor.optim.lr_scheduler: got 'linear'; allowed values"),
    (["algo.actor.optim.lr_scheduler=warmup_cosine", "algo.actor.optim.warmup_steps=500"],
     "algo.actor.optim.warmup_steps: expected <= total_steps=150, got 500 (algo.actor.optim.total_steps is null: "
     "the phase's 150 optimizer steps, from trainer.rl_steps)"),
    (["algo.sft.optim.lr_scheduler=warmup_cosine", "algo.sft.optim.warmup_steps=50", "algo.sft.optim.total_steps=20"],
     "algo.sft.optim.warmup_steps: expected <= total_steps=20, got 50"),
    (["+algo.actor.optim.momentum=0.9"], "algo.actor.optim.momentum: unknown key"),
    (["engine.reshard_policy=sometimes"], "engine.reshard_policy: got 'sometimes'; allowed values"),
    (["data=jsonl"], "data.path: a value is required"),
    (["patches.disable=[qwen2.nope]"], "patches.disable: unknown patch 'qwen2.nope'"),
    (["model.dtype=float16"], "model.dtype=float16: training keeps master weights in float16"),
    (["engine.ulysses_sp_size=2"], "engine.ulysses_sp_size=2: must divide the world size 1"),
    (["trainer.prompts_per_step=3"], None),  # fine for one rank ...
])
def test_bad_overrides_raise_one_line_config_errors(overrides, expected):
    if expected is None:
        load_config(overrides)
        with pytest.raises(ConfigError, match="multiple of the world size 2"):  # ... not for two
            load_config(overrides, world_size=2)
        return
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(expected), message



def test_prompts_are_split_over_replicas_not_ranks():
    # 4 ranks, sp=2: 2 replicas, so 6 prompts split (3 each) though 4 ranks do not divide 6.
    cfg = load_config(["engine.ulysses_sp_size=2", "trainer.prompts_per_step=6", "trainer.sft_batch_size=6",
                       "data.eval_size=4"], world_size=4)
    assert cfg.engine.ulysses_sp_size == 2
    with pytest.raises(ConfigError, match=r"^trainer.prompts_per_step: must be a multiple of the data-parallel "
                                          r"replicas 2 \(world size 4 / engine.ulysses_sp_size 2\), got 5$"):
        load_config(["engine.ulysses_sp_size=2", "trainer.prompts_per_step=5", "data.eval_size=4"], world_size=4)
    with pytest.raises(ConfigError, match="algo.actor.mini_batch_size: must be a multiple of the data-parallel"):
        load_config(["engine.ulysses_sp_size=2", "trainer.prompts_per_step=8", "algo.actor.mini_batch_size=1",
                     "data.eval_size=4"], world_size=4)
    with pytest.raises(ConfigError, match="engine.ulysses_sp_size=3: must divide the world size 4"):
        load_config(["engine.ulysses_sp_size=3"], world_size=4)

def test_default_config_converts_to_engine_dataclasses():
    cfg = load_config([])
    assert cfg.algo.name == "grpo" and cfg.trainer.sft_steps > 0 and cfg.trainer.rl_steps > 0
    from polyfsdp.engines import EngineConfig, OptimConfig

    assert isinstance(cfg.engine, EngineConfig) and cfg.engine.pad_mode == "no_padding"
    assert isinstance(cfg.algo.actor.optim, OptimConfig) and cfg.algo.actor.optim.lr == 1e-3
    # total_steps: null means the phase's own length (the cosine schedule's horizon).
    assert (cfg.algo.sft.optim.total_steps, cfg.algo.actor.optim.total_steps) == (cfg.trainer.sft_steps,
                                                                                  cfg.trainer.rl_steps)
    assert cfg.model.model_config(vocab_size=50).vocab_size == 50


def test_hugging_face_tokenizer_in_model_directory_is_used_through_the_adapter(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from polyfsdp.trainer.data.tokenizers import HFTokenizerAdapter

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "ab": 4, "cd": 5}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizerAdapter)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (0, 1, 2, 6)
    assert tok.encode("ab cd") == [4, 5]  # no special tokens added
    assert tok.decode([4, 5, 2, 4]).split() == ["ab", "cd"]  # cut at eos


def test_every_rank_needs_an_evaluation_prompt():
    load_config(["data.eval_size=2"], world_size=2)
    with pytest.raises(ConfigError, match=r"data.eval_size: .* expected >= world size 2, got 1"):
        load_config(["data.eval_size=1"], world_size=2)


def test_builtin_eval_set_holding_every_prompt_is_a_data_error_not_a_hang():
    # "a=" and "b=" are the task's only prompts: holding both out left training sampling forever.
    with pytest.raises(DataError, match=r"data.eval_size=4 holds out all 2 distinct prompts"):
        BuiltinSource(ReverseTask(alphabet="ab", min_len=1, max_len=1), seed=0, eval_size=4)
    source = BuiltinSource(ReverseTask(alphabet="ab", min_len=1, max_len=1), seed=0, eval_size=1)
    (held_out,) = source.eval_examples
    assert {ex.prompt for ex in source.batch("sft", 0, 4)} == {"ab".replace(held_out.prompt[0], "") + "="}


@pytest.mark.parametrize("overrides,expected", [
    (["data.path=train.jsonl"], "data.path: data=builtin does not read a file"),
    (["algo.sft=null"], "algo.sft: expected a mapping"),
    (["engine=null"], "engine=null: a config group needs an option; choose one of default"),
    (["data=null"], "data=null: a config group needs an option; choose one of arith_words, builtin, files, jsonl, parquet"),
    (["engine=[]"], "engine: missing"),
])
def test_ignored_or_missing_sections_are_one_line_config_errors(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(expected), message


@pytest.mark.parametrize("overrides,expected", [
    ({"num_attention_heads": 5}, "cannot run"),        # 96 hidden / 5 heads, 2 kv heads: fails in forward
    ({"hidden_size": None}, "hidden_size"),           # rejected by the Hugging Face config itself
])
def test_initial_model_from_unusable_overrides_is_a_value_error(overrides, expected, tmp_path):
    from polyfsdp.trainer.run.model_init import write_initial_model

    sizes = {"hidden_size": 96, "intermediate_size": 288, "num_hidden_layers": 1, "num_attention_heads": 4,
             "num_key_value_heads": 2}
    with pytest.raises(ValueError, match=expected) as info:
        write_initial_model(str(tmp_path / "init"), "qwen2-tiny", {**sizes, **overrides}, CharTokenizer(), seed=0)
    assert "\n" not in str(info.value) and not str(info.value).startswith("model.overrides")
    assert not (tmp_path / "init").exists()


def test_resuming_a_grpo_checkpoint_with_algo_sft_is_a_config_error(tmp_path):
    from polyfsdp.trainer.run.resume import find_resume

    step = tmp_path / "run" / "checkpoints" / "rl" / "step_000002"
    step.mkdir(parents=True)
    cfg = load_config(["algo=sft", f"trainer.resume={step}"])
    with pytest.raises(ConfigError, match=r"trainer.resume: .* is an RL checkpoint, but algo=sft"):
        find_resume(cfg, tmp_path / "out")
    cfg = load_config([f"trainer.resume={step}"])
    assert find_resume(cfg, tmp_path / "out").phase == "rl"
    # The same mix-up with resume=auto: an algo=sft run in a GRPO run's directory.
    grpo_run = tmp_path / "grpo_run"
    (grpo_run / "sft_model").mkdir(parents=True)
    (grpo_run / "sft_model" / "polyfsdp_state.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"trainer.resume=auto: .* holds an RL run, but algo=sft"):
        find_resume(load_config(["algo=sft"]), grpo_run)
    assert find_resume(load_config([]), grpo_run).phase == "rl"


def test_plot_draws_non_finite_metrics_as_numbers_not_categories(tmp_path, monkeypatch):
    import math

    from matplotlib.figure import Figure

    from polyfsdp.trainer.tracking.metrics import MetricsLogger
    from polyfsdp.trainer.tracking.plot import plot_metrics

    metrics = MetricsLogger(str(tmp_path / "metrics.jsonl"))
    metrics.start(None)
    for step, loss in enumerate([2.0, float("nan"), 1.0], start=1):
        metrics.log({"phase": "sft", "step": step, "global_step": step, "loss": loss})
    metrics.log({"phase": "rl", "step": 1, "global_step": 4, "loss": float("inf"), "reward": 0.5})
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self))
    plot_metrics(metrics.path, str(tmp_path / "curves.png"))
    loss_axis = figures[0].axes[1]
    sft_line, grpo_line = loss_axis.get_lines()[:2]
    sft = [float(v) for v in sft_line.get_ydata()]  # a string here means a categorical axis
    assert sft[0] == 2.0 and math.isnan(sft[1]) and sft[2] == 1.0
    assert not any(isinstance(v, str) for v in sft_line.get_ydata())
    assert [float(v) for v in grpo_line.get_ydata()] == [math.inf]


def test_file_text_outside_the_character_tokenizer_is_a_data_error(tmp_path):
    # "%" would become <unk>, which decoding drops: an answer holding it could never earn reward 1.
    from polyfsdp.trainer.data.sources import check_tokenizer_covers

    rows = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "50% of 8=", "answer": "4"}, {"prompt": "1+1=", "answer": "2"}]
    source = FileSource(read_jsonl(_write_jsonl(tmp_path / "d.jsonl", rows)), seed=0, eval_size=1, path="d.jsonl")
    with pytest.raises(DataError, match=r"'%' .*not in the character tokenizer"):
        check_tokenizer_covers(source, CharTokenizer())
    check_tokenizer_covers(source, CharTokenizer(CharTokenizer().chars + "%"))


def test_answers_longer_than_the_sampling_budget_are_warned_about(caplog):
    from polyfsdp.trainer.data.sources import check_generation_budget

    tok = CharTokenizer()
    long_task = BuiltinSource(ReverseTask(min_len=3, max_len=9), seed=0, eval_size=8)
    with caplog.at_level("WARNING", logger="polyfsdp.trainer.data.sources"):
        check_generation_budget(long_task, tok, max_new_tokens=8)  # 9 letters + <eos> need 10
    (record,) = caplog.records
    assert "algo.actor.max_new_tokens=8" in record.getMessage() and "10" in record.getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="polyfsdp.trainer.data.sources"):
        check_generation_budget(long_task, tok, max_new_tokens=10)
    assert not caplog.records


def test_continuing_a_run_with_another_model_is_a_config_error(tmp_path):
    # resume=auto would load the old run's init_model/checkpoints and ignore model=llama, while
    # config.yaml was rewritten to claim llama.
    from omegaconf import OmegaConf

    from polyfsdp.trainer.run.resume import check_same_run

    run = tmp_path / "run"
    (run / "init_model").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(load_config([]).raw), run / "config.yaml")
    check_same_run(load_config(["trainer.rl_steps=300"]), run)  # more steps: fine
    with pytest.raises(ConfigError, match=r"model.preset='qwen2-tiny'.*model.preset='llama-tiny'"):
        check_same_run(load_config(["model=llama"]), run)
    with pytest.raises(ConfigError, match=r"model.overrides"):
        check_same_run(load_config(["model.overrides.num_hidden_layers=3"]), run)
    # A directory whose earlier run stopped before building anything holds no model to clash with.
    (run / "init_model").rmdir()
    check_same_run(load_config(["model=llama"]), run)


@pytest.mark.parametrize("override,name,before,now", [
    ("data.max_len=7", "data.max_len", "5", "7"),
    ("algo.actor.kl_coef=0.5", "algo.actor.kl_coef", "0.01", "0.5"),
    ("algo.sft.optim.lr=0.1", "algo.sft.optim.lr", "0.003", "0.1"),
    ("trainer.seed=3", "trainer.seed", "0", "3"),
    ("trainer.prompts_per_step=16", "trainer.prompts_per_step", "32", "16"),
])
def test_continuing_a_run_with_other_data_or_algo_settings_is_a_config_error(tmp_path, override, name, before, now):
    # The checkpoint's data position and optimizer state belong to the old settings: continuing
    # silently would train a run that config.yaml does not describe.
    from omegaconf import OmegaConf

    from polyfsdp.trainer.run.resume import check_same_run

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(load_config([]).raw), run / "config.yaml")
    with pytest.raises(ConfigError, match=rf"holds a run of {name}={before}, but this run asks for {name}={now};"):
        check_same_run(load_config([override]), run)
    # What only changes how the run is carried out may differ.
    check_same_run(load_config(["trainer.rl_steps=300", "trainer.checkpoint_interval=5", "engine.pad_mode=left_right",
                                "engine.use_fused_kernels=true", "trainer.progress=lines", "reward.timeout_s=5",
                                "trainer.dist_timeout_s=1200"]), run)


def test_a_run_saved_before_the_timeout_keys_continues(tmp_path):
    from omegaconf import OmegaConf

    from polyfsdp.trainer.run.resume import check_same_run

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    raw = load_config([]).raw
    del raw["reward"]["timeout_s"], raw["trainer"]["dist_timeout_s"]
    OmegaConf.save(OmegaConf.create(raw), run / "config.yaml")
    check_same_run(load_config([]), run)


def test_an_sft_run_may_continue_into_grpo(tmp_path):
    # algo=sft wrote no GRPO settings; algo=grpo continuing it has none to clash with.
    from omegaconf import OmegaConf

    from polyfsdp.trainer.run.resume import check_same_run

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(load_config(["algo=sft"]).raw), run / "config.yaml")
    check_same_run(load_config(["algo.actor.kl_coef=0.5"]), run)
    with pytest.raises(ConfigError, match=r"algo.sft.optim.lr"):
        check_same_run(load_config(["algo.sft.optim.lr=0.1"]), run)


def test_prompt_without_tokens_is_a_data_error_for_a_tokenizer_without_bos(tmp_path):
    # Nothing to condition on: batching and generation need at least one prompt token.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from polyfsdp.trainer.data.sources import check_tokenizer_covers

    core = Tokenizer(models.WordLevel({"<pad>": 0, "</s>": 1, "<unk>": 2, "ab": 3}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    rows = [{"prompt": "ab", "answer": "ab"}, {"prompt": " ", "answer": "ab"}, {"prompt": "ab", "answer": "ab"}]
    source = FileSource(read_jsonl(_write_jsonl(tmp_path / "d.jsonl", rows)), seed=0, eval_size=1, path="d.jsonl")
    with pytest.raises(DataError, match=r"prompt ' ' has no tokens"):
        check_tokenizer_covers(source, tok)
    check_tokenizer_covers(source, CharTokenizer())  # <bos> always starts the prompt


def test_jsonl_that_is_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "caf\u00e9=", "answer": "x"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.jsonl: not UTF-8 text"):
        read_jsonl(str(path))

"""Multi-turn SFT (trainer/algos/tool_sft.py): only the assistant's tokens are trained, and a
demonstration is tokenized exactly as a rollout that samples the same turns holds it."""
import random

import pytest
import torch
from tests.helpers.chatml_tokenizer import chatml_tokenizer
from tests.helpers.own_data_cases import bpe_tokenizer
from tests.cpu.trainer.rollout.test_multi_turn import ScriptedEngine, _params

from polyfsdp.trainer.data.batch import build_batch
from polyfsdp.trainer.rollout.drivers.multi_turn import MultiTurnDriver, MultiTurnSettings
from polyfsdp.trainer.rollout.engines import SamplingParams
from polyfsdp.trainer.data.tokenizers import CharTokenizer, HFTokenizerAdapter
from polyfsdp.trainer.data.example import Example
from polyfsdp.trainer.algos.tool_sft import conversation_sequences, demonstration
from polyfsdp.trainer.rollout.tool_task import CALCULATOR_TOOL, CalculatorTask

# A Qwen-like template that renders the tools into a system turn and closes every turn with
# <|im_end|> and a newline (the closing the rollout appends after a sampled <eos>).
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
                  "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _char_tokenizer():
    tok = CharTokenizer()
    tok.add_chars('"{}')  # what the calculator task's data adds (trainer/data/sources.py)
    return tok


TOKENIZERS = {"char": _char_tokenizer, "bpe_with_tools": lambda: HFTokenizerAdapter(bpe_tokenizer(TOOLS_TEMPLATE)),
              # eos <|endoftext|>, turns closed by <|im_end|> (a base Qwen tokenizer's layout)
              "chatml_eos_apart": lambda: HFTokenizerAdapter(chatml_tokenizer(template=TOOLS_TEMPLATE))}


def _examples(count=3):
    rng = random.Random(7)
    return [CalculatorTask().sample(rng) for _ in range(count)]


def _calculator(engine=None, max_turns=2):
    """The multi-turn driver over the calculator; SFT only asks it to start conversations."""
    engine = engine or ScriptedEngine(None, [])
    return MultiTurnDriver(engine, MultiTurnSettings("calculator", {}, max_turns, None, False), max_positions=None)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_sft_sequence_equals_what_the_rollout_holds_for_the_same_conversation(name):
    tok = TOKENIZERS[name]()
    for example in _examples():
        call, answer = (m["content"] for m in example.conversation if m["role"] == "assistant")
        # The engine writes the demonstration's turns; the calculator answers the call itself.
        engine = ScriptedEngine(tok, [call, answer])
        roll = _calculator(engine).rollout(tok, [example], 1, _params(tok, 200, return_log_probs=True))
        assert roll.rewards == [1.0] and roll.rollout_metrics["tool_calls"] == [1.0]
        sft = conversation_sequences(_calculator(), tok, [example])
        assert sft == roll.pairs()


@pytest.mark.parametrize("name", ["bpe_with_tools", "chatml_eos_apart"])
def test_the_bpe_sequence_is_the_templates_rendering_of_the_whole_conversation(name):
    # Independent of ChatTurns: the template renders the demonstration in one call; the trained
    # sequence is that text, less the closing newline after the last <|im_end|>.
    tok = TOKENIZERS[name]()
    example = _examples(1)[0]
    prompt, response, _ = conversation_sequences(_calculator(), tok, [example])[0]
    whole = tok.tok.apply_chat_template(list(example.conversation), tools=[CALCULATOR_TOOL], tokenize=False)
    assert tok.tok.decode(prompt + response) == whole.removesuffix("\n")


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_only_the_assistant_tokens_carry_the_loss_mask(name):
    tok = TOKENIZERS[name]()
    example = _examples(1)[0]
    prompt, response, loss_mask = conversation_sequences(_calculator(), tok, [example])[0]
    trained = [t for t, m in zip(response, loss_mask) if m]
    assistant = [m["content"] for m in example.conversation if m["role"] == "assistant"]
    turn_end = SamplingParams.for_tokenizer(tok, 1).stop_token_ids[-1]  # <eos>, or <|im_end|> apart from it
    assert trained == [t for text in assistant for t in tok.encode(text) + [turn_end]]
    untrained = [t for t, m in zip(response, loss_mask) if not m]
    assert "[tool]" in tok.decode(untrained) if name == "char" else "tool" in tok.tok.decode(untrained)
    # The engine's response mask marks exactly those tokens (position t predicts token t + 1).
    batch = build_batch([(prompt, response, loss_mask)], "no_padding", tok.pad_token_id)
    ids = batch["input_ids"].values().tolist()
    mask = batch["response_mask"].values()
    assert [ids[t + 1] for t in mask.nonzero().flatten().tolist()] == trained


def test_one_turn_rollouts_train_on_the_direct_answer():
    example = _examples(1)[0]
    assert demonstration(example, max_turns=1) == [{"role": "assistant", "content": example.answer}]
    assert [m["role"] for m in demonstration(example, max_turns=2)] == ["assistant", "tool", "assistant"]
    tok = _char_tokenizer()
    prompt, response, loss_mask = conversation_sequences(_calculator(max_turns=1), tok, [example])[0]
    assert response == tok.encode(example.answer) + [tok.eos_token_id] and loss_mask == [1] * len(response)
    plain = Example(example.prompt, example.answer, messages=example.messages)  # no conversation at all
    assert demonstration(plain, max_turns=2) == [{"role": "assistant", "content": example.answer}]


def test_the_sft_loss_is_the_nll_of_the_assistant_tokens_only():
    from polyfsdp.engines.config import EngineConfig, ModelConfig, OptimConfig
    from polyfsdp.engines.engine import FSDPEngine
    from polyfsdp.engines.losses import SFTLoss
    from polyfsdp.trainer.algos.sft import sft_step

    tok = _char_tokenizer()
    engine = FSDPEngine(ModelConfig(preset="qwen2-tiny", vocab_size=tok.vocab_size), EngineConfig(),
                        OptimConfig(lr=1e-3)).initialize()
    examples = _examples(2)
    # Reference, before the step changes the weights: a plain forward, assistant tokens only.
    nll, count = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            prompt, response, loss_mask = conversation_sequences(_calculator(), tok, [ex])[0]
            ids = torch.tensor([prompt + response])
            log_probs = torch.log_softmax(engine.module(ids, use_cache=False).logits[0].float(), -1)
            for k, m in enumerate(loss_mask):
                if m:
                    position = len(prompt) + k
                    nll -= log_probs[position - 1, ids[0, position]].item()
                    count += 1
    metrics = sft_step(engine, tok, examples, SFTLoss(agg_mode="token-mean"), conversations=_calculator())
    assert metrics["loss"] == pytest.approx(nll / count, rel=1e-5)


@pytest.mark.parametrize("max_turns", [2, 1])
def test_task_calculator_runs_through_polyfsdp_train_on_the_matching_demonstrations(tmp_path, monkeypatch, max_turns):
    import polyfsdp.trainer.algos.tool_sft as tool_sft
    from polyfsdp.trainer.config.job import load_config
    from polyfsdp.trainer.tracking.metrics import read_metrics
    from polyfsdp.trainer.train import main

    preset = load_config(["task=calculator"])
    assert (preset.data.task, preset.rollout.env, preset.rollout.max_turns) == ("calculator", "calculator", 2)
    trained, original = [], tool_sft.conversation_sequences

    def recording(rollout, tokenizer, examples):
        sequences = original(rollout, tokenizer, examples)
        trained.extend(tokenizer.decode([t for t, m in zip(r, mask) if m], skip_special_tokens=False)
                       for _, r, mask in sequences)
        return sequences

    monkeypatch.setattr(tool_sft, "conversation_sequences", recording)
    out = tmp_path / "run"
    code = main(["task=calculator", f"rollout.max_turns={max_turns}", "trainer.sft_steps=2", "trainer.rl_steps=1",
                 "trainer.sft_batch_size=4", "trainer.prompts_per_step=2", "algo.actor.group_size=2",
                 "data.eval_size=4", "trainer.progress=lines", "trainer.plot=false", "trainer.export=false",
                 f"trainer.output_dir={out}"])
    assert code == 0
    assert len(trained) == 8  # 2 SFT steps x 4 demonstrations
    calls = ['<tool_call>{"name":"calculator"' in text for text in trained]
    assert all(calls) if max_turns > 1 else not any(calls), trained[:2]
    assert [r["phase"] for r in read_metrics(str(out / "metrics.jsonl")) if "loss" in r] == ["sft", "sft", "rl"]

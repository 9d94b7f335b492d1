"""Single-turn SFT trains an answer after a chat-template prompt as the template writes the
assistant turn: the trained sequence (prompt + answer) is the template's rendering of the whole
conversation through its end-of-turn token (ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``),
not the tokenizer's eos, and without what the template writes after that token (ChatML's
newline: never sampled); a prompt without the template keeps ``answer + <eos>``
(trainer/data/answer_tokens.py, trainer/algos/sft.py)."""
from __future__ import annotations

import pytest

from polyfsdp.trainer.algos.sft import sft_pairs
from polyfsdp.trainer.data.chat import PromptEncoder
from polyfsdp.trainer.data.example import Example
from polyfsdp.trainer.data.tokenizers import CharTokenizer, HFTokenizerAdapter, load_tokenizer
from tests.helpers.chatml_tokenizer import chatml_tokenizer
from tests.helpers.llama3_tokenizer import llama3_tokenizer

USER = {"role": "user", "content": "what is 6*7?"}


def _trained(tokenizer, example: Example, chat_template: bool) -> tuple[list[int], list[int]]:
    encoded = PromptEncoder(tokenizer, apply_chat_template=chat_template).encode(example)
    [(prompt, answer)] = sft_pairs(tokenizer, [encoded], chat_template)
    return prompt, answer


def _rendered(tokenizer, answer: str) -> list[int]:
    """What apply_chat_template writes for the whole conversation."""
    return tokenizer.apply_chat_template([USER, {"role": "assistant", "content": answer}], add_generation_prompt=False)


@pytest.mark.parametrize("chat_messages", [True, False], ids=["messages", "apply_chat_template"])
def test_chatml_answers_end_with_im_end_not_eos_and_not_the_newline_after_it(chat_messages):
    tok = HFTokenizerAdapter(chatml_tokenizer(eos="<|endoftext|>"))  # a base Qwen2.5 tokenizer's eos
    im_end = tok.tok.convert_tokens_to_ids("<|im_end|>")
    example = Example(prompt=USER["content"], answer="42", messages=(USER,) if chat_messages else None)
    prompt, answer = _trained(tok, example, chat_template=not chat_messages)
    full = _rendered(tok, "42")
    assert tok.tok.decode(full[len(prompt) + len(answer):]) == "\n", "ChatML writes a newline after <|im_end|>"
    assert prompt + answer == full[:-1]
    assert answer[-1] == im_end and tok.eos_token_id not in answer
    assert tok.tok.decode(answer) == "42<|im_end|>"


def test_llama3_answers_end_with_eot_id_as_the_template_writes_them():
    tok = HFTokenizerAdapter(llama3_tokenizer())
    eot = tok.tok.convert_tokens_to_ids("<|eot_id|>")
    example = Example(prompt=USER["content"], answer=" 42 \n", messages=(USER,))
    prompt, answer = _trained(tok, example, chat_template=False)
    assert prompt + answer == _rendered(tok, " 42 \n"), "Llama 3 writes nothing after <|eot_id|>"
    assert answer[-1] == eot and tok.eos_token_id not in answer
    assert tok.tok.decode(answer) == "42<|eot_id|>", "the template trims the content: trained as written"


def test_without_a_chat_template_the_answer_ends_with_eos():
    for tok in (HFTokenizerAdapter(chatml_tokenizer(template=None)), CharTokenizer()):
        prompt, answer = _trained(tok, Example(prompt="6*7=", answer="42"), chat_template=False)
        assert answer == tok.encode("42") + [tok.eos_token_id]
    # A tokenizer with a template, a prompt given as text without data.apply_chat_template: no template.
    tok = HFTokenizerAdapter(chatml_tokenizer())
    assert _trained(tok, Example(prompt="6*7=", answer="42"), chat_template=False)[1] == \
        tok.encode("42") + [tok.eos_token_id]


def test_an_instruct_tokenizer_whose_eos_ends_the_turn_trains_that_token():
    tok = HFTokenizerAdapter(chatml_tokenizer(eos="<|im_end|>"))  # Qwen2.5-Instruct's, SmolLM2-Instruct's
    prompt, answer = _trained(tok, Example(prompt="", answer="42", messages=(USER,)), chat_template=False)
    assert answer == tok.encode("42") + [tok.eos_token_id]
    assert prompt + answer == _rendered(tok, "42")[:-1]


def test_the_sft_job_trains_what_the_template_writes(tmp_path, monkeypatch):
    """polyfsdp-train with string prompts and data.apply_chat_template=true: every sequence of the
    SFT step is the template's rendering of its conversation through <|im_end|>."""
    import json

    from polyfsdp.trainer.algos import sft as sft_module
    from polyfsdp.trainer.train import main
    from tests.helpers.chatml_tokenizer import saved_chatml_tokenizer
    from tests.helpers.vllm_cases import write_checkpoint

    model = tmp_path / "model"
    tok = saved_chatml_tokenizer(model)
    write_checkpoint(model, "qwen2-tiny", tok)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(6)))
    trained, build_batch = [], sft_module.build_batch

    def spy(pairs, *args, **kwargs):
        trained.extend(list(p) + list(a) for p, a in pairs)
        return build_batch(pairs, *args, **kwargs)

    monkeypatch.setattr(sft_module, "build_batch", spy)
    assert main(["algo=sft", f"model.path={model}", "data=jsonl", f"data.path={data}", "data.eval_size=2",
                 "data.apply_chat_template=true", "trainer.sft_steps=1", "trainer.sft_batch_size=4",
                 "trainer.progress=off", "trainer.plot=false", "trainer.export=false", "eval.initial=false",
                 "trainer.checkpoint_interval=0",
                 f"trainer.output_dir={tmp_path / 'run'}"]) == 0
    assert len(trained) == 4
    job_tok = load_tokenizer(str(model))  # the tokenizer the job loads (its config.json picks the class)
    im_end = job_tok.tok.convert_tokens_to_ids("<|im_end|>")
    written = set()
    for i in range(6):
        user = {"role": "user", "content": f"{i}+{i}="}
        prompt = job_tok.apply_chat_template([user], add_generation_prompt=True)
        full = job_tok.apply_chat_template([user, {"role": "assistant", "content": str(2 * i)}],
                                           add_generation_prompt=False)
        written.add(tuple(full[:full.index(im_end, len(prompt)) + 1]))  # through the assistant's <|im_end|>
    assert all(tuple(sequence) in written for sequence in trained), [job_tok.tok.decode(s) for s in trained]

"""A directory holding the built-in character tokenizer loads with transformers' Auto classes
and generates: the tokenizer is written as real Hugging Face files beside char_tokenizer.json."""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from polyfsdp.trainer.data.chat import text_prompt_tokens
from polyfsdp.trainer.run.model_init import write_initial_model
from polyfsdp.trainer.data.tokenizers import CharTokenizer, load_tokenizer

TEXTS = ["cadb=", "a b  c", "12+3=15", "é~z", ""]


def test_auto_tokenizer_encodes_decodes_and_renders_chats_like_the_char_tokenizer(tmp_path):
    chars = CharTokenizer()
    chars.save_pretrained(str(tmp_path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert len(hf) == chars.vocab_size
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, hf.unk_token_id) == (
        chars.pad_token_id, chars.bos_token_id, chars.eos_token_id, chars.unk_token_id)
    for text in TEXTS:
        ids = chars.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids, text
        assert hf(text)["input_ids"] == text_prompt_tokens(chars, text), text  # what training's prompts are
        assert hf.decode(ids + [chars.eos_token_id], skip_special_tokens=True) == chars.decode(ids), text
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    for prompt in (True, False):
        assert hf.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True,
                                      return_dict=False) == chars.apply_chat_template(messages, prompt)
    # polyfsdp itself still reads its own file first.
    assert isinstance(load_tokenizer(str(tmp_path)), CharTokenizer)


def test_the_initial_model_directory_generates_through_transformers_alone(tmp_path):
    chars = CharTokenizer()
    directory = write_initial_model(str(tmp_path / "model"), "qwen2-tiny", {"num_hidden_layers": 1}, chars, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    inputs = tokenizer(["cadb="], return_tensors="pt", add_special_tokens=False)
    assert inputs["input_ids"].tolist() == [chars.encode("cadb=")]
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    # The same greedy tokens as the model's own argmax, decoded by both tokenizers alike.
    with torch.no_grad():
        first = int(model(**inputs).logits[0, -1].argmax())
    assert int(out[0, inputs["input_ids"].shape[1]]) == first
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    new = new[:new.index(chars.eos_token_id)] if chars.eos_token_id in new else new
    assert tokenizer.decode(new, skip_special_tokens=True) == chars.decode(new)

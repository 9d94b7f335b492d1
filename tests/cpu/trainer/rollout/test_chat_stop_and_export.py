"""Issue 42, items 5 and 8: the chat template's end-of-turn token stops sampling besides eos
(a ChatML tokenizer built in code), and an export's files say nothing misleading: no
loader-only keys in tokenizer_config.json, config.json's transformers_version the one that
wrote it."""
import json

import torch
import transformers

from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig
from polyfsdp.trainer.data.chat import end_of_turn_token_id
from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.rollout.decode import decode
from polyfsdp.trainer.rollout.drivers.multi_turn import ChatTurns
from polyfsdp.trainer.rollout.engines import SamplingParams
from polyfsdp.trainer.rollout.generate import _hf_generate, _left_padded
from polyfsdp.trainer.run.export import export_model

from tests.helpers.chatml_tokenizer import chatml_tokenizer, saved_chatml_tokenizer
from tests.cpu.trainer.rollout.test_decode_loop import PROMPTS, TOK, _engine, _params
from tests.helpers.vllm_cases import write_checkpoint


def test_chatml_end_of_turn_joins_eos_as_a_stop_token(tmp_path):
    tok = saved_chatml_tokenizer(tmp_path)
    im_end = tok.tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end != tok.eos_token_id
    assert end_of_turn_token_id(tok) == im_end
    assert SamplingParams.for_tokenizer(tok, 4).stop_token_ids == (tok.eos_token_id, im_end)
    # The template writes "\n" after <|im_end|>: a multi-turn conversation closes the turn with it.
    assert ChatTurns(tok, None).closing == tok.encode("\n")


def test_no_extra_stop_token_where_eos_ends_the_turn_or_there_is_no_template():
    assert end_of_turn_token_id(chatml_tokenizer(eos="<|im_end|>")) is None
    assert end_of_turn_token_id(chatml_tokenizer(template=None)) is None
    plain_turns = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert end_of_turn_token_id(chatml_tokenizer(template=plain_turns)) is None
    # The built-in character tokenizer (the default job's) keeps its one stop token.
    assert end_of_turn_token_id(CharTokenizer()) is None
    assert SamplingParams.for_tokenizer(CharTokenizer(), 4).stop_token_ids == (CharTokenizer().eos_token_id,)


def test_a_row_ends_at_whichever_stop_token_comes_first_in_both_loops():
    model = _engine("qwen2-tiny").module.eval()
    ids, mask = _left_padded(PROMPTS, TOK.pad_token_id)
    free = decode(model, ids, mask, _params(10, TOK.eos_token_id, greedy=True))
    first, second = free[2][2], free[0][2]  # two tokens that end different rows first
    params = SamplingParams(10, greedy=True, stop_token_ids=(first, second), pad_token_id=TOK.pad_token_id)
    ours = decode(model, ids, mask, params)
    for row, full in zip(ours, free):
        end = next((k + 1 for k, t in enumerate(full) if t in (first, second)), len(full))
        assert row == full[:end]
    assert {first, second} <= {row[-1] for row in ours}
    assert _hf_generate(model, ids, mask, params, False) == ours


def _exported(tmp_path):
    """A "pretrained" checkpoint with the ChatML tokenizer, written by an older transformers
    (as downloaded models are), exported the way a run's final/ is."""
    source = tmp_path / "source"
    tok = saved_chatml_tokenizer(source)
    write_checkpoint(source, "qwen2-tiny", tok)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "transformers_version": "4.42.3"}))
    engine = FSDPEngine(ModelConfig(path=str(source)), EngineConfig()).initialize()
    export_model(engine, tmp_path / "final", tok)
    return tmp_path / "final", tok


def test_the_export_has_no_loader_only_tokenizer_keys_and_an_honest_transformers_version(tmp_path):
    final, tok = _exported(tmp_path)
    # The trainer's tokenizer carries its loading arguments: a plain save would write them.
    tok.save_pretrained(str(tmp_path / "plain"))
    assert json.loads((tmp_path / "plain" / "tokenizer_config.json").read_text())["local_files_only"] is True
    exported = json.loads((final / "tokenizer_config.json").read_text())
    assert not {"local_files_only", "is_local", "trust_remote_code", "cache_dir"} & set(exported)
    assert exported["eos_token"] == "<|endoftext|>"
    # config.json is in the format of the transformers that wrote it (e.g. "dtype" for 4.x's
    # "torch_dtype"): its version says so, not the source checkpoint's.
    config = json.loads((final / "config.json").read_text())
    assert config["transformers_version"] == transformers.__version__
    back = transformers.AutoTokenizer.from_pretrained(str(final))
    assert back.chat_template and back.convert_tokens_to_ids("<|im_end|>") == end_of_turn_token_id(tok)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(final))
    assert torch.isfinite(model(input_ids=torch.tensor([[1, 5, 6]])).logits).all()

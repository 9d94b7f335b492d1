"""A GGUF file as ``model.path`` (engines/model/gguf.py): the file, or the directory holding it,
resolves to the converted directory, whose weights give Hugging Face's forward of the GGUF file
itself bit for bit; a truncated copy, a directory with two GGUF files and a missing package are
each one line naming the file and the fix."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.errors import ConfigError
from polyfsdp.trainer.train import main


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_gguf_file_and_its_directory_resolve_to_the_converted_model(gguf_file, real_model_dir):
    for given in (gguf_file, gguf_file.parent):
        assert load_config([f"model.path={given}"]).model.path == real_model_dir
    cfg = load_config([f"model.path={gguf_file}"])
    assert cfg.raw["model"]["path"] == str(gguf_file)  # config.yaml and resumed runs name the file
    tok = AutoTokenizer.from_pretrained(real_model_dir)
    ids = torch.tensor([tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Name a colour."}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)])
    direct = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                  dtype=torch.float32, attn_implementation="eager")
    expected = _logits(direct, ids)
    del direct
    converted = AutoModelForCausalLM.from_pretrained(real_model_dir, attn_implementation="eager")
    assert torch.equal(_logits(converted, ids), expected)


def _one_line_error(capsys, overrides):
    assert main([*overrides, "trainer.sft_steps=0", "trainer.rl_steps=1"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_truncated_gguf_is_one_line(gguf_file, real_model_dir, tmp_path, capsys):
    damaged = tmp_path / "damaged.gguf"
    with open(gguf_file, "rb") as src, open(damaged, "wb") as dst:
        dst.write(src.read(gguf_file.stat().st_size // 2))
    line = _one_line_error(capsys, [f"model.path={damaged}"])
    assert str(damaged) in line and "truncated or damaged" in line, line


def test_two_gguf_files_in_a_directory_are_one_line(tmp_path, capsys):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    line = _one_line_error(capsys, [f"model.path={tmp_path}"])
    assert "a.gguf, b.gguf" in line and str(tmp_path) in line, line


def test_missing_gguf_package_is_one_line_with_the_install(gguf_file, monkeypatch):
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_gguf_available", lambda *a: False)
    with pytest.raises(ConfigError, match=r"needs gguf: pip install 'polyfsdp\[gguf\]'") as info:
        load_config([f"model.path={gguf_file}"])
    assert str(gguf_file) in str(info.value)

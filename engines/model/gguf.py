"""A GGUF file as ``model.path``: de-quantized once into a cached Hugging Face directory.

Everything downstream (the engine, tokenizer loading, vLLM, exports) reads plain HF
directories, so the GGUF file is turned into one here and nowhere else: transformers
de-quantizes it (with the ``gguf`` package), the weights are copied into a plain model of the
same config (a model loaded from GGUF is flagged as quantized and refuses ``save_pretrained``)
and saved with the tokenizer and chat template the file carries.

The cache is ``$POLYFSDP_CACHE/gguf/<key>/`` (default ``~/.cache/polyfsdp/gguf``), where the key
hashes the file's first and last MiB, its size, the dtype and the transformers version (a newer
one may de-quantize differently). A conversion writes a temporary directory and renames it, so a
killed one never leaves a half cache. Ranks resolve the path before any process group exists
(``--estimate`` and the memory check read the config first), and the cache is per host: on
each host local rank 0 converts and the other local ranks wait for the directory to appear
(torchrun stops them if rank 0 fails).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

CACHE_ENV = "POLYFSDP_CACHE"
INSTALL_FIX = "pip install 'polyfsdp[gguf]' (the gguf and accelerate packages)"
_HASHED_BYTES = 1 << 20
_WAIT_S = 3600.0  # another local rank converting: at most this long (a large model de-quantizes slowly)


class GGUFError(ValueError):
    """A GGUF ``model.path`` that cannot be used; ``str()`` is one line naming the file and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


def gguf_file(path: str) -> Path | None:
    """The GGUF file ``path`` names (the file itself, or the one ``*.gguf`` in a directory without a
    ``config.json``); None for anything else, which is read as a Hugging Face directory."""
    p = Path(path)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return p
    if not p.is_dir() or (p / "config.json").exists():
        return None
    found = sorted(f for f in p.iterdir() if f.suffix.lower() == ".gguf" and f.is_file())
    if len(found) > 1:
        raise GGUFError(f"model.path={path}: holds {len(found)} GGUF files ({', '.join(f.name for f in found)}); "
                        f"name one: model.path={found[0]}")
    return found[0] if found else None


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "polyfsdp") / "gguf"


def cache_key(file: Path, dtype: str) -> str:
    """Hash of the file's first and last MiB, its size, ``dtype`` and the transformers version:
    cheap on a multi-GB file, and any truncation or re-quantization changes it."""
    import transformers

    size = file.stat().st_size
    digest = hashlib.sha256(f"{size}:{dtype}:{transformers.__version__}".encode())
    with open(file, "rb") as f:
        digest.update(f.read(_HASHED_BYTES))
        f.seek(max(0, size - _HASHED_BYTES))
        digest.update(f.read(_HASHED_BYTES))
    return digest.hexdigest()[:32]


def resolve_model_path(path: str | None, dtype: str = "float32", local_rank: int = 0) -> str | None:
    """``path`` itself, or for a GGUF file (or a directory holding one) the cached Hugging Face
    directory it converts to, converting it first when missing."""
    file = gguf_file(path) if path else None
    if file is None:
        return path
    _require_packages(file)
    target = cache_root() / cache_key(file, dtype)
    if target.is_dir():
        return str(target)
    if local_rank != 0:
        return str(_wait_for(target, file))
    _convert(file, target, dtype)
    return str(target)


def _require_packages(file: Path) -> None:
    from transformers.utils import is_accelerate_available, is_gguf_available

    missing = [name for name, ok in (("gguf", is_gguf_available()), ("accelerate", is_accelerate_available()))
               if not ok]
    if missing:
        raise GGUFError(f"model.path={file}: reading a GGUF file needs {' and '.join(missing)}: {INSTALL_FIX}")


def _check_readable(file: Path) -> None:
    """Parse the header and map every tensor: a truncated or damaged file fails here in one line,
    not deep inside transformers."""
    from gguf import GGUFReader

    try:
        GGUFReader(str(file))
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors ... on damage
        raise GGUFError(f"model.path={file}: not a readable GGUF file ({type(exc).__name__}: {exc}); "
                        f"truncated or damaged? Copy it again") from None


def _say(line: str) -> None:
    print(f"polyfsdp: {line}", file=sys.stderr, flush=True)


def _convert(file: Path, target: Path, dtype: str) -> None:
    _check_readable(file)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(target)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _say(f"converting {file} (GGUF) to a Hugging Face checkpoint at {dtype} in {target} (once; cached)")
    start = time.monotonic()
    try:
        _write_hf_directory(file, tmp, dtype)
        (tmp / "polyfsdp_gguf_source.json").write_text(json.dumps(
            {"file": str(file.resolve()), "size": file.stat().st_size, "dtype": dtype}, indent=1))
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # another host's rank finished first on shared storage: keep theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _say(f"converted {file.name} in {time.monotonic() - start:.0f} s")


def _write_hf_directory(file: Path, out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(file.parent), file.name
    torch_dtype = getattr(torch, dtype)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch_dtype,
                                                      local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
    except ValueError as exc:
        reason = " ".join(str(exc).split())
        if "architecture" in reason:
            raise GGUFError(f"model.path={file}: {reason} by transformers {_tf_version()}; convert the original "
                            f"checkpoint instead, or try a newer transformers") from None
        raise GGUFError(f"model.path={file}: transformers could not read it: {reason}") from None
    # The loaded model is flagged as quantized and refuses save_pretrained: copy into a plain one.
    config = loaded.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _tf_version() -> str:
    import transformers

    return transformers.__version__


def _remove_abandoned(target: Path) -> None:
    """Temporary directories of conversions of this file whose process is gone (killed)."""
    from polyfsdp.backends.distributed import process_gone

    for tmp in target.parent.glob(f".tmp-{target.name}-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and process_gone(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _wait_for(target: Path, file: Path) -> Path:
    _say(f"waiting for local rank 0 to convert {file.name} into {target}")
    deadline = time.monotonic() + _WAIT_S
    while not target.is_dir():
        if time.monotonic() > deadline:
            raise GGUFError(f"model.path={file}: local rank 0 did not finish converting it into {target} within "
                            f"{_WAIT_S:.0f} s; convert it in one process first (polyfsdp-train --estimate model.path=...)")
        time.sleep(1.0)
    return target

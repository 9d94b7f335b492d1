"""What an exported ``tokenizer_config.json`` must not carry: the arguments the tokenizer was
loaded with (``from_pretrained(..., local_files_only=True)`` and the like). Hugging Face keeps
them in the tokenizer's init kwargs and ``save_pretrained`` writes them back, so an export
would tell every later ``from_pretrained`` of it to stay offline (or trust remote code, or
read a cache directory of this machine), which no user of the checkpoint asked for."""
from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_CONFIG = "tokenizer_config.json"
# from_pretrained's loading arguments, never a property of the tokenizer itself.
LOADER_ONLY_KEYS = ("local_files_only", "is_local", "trust_remote_code", "cache_dir", "force_download", "proxies",
                    "token", "use_auth_token", "revision", "subfolder", "_commit_hash", "_from_auto", "_from_pipeline")


def strip_loader_keys(directory: str | Path) -> None:
    """Remove :data:`LOADER_ONLY_KEYS` from ``directory``'s tokenizer_config.json (if any)."""
    path = Path(directory) / TOKENIZER_CONFIG
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    if isinstance(config, dict) and any(k in config for k in LOADER_ONLY_KEYS):
        kept = {k: v for k, v in config.items() if k not in LOADER_ONLY_KEYS}
        path.write_text(json.dumps(kept, indent=2, ensure_ascii=False) + "\n")

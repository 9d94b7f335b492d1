"""The job's Hugging Face exports (``sft_model/``, ``final/``): written atomically, with the
tokenizer, the run state the next phase starts from, and a critic's value head beside them.

The model itself goes through the engine's one export path (``engines/checkpoint/hf_export.py``): full
weights, or a LoRA model merged or as a peft adapter directory.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from polyfsdp.backends.distributed import barrier, current_rank
from polyfsdp.engines.checkpoint.files import remove_path

from .resume import STATE_FILE

CRITIC_HEAD_FILE = "value_head.safetensors"  # final/: the critic's head (ModelConfig.value_head_path)


def processor_of(engine, tokenizer):
    """A vision-language model's processor to export beside it: the one its checkpoint holds, else
    (a tiny preset's) its family's around the character tokenizer; None for a text model."""
    from ..data.tokenizers import CharTokenizer
    from ..data.vision import load_processor, tiny_vision_processor

    config = engine.module.config
    if getattr(config, "vision_config", None) is None:
        return None
    source = engine.model_config.path
    loaded = load_processor(source) if source else None
    if loaded is None and isinstance(tokenizer, CharTokenizer):
        return tiny_vision_processor(tokenizer, config)
    return loaded


def export_model(engine, directory: Path, tokenizer, state: dict | None = None, lora: str = "merged",
                 critic=None) -> None:
    """Export ``engine``'s model + ``tokenizer`` to ``directory`` atomically (tmp + rename); a
    LoRA model as merged weights or (``lora="adapter"``) a peft adapter directory, a vision-language
    model with its processor (:func:`processor_of`); ``state``
    (JSON) as ``STATE_FILE`` beside it; ``critic``'s value head as ``CRITIC_HEAD_FILE``
    (``algo.critic.value_head_path`` of a later run starts its critic's head there). A failed
    write leaves no partial directory; an old ``directory`` that is a symbolic link is
    unlinked, never followed (its target stays as it was). Collective."""
    rank = current_rank()
    tmp = directory.with_name(directory.name + ".tmp")
    if rank == 0:
        remove_path(tmp)
    try:
        engine.export_hf(str(tmp), tokenizer=tokenizer, lora=lora)
        processor = processor_of(engine, tokenizer) if rank == 0 else None
        if processor is not None:
            # After the tokenizer: the processor's tokenizer files (the vision tokens included) replace
            # its text-only ones; char_tokenizer.json stays for the trainer (trainer/data/vision.py).
            processor.save_pretrained(str(tmp))
        if rank == 0:
            if state is not None:
                (tmp / STATE_FILE).write_text(json.dumps(state))
            remove_path(directory)
            os.replace(tmp, directory)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a full disk: give back what was written
        raise
    barrier()
    if critic is not None:
        critic.export_value_head(directory / CRITIC_HEAD_FILE)

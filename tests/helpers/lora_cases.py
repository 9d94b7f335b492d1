"""The LoRA engine and batches shared by the one- and two-rank LoRA tests (tests/distributed/test_lora_ranks.py)."""
from tests.helpers.engine_cases import masks_for
from tests.helpers.engine_reference import no_padding_batch, sequences
from tests.helpers.lora_reference import randomize_adapters
from polyfsdp.engines.config import EngineConfig, LoraConfig, ModelConfig, OptimConfig

PRESET = "qwen2-tiny"
LENGTHS = [6, 1, 12, 6, 3, 9]
STEPS = 2


def lora_engine(seed=3, backend=None, **engine_overrides):
    """A LoRA engine (rank 4, weight decay and clipping on) with random adapters: lora_B starts
    at zero in peft, which would leave lora_A without a gradient in the first step."""
    from polyfsdp.engines.engine import FSDPEngine

    engine = FSDPEngine(ModelConfig(preset=PRESET, seed=seed, lora=LoraConfig(rank=4, alpha=8.0)),
                        EngineConfig(**engine_overrides), OptimConfig(lr=1e-2, weight_decay=0.01, grad_clip=1.0),
                        backend=backend).initialize()
    randomize_adapters(engine.module, seed=1)
    return engine


def step_batch(step, share=None):
    """Step ``step``'s SFT batch; ``share(num_seqs)`` picks this rank's sequence indices."""
    seqs = sequences(LENGTHS, seed=60 + step)
    keep = range(len(seqs)) if share is None else share(len(seqs))
    masks = masks_for(seqs)
    return no_padding_batch([seqs[i] for i in keep], per_token={"response_mask": [masks[i] for i in keep]})

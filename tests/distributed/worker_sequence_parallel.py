"""torchrun worker: Ulysses sequence parallelism (sp = world size / dp). Per mode: infer_batch
on two batches and one forward_backward (gradients gathered in full); the Ulysses attention
function alone against plain attention (GQA split and repeated); SP ranks with different
batches. Rank 0 saves the results."""
import os
import sys
import types

import torch

from tests.helpers.engine_cases import PRESET, engine_config, masks_for, train_loss  # noqa: E402
from tests.helpers.engine_reference import left_right_batch, no_padding_batch, sequences  # noqa: E402
from tests.helpers.sequence_parallel_cases import (CRITIC_CLIP, CRITIC_MODES, INFER_LENGTHS, MODES, TRAIN_LENGTHS,  # noqa: E402
                                     critic_fields, temperatures)

from rank_results import full_grads, save_every_rank  # noqa: E402

from polyfsdp.backends import destroy_distributed  # noqa: E402
from polyfsdp.backends.distributed import sequence_parallel_mesh  # noqa: E402
from polyfsdp.engines.attention import varlen_sdpa_attention_forward  # noqa: E402
from polyfsdp.engines.config import ModelConfig  # noqa: E402
from polyfsdp.engines.engine import FSDPEngine  # noqa: E402
from polyfsdp.engines.losses.value import ValueLoss  # noqa: E402
from polyfsdp.engines.attention.ulysses import SP_KWARG, UlyssesContext, ulysses_attention  # noqa: E402
from polyfsdp.backends.base import HOST_CU_SEQ_LENS  # noqa: E402
from polyfsdp.patches.fused_attention import OP_ATTR, fusion_attention_forward  # noqa: E402
from tests.npu.reference_ops import npu_fusion_attention  # noqa: E402

# The Ulysses wrapper around each inner attention: polyfsdp's varlen SDPA, and the NPU
# fusion attention (TND layout) running Ascend's documented op in plain torch.
INNERS = {"varlen": (varlen_sdpa_attention_forward, None),
          "fusion": (fusion_attention_forward, types.SimpleNamespace(**{OP_ATTR: npu_fusion_attention}))}


def attention_alone(sp, rank, kv_heads, inner, module):
    """Ulysses attention on this rank's positions vs plain varlen attention on all of them."""
    g = torch.Generator().manual_seed(kv_heads)
    bounds = [0, 3, 4, 8, 15, 16]  # sequences 3, 1, 4, 7, 1: one ends on the shard boundary
    q = torch.randn(1, 4, 16, 8, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, 16, 8, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, 16, 8, generator=g, requires_grad=True)
    weight = torch.randn(1, 16, 4, 8, generator=g)
    ref, _ = varlen_sdpa_attention_forward(None, q, k, v, None, scaling=0.3, **{HOST_CU_SEQ_LENS: bounds})
    (ref * weight).sum().backward()
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    shard = 16 // sp.size()
    cols = slice(rank * shard, (rank + 1) * shard)
    local = [t.detach()[:, :, cols].clone().requires_grad_(True) for t in (q, k, v)]
    cu = torch.tensor(bounds, dtype=torch.int32)
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 7, "max_length_k": 7, HOST_CU_SEQ_LENS: bounds}
    ctx = UlyssesContext(sp.get_group(), sp.size(), kwargs)
    out, _ = ulysses_attention(inner, module, *local, None, scaling=0.3, **{SP_KWARG: ctx})
    (out * weight[:, cols]).sum().backward()
    return {"out": (out.detach(), ref[:, cols].detach()),
            "grads": [(t.grad, r[:, :, cols]) for t, r in zip(local, ref_grads)]}


def main(out_dir, sp_size):
    rank = int(os.environ["RANK"])
    results = {}
    masks_seqs = sequences(TRAIN_LENGTHS, seed=3)
    masks = masks_for(masks_seqs)
    for name, rmpad, fused, pad_mode, extra in MODES:
        engine = FSDPEngine(ModelConfig(preset=PRESET, seed=5),
                            engine_config(use_remove_padding=rmpad, use_fused_kernels=fused, pad_mode=pad_mode,
                                          ulysses_sp_size=sp_size, **extra)).initialize()
        build = no_padding_batch if pad_mode == "no_padding" else left_right_batch
        for which, lengths in enumerate((INFER_LENGTHS, TRAIN_LENGTHS)):
            seqs = sequences(lengths, seed=3)
            out = engine.infer_batch(build(seqs), temperature=temperatures(len(seqs)))
            results[f"infer_{name}_{which}"] = {k: (v.values() if v.is_nested else v) for k, v in out.items()}
        engine.forward_backward(build(masks_seqs, per_token={"response_mask": masks}), train_loss())
        results[f"grads_{name}"] = full_grads(engine.module)
        results[f"loss_{name}"] = engine.optimizer_step()["loss"]
    old, returns = critic_fields(masks_seqs)
    for name, rmpad, pad_mode in CRITIC_MODES:
        critic = FSDPEngine(ModelConfig(preset=PRESET, seed=5, value_head=True, value_head_init_std=0.5),
                            engine_config(use_remove_padding=rmpad, pad_mode=pad_mode, ulysses_sp_size=sp_size)
                            ).initialize()
        build = no_padding_batch if pad_mode == "no_padding" else left_right_batch
        values = critic.infer_values(build(sequences(INFER_LENGTHS, seed=3)))["values"]
        results[f"values_{name}"] = values.values() if values.is_nested else values
        critic.forward_backward(build(masks_seqs, per_token={"response_mask": masks, "old_values": old,
                                                             "returns": returns}), ValueLoss(cliprange_value=CRITIC_CLIP))
        results[f"grads_{name}"] = full_grads(critic.module)
        results[f"loss_{name}"] = critic.optimizer_step()["loss"]
    mesh = sequence_parallel_mesh("cpu", sp_size)
    for kv_heads in (1, 2):
        for inner_name, (inner, module) in INNERS.items():
            results[f"attention_{inner_name}_kv{kv_heads}"] = attention_alone(
                mesh["sp"], mesh.get_local_rank("sp"), kv_heads, inner, module)
    engine = FSDPEngine(ModelConfig(preset=PRESET, seed=5), engine_config(ulysses_sp_size=sp_size)).initialize()
    try:
        engine.infer_batch(no_padding_batch(sequences([3 + rank, 2], seed=3)))
        results["different_batches"] = None
    except ValueError as exc:
        results["different_batches"] = str(exc)
    save_every_rank(results, os.path.join(out_dir, "sp.pt"))
    print(f"rank={rank} done", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

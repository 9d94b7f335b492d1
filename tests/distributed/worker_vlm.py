"""torchrun worker: a vision-language model on 2 ranks (gloo), the tower and the decoder
sharded by FSDP2. Rank 0 brings rows with 1 and 2 images, rank 1 text-only rows and one image
row, so the ranks' micro-batches differ in images (a text-only micro-batch runs the tower on
the dummy image, or the ranks' collectives would not pair up). Every rank computes the HF
reference of both ranks' sequences alone; rank 0 saves every rank's results."""
import os
import sys

import torch

from tests.helpers.engine_reference import full_state_dict  # noqa: E402
from tests.helpers.vlm_reference import vlm_batch, vlm_reference_logprobs, vlm_reference_model, vlm_sequences  # noqa: E402

from rank_results import full_grads, save_every_rank  # noqa: E402

from polyfsdp.backends import destroy_distributed  # noqa: E402
from polyfsdp.engines.batch.flat import batch_to_flat  # noqa: E402
from polyfsdp.engines.config import EngineConfig, ModelConfig  # noqa: E402
from polyfsdp.engines.engine import FSDPEngine  # noqa: E402
from polyfsdp.engines.losses import SFTLoss  # noqa: E402

PRESET = "qwen2-vl-tiny"
SPECS = {0: [["small"], ["wide", "square"], ["square"]], 1: [[], [], ["small"], []]}


def masks_for(seqs):
    """The second half of each sequence counts (image tokens included where they fall)."""
    masks = []
    for seq in seqs:
        m = torch.zeros(len(seq["ids"]))
        m[len(seq["ids"]) // 2: -1] = 1.0
        masks.append(m)
    return masks


def main(out_dir):
    rank = int(os.environ["RANK"])
    every = {r: vlm_sequences(spec, seed=20 + r) for r, spec in SPECS.items()}
    seqs = every[rank]
    results = {}
    for name, config in (("plain", {}), ("budget", {"max_tokens_per_micro_batch": 6}),
                         ("balanced", {"balance_dp_tokens": True}), ("padded", {"use_remove_padding": False})):
        engine = FSDPEngine(ModelConfig(preset=PRESET, seed=4), EngineConfig(**config)).initialize()
        out = engine.infer_batch(vlm_batch(seqs, "no_padding"))
        results[f"infer_{name}"] = {k: v.values() for k, v in out.items()}
        batch = vlm_batch(seqs, "no_padding", per_token={"response_mask": masks_for(seqs)})
        flat = batch_to_flat(batch, "no_padding")
        with engine.train_mode():
            log_probs, _ = engine.forward_flat(flat, return_entropy=False)
            (log_probs * flat.fields["response_mask"]).sum().backward()
        results[f"grads_{name}"] = full_grads(engine.module)
        engine.optimizer.zero_grad(set_to_none=True)
        # A training pass through micro-batches (placeholders where a rank has fewer), the head
        # fused or not: SFT's token-mean loss over both ranks' response tokens.
        engine.engine_config = EngineConfig(**{**config, "use_fused_kernels": name != "padded"})
        engine.forward_backward(batch, SFTLoss())
        results[f"sft_grads_{name}"] = full_grads(engine.module)
        if name == "plain":
            reference = vlm_reference_model(PRESET, full_state_dict(engine.module))
            with torch.no_grad():
                results["expected"] = vlm_reference_logprobs(reference, seqs, [1.0] * len(seqs))
            total, results["response_tokens"] = 0, sum(m.sum().item() for t in every.values() for m in masks_for(t))
            for r, theirs in every.items():
                lps, _ = vlm_reference_logprobs(reference, theirs, [1.0] * len(theirs))
                total = total + sum(lp.dot(m.double()) for lp, m in zip(lps, masks_for(theirs)))
            total.backward()
            results["expected_grads"] = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
    save_every_rank(results, os.path.join(out_dir, "vlm.pt"))
    print(f"rank={rank} done", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])

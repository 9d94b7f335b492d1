"""The training step reads device values back to the host a fixed number of times,
however many micro-batches it runs (engines/engine.py, engines/batch/checks.py).

On a GPU/NPU every ``.item()``/``.tolist()``/``bool(tensor)`` stalls the pipeline. On the CPU
nothing is a real sync, so the test counts the calls themselves, made by polyfsdp's own code
(backends/, engines/, patches/, trainer/). Reads inside third-party code are reported by the
counter but not pinned here: torch's AdamW reads its host-side step counters, and
transformers' mask builder checks a packed row for sequence boundaries once per forward.
"""
import collections
import os
import traceback

import pytest
import torch
from tensordict import TensorDict

from tests.helpers import ROOT
from tests.helpers.engine_cases import LENGTHS, masks_for
from tests.helpers.engine_reference import no_padding_batch, sequences
from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig, OptimConfig, PPOLoss, SFTLoss, make_jagged

READS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__", "__index__")
OWN = tuple(os.path.join(ROOT, d) + os.sep for d in ("backends", "engines", "patches", "trainer"))
# One read of the host batch's lengths at the edge, one of the value checks together with
# the step's global counts, one of the gradient norm together with every metric.
READS_PER_STEP = 3


class ReadCounter:
    """Counts tensor-to-host reads while active, split into polyfsdp's own and the rest."""

    def __init__(self, monkeypatch):
        self.active = False
        self.own, self.other = collections.Counter(), collections.Counter()
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _wrap(self, name, method):
        def counted(tensor, *args, **kwargs):
            if self.active:
                caller = traceback.extract_stack(limit=2)[0]
                where = f"{name} at {os.path.relpath(caller.filename, ROOT)}:{caller.lineno}"
                (self.own if caller.filename.startswith(OWN) else self.other)[where] += 1
            return method(tensor, *args, **kwargs)
        return counted

    def step(self, engine, batch, loss_fn):
        """Count one forward_backward + optimizer_step."""
        self.own.clear()
        self.other.clear()
        self.active = True
        try:
            engine.forward_backward(batch, loss_fn)
            engine.optimizer_step()
        finally:
            self.active = False
        return sum(self.own.values())


def _ppo_batch():
    seqs = sequences(LENGTHS, seed=21)
    offsets = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    batch = no_padding_batch(seqs)
    batch["response_mask"] = make_jagged(torch.cat(masks_for(seqs)), offsets)
    batch["old_log_probs"] = make_jagged(torch.randn(int(offsets[-1])) * 0.1 - 4.0, offsets)
    batch["advantages"] = make_jagged(torch.randn(int(offsets[-1])), offsets)
    return batch


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("loss_fn", [SFTLoss(), PPOLoss(entropy_coef=0.01)], ids=["sft", "ppo"])
def test_host_reads_per_step_are_pinned_and_independent_of_micro_batches(monkeypatch, fused, loss_fn):
    counter = ReadCounter(monkeypatch)
    batch = _ppo_batch()
    counts = {}
    for budget in (None, 12):  # one micro-batch, then five
        engine = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=1),
                            EngineConfig(use_fused_kernels=fused, max_tokens_per_micro_batch=budget),
                            OptimConfig(lr=1e-3)).initialize()
        engine.train_batch(batch, loss_fn)  # warm-up: one-time work (warnings, lazy state)
        counts[budget] = counter.step(engine, batch, loss_fn)
        assert counts[budget] == READS_PER_STEP, dict(counter.own)
    assert counts[None] == counts[12]


def test_check_inputs_false_skips_the_value_checks_and_keeps_the_one_read(monkeypatch):
    counter = ReadCounter(monkeypatch)
    engine = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=1), EngineConfig(check_inputs=False),
                        OptimConfig(lr=1e-3)).initialize()
    batch = _ppo_batch()
    engine.train_batch(batch, PPOLoss())
    # The step's global counts still travel in one read, so the count is the same.
    assert counter.step(engine, batch, PPOLoss()) == READS_PER_STEP, dict(counter.own)
    adv = batch["advantages"].values().clone()
    adv[3] = float("nan")
    batch["advantages"] = make_jagged(adv, batch["advantages"].offsets())
    # Unchecked, the NaN reaches the gradients: the non-finite step is skipped, not refused.
    assert engine.train_batch(batch, PPOLoss())["step_skipped"] == 1


def _engine():
    return FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=1), EngineConfig(), OptimConfig(lr=1e-3)).initialize()


def test_bad_values_are_named_at_the_edge_before_any_forward():
    engine = _engine()
    batch = _ppo_batch()
    offsets = batch["advantages"].offsets()
    adv = batch["advantages"].values().clone()
    adv[7] = float("nan")  # sequence 1 is one token long: flat index 7 is sequence 2, position 0
    bad = TensorDict({**batch, "advantages": make_jagged(adv, offsets)}, batch_size=[len(LENGTHS)])
    with pytest.raises(ValueError, match=r"'advantages' must be finite; found nan at flat index 7 "
                                         r"\(sequence 2, position 0\)"):
        engine.forward_backward(bad, PPOLoss())
    mask = batch["response_mask"].values().clone()
    mask[2] = 2.0
    bad = TensorDict({**batch, "response_mask": make_jagged(mask, offsets)}, batch_size=[len(LENGTHS)])
    with pytest.raises(ValueError, match=r"'response_mask' must hold only 0/1 values; found 2.0 at flat index 2 "
                                         r"\(sequence 0, position 2\)"):
        engine.forward_backward(bad, PPOLoss())
    # Nothing was accumulated by the refused batches: the next step sees no stale gradients.
    assert all(p.grad is None for p in engine.module.parameters())


def test_gradients_accumulate_over_forward_backward_calls_until_the_optimizer_step():
    # Two half batches then one step == the whole batch in one step, when each half's loss is
    # normalised by the whole batch's count (here: the SFT sum over equal token counts).
    batch = _ppo_batch()
    whole, halves = _engine(), _engine()
    idx = [[0, 2, 4, 6], [1, 3, 5, 7]]
    m_whole = whole.train_batch(batch, SFTLoss(agg_mode="seq-mean-token-sum"))
    parts = [halves.forward_backward(batch[i], SFTLoss(agg_mode="seq-mean-token-sum")) for i in idx]
    m_halves = halves.optimizer_step()
    halves.lr_scheduler_step()
    # Each half is normalised by its own 4 sequences, the whole by 8: halves sum to 2x the mean.
    assert m_halves["loss"] == pytest.approx(2 * m_whole["loss"], rel=1e-5)
    assert m_halves["loss"] == pytest.approx(float(sum(p["loss"] for p in parts)), rel=1e-6)
    assert halves.global_step == whole.global_step == 1

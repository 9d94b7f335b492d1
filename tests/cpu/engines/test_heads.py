"""The engine's heads (engines/heads.py), the loss attributes it reads (loss_inputs.LossNeeds) and
the step metrics (engines/step_metrics.py), each on its own; the engine-level behaviour they carry
is compared with independent references in test_engine_*.py, test_value_head.py and
test_critic_lora.py."""
from __future__ import annotations

import ast

import pytest
import torch
from tensordict import TensorDict

from tests.helpers import ROOT
from polyfsdp.engines.config import ModelConfig
from polyfsdp.engines.heads import LMHead, ValueHead, head_for
from polyfsdp.engines.losses.inputs import LossNeeds
from polyfsdp.engines.losses import PPOLoss, SFTLoss
from polyfsdp.engines.step_metrics import accumulate, reduce_over_ranks
from polyfsdp.engines.losses.value import ValueLoss

ENGINE = ROOT / "engines" / "engine.py"


def test_the_config_picks_the_head():
    assert type(head_for(ModelConfig(preset="qwen2-tiny"))) is LMHead
    head = head_for(ModelConfig(preset="qwen2-tiny", value_head=True, value_head_init_std=0.5, seed=7))
    assert type(head) is ValueHead and (head.init_std, head.seed, head.path) == (0.5, 7, None)


def test_no_engine_branch_asks_which_head_it_has():
    # The head objects replaced the engine's `if self.is_critic` branches: the engine asks its head.
    tree = ast.parse(ENGINE.read_text())
    asks = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            names = {n.attr for n in ast.walk(node.test) if isinstance(n, ast.Attribute)}
            names |= {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
            if names & {"is_critic", "value_head", "ValueHead", "LMHead"}:
                asks.append(node.lineno)
    assert not asks, f"engines/engine.py branches on which head it has at lines {asks}"


def test_each_head_puts_its_outputs_where_the_loss_reads_them():
    first, second = torch.ones(3), torch.zeros(3)
    assert LMHead.loss_outputs(first, second) == {"log_probs": first, "entropy": second}
    out = ValueHead.loss_outputs(first, None)
    assert out["values"] is first and out["log_probs"] is None and out["entropy"] is None


def test_each_head_serves_its_own_inference_call_and_refuses_the_other():
    assert LMHead.log_prob_names(True) == ("log_probs", "entropy")
    assert LMHead.log_prob_names(False) == ("log_probs",)
    assert ValueHead.value_names() == ("values",)
    with pytest.raises(ValueError, match="infer_values: this engine has no value head"):
        LMHead.value_names()
    with pytest.raises(ValueError, match="infer_batch: this engine is a critic"):
        ValueHead.log_prob_names(True)
    with pytest.raises(ValueError, match="export_value_head: this engine has no value head"):
        LMHead.export_value_head(None, "unused", 0)


def test_only_the_lm_head_takes_a_loss_inside_its_forward():
    from polyfsdp.engines.config import EngineConfig

    modes = EngineConfig(use_fused_kernels=True, fuse_loss_into_head=True)
    lm = LMHead()
    assert lm.fuses_loss(SFTLoss(), modes, None)
    assert not lm.fuses_loss(SFTLoss(), modes, sp=object())  # sequence parallelism keeps the plain path
    assert not lm.fuses_loss(ValueLoss(), modes, None)  # not declared token-separable
    lm.fused_unsupported = "a reason"
    assert not lm.fuses_loss(SFTLoss(), modes, None)
    assert not ValueHead(0.01, 0).fuses_loss(SFTLoss(), modes, None)


def test_loss_needs_reads_the_attributes_and_their_defaults():
    def plain(inputs):
        return None

    assert LossNeeds.of(plain, TensorDict({}, batch_size=[1])) == LossNeeds((), True, "response_mask")
    needs = LossNeeds.of(SFTLoss(mask_field="loss_mask"), TensorDict({"loss_mask": torch.ones(1)}, batch_size=[1]))
    assert needs == LossNeeds(("loss_mask",), False, "loss_mask", masked_only=True)
    with pytest.raises(TypeError, match="loss_fn must be a callable"):
        LossNeeds.of("nll", TensorDict({}, batch_size=[1]))
    with pytest.raises(ValueError, match=r"PPOLoss needs batch keys .*missing \['old_log_probs', 'advantages'\]"):
        LossNeeds.of(PPOLoss(), TensorDict({"response_mask": torch.ones(1)}, batch_size=[1]))


def test_metrics_sum_as_shares_and_keep_maxima():
    totals: dict[str, torch.Tensor] = {}
    accumulate(totals, {"loss": torch.tensor(0.25), "ratio_max": torch.tensor(1.5), "nll": 0.5}, torch.device("cpu"))
    accumulate(totals, {"loss": torch.tensor(0.5), "ratio_max": torch.tensor(1.25), "nll": 0.25}, torch.device("cpu"))
    assert {k: v.item() for k, v in totals.items()} == {"loss": 0.75, "ratio_max": 1.5, "nll": 0.75}
    assert all(v.dtype == torch.float64 for v in totals.values())
    # One process: the names come back with the sums first, then the maxima, in one tensor.
    names, values = reduce_over_ranks(totals, torch.device("cpu"))
    assert names == ["loss", "nll", "ratio_max"] and values.tolist() == [0.75, 0.75, 1.5]
    names, values = reduce_over_ranks({}, torch.device("cpu"))
    assert names == [] and values.shape == (0,)

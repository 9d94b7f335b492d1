"""A reward model on 2 ranks (gloo): each rank's scores equal Hugging Face's
``Qwen2ForSequenceClassification`` forward of the same checkpoint on its own sequences, in both
pad modes, when the ranks plan different numbers of forwards and when one rank has no row."""
import os

import torch
from transformers import AutoModelForSequenceClassification

from torchrun_launcher import run_and_load

HERE = os.path.dirname(__file__)
from tests.cpu.trainer.rewards.test_reward_sources import write_reward_model  # noqa: E402

from polyfsdp.trainer.data.tokenizers import CharTokenizer  # noqa: E402

TOL = 1e-5


def test_reward_model_scores_on_two_ranks_equal_hf(tmp_path):
    path = write_reward_model(tmp_path / "rm", CharTokenizer())
    ranks = run_and_load(os.path.join(HERE, "worker_reward_model.py"), tmp_path, 2, (path,), "scores.pt")
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()

    def hf(ids):
        with torch.no_grad():
            return model(input_ids=torch.as_tensor(ids)[None], use_cache=False).logits[0, 0].item()
    for results in ranks:
        expected = torch.tensor([hf(s) for s in results["seqs"]])
        for pad_mode in ("no_padding", "left_right"):
            assert (results[pad_mode] - expected).abs().max().item() <= TOL, pad_mode
    assert abs(ranks[0]["source"][0] - hf([1, 7, 8, 9, 10, 11])) <= TOL
    assert ranks[1]["source"] == []

"""The RL phase says so when its first rollout was sampled from a near-uniform distribution
(the case where RL measurably undid a LoRA SFT warm-up), and stays quiet otherwise."""
from __future__ import annotations

import math

import torch

from polyfsdp.trainer.rollout.flat_sampling import FLAT_ENTROPY_SHARE, flat_sampling_warning
from polyfsdp.trainer.train import main

WARNING = "warning: the first RL rollout was sampled at entropy"


def test_the_warning_fires_from_the_share_of_the_uniform_entropy():
    uniform = math.log(85)
    said = flat_sampling_warning(FLAT_ENTROPY_SHARE * uniform + 1e-3, 85, 30)
    assert WARNING in said and "undo the SFT warm-up" in said
    for entropy in (FLAT_ENTROPY_SHARE * uniform - 1e-3, 0.9, None):
        assert flat_sampling_warning(entropy, 85, 30) is None


def test_rl_from_an_untrained_model_warns_once(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        code = main(["trainer.sft_steps=0", "trainer.rl_steps=2", "trainer.prompts_per_step=4",
                     "algo.actor.group_size=4", "data.eval_size=4", "trainer.progress=off", "trainer.plot=false",
                     "trainer.export=false", f"trainer.output_dir={tmp_path / 'run'}"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    said = capsys.readouterr().out
    assert said.count(WARNING) == 1
    assert "undo the SFT warm-up" not in said and "start from a trained model" in said  # no warm-up ran

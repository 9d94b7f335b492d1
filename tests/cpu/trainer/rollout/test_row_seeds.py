"""Sampling seeds per global sample (trainer/rollout/row_seeds.py) and the samplers that use them
(trainer/rollout/row_sampler.py): distinct rows get distinct bounded seeds, the replicas' shares of a
step's rows are the global rows' seeds whatever the data-parallel degree, and a row's
completion depends on its prompt and seed only: not on which rows share its batch, nor on
whether our loop or HF ``generate`` decodes it."""
import pytest
import torch

from polyfsdp.backends.topology import Topology
from polyfsdp.trainer.config.bounds import MAX_SEED
from polyfsdp.trainer.rollout.decode import decode
from polyfsdp.trainer.rollout.generate import _hf_generate, _left_padded
from polyfsdp.trainer.rollout.row_seeds import RowSeeds, mix_seed, row_seed, turn_seed

from tests.cpu.trainer.rollout.test_decode_loop import PROMPTS, TOK, _engine, _params


def test_distinct_rows_rounds_steps_and_seeds_get_distinct_63_bit_seeds():
    keys = [(seed, step, r, row) for seed in (0, 1, 7, MAX_SEED) for step in (0, 1, 1_000_003, 10**9)
            for r in (0, 1, 1023) for row in range(64)]
    seeds = [row_seed(*key) for key in keys]
    assert len(set(seeds)) == len(keys)
    assert all(0 <= s < 2**63 for s in seeds)
    # The per-replica formula's parts could collide ((seed * 1_000_003 + step)); these do not.
    assert row_seed(0, 1_000_003, 0, 0) != row_seed(1, 0, 0, 0)
    assert turn_seed(seeds[0], 1) != turn_seed(seeds[0], 2) != seeds[0]
    with pytest.raises(ValueError, match="must be >= 0"):
        mix_seed(1, -1)


@pytest.mark.parametrize("dp", [2, 4])
def test_replica_shares_hold_the_global_rows_seeds(dp):
    prompts, group = 8, 4
    whole = RowSeeds(5, 3).rows(1, prompts, group)
    shares = []
    for replica in range(dp):
        topo = Topology(world_size=dp, rank=replica, local_rank=replica, sp_size=1)
        shares += RowSeeds(5, 3, first_prompt=topo.share_start(prompts)).rows(1, prompts // dp, group)
    assert shares == whole
    assert RowSeeds(5, 3).rows(0, prompts, group) != whole  # another resampling round, other seeds


def _sampled(model, prompts, seeds, loop):
    ids, mask = _left_padded(prompts, TOK.pad_token_id)
    eos = TOK.encode("a")[0]  # frequent: rows end (and leave our loop's batch) at many steps
    params = _params(10, eos, temperature=0.9, log_probs=True)
    if loop == "builtin":
        return decode(model, ids, mask, params, row_seeds=seeds)
    return _hf_generate(model, ids, mask, params, False, row_seeds=seeds)


@pytest.mark.parametrize("loop", ["builtin", "hf"])
def test_a_row_draws_the_same_completion_in_any_batch(loop):
    model = _engine("qwen2-tiny").module.eval()
    prompts = PROMPTS * 4
    seeds = RowSeeds(0, 0).rows(0, len(prompts), 1)
    rows, log_probs = _sampled(model, prompts, seeds, loop)
    assert len({len(r) for r in rows}) > 2 and len(set(map(tuple, rows))) > len(PROMPTS)
    # Each half alone, the second one reversed: every row keeps its completion.
    half = len(prompts) // 2
    first, _ = _sampled(model, prompts[:half], seeds[:half], loop)
    second, _ = _sampled(model, prompts[half:][::-1], seeds[half:][::-1], loop)
    assert first + second[::-1] == rows
    # Negative control: one generator for the batch (the per-replica seeding) does not keep them.
    torch.manual_seed(0)
    shared, _ = _sampled(model, prompts, None, loop)
    torch.manual_seed(0)
    shared_half, _ = _sampled(model, prompts[half:], None, loop)
    assert shared_half != shared[half:]
    # The log-probs are the drawn tokens' under softmax(logits / T), as without row seeds.
    for prompt, row, lp in zip(prompts, rows, log_probs):
        assert len(lp) == len(row)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + row])).logits[0, len(prompt) - 1:-1].float() / 0.9
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(row)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lp), ref, rtol=1e-4, atol=1e-4)


def test_our_loop_and_hf_generate_draw_the_same_tokens_from_the_same_seeds():
    model = _engine("qwen2-tiny").module.eval()
    seeds = RowSeeds(2, 9).rows(0, len(PROMPTS), 3)
    prompts = [p for p in PROMPTS for _ in range(3)]
    ours, _ = _sampled(model, prompts, seeds, "builtin")
    hf, _ = _sampled(model, prompts, seeds, "hf")
    # HF's path cuts trailing pad tokens (it pads finished rows): a random model samples pad too.
    cut = [_without_trailing_pad(row) for row in ours]
    assert cut == hf and sum(map(len, hf)) > 5 * len(hf)


def _without_trailing_pad(row):
    while row and row[-1] == TOK.pad_token_id:
        row = row[:-1]
    return row

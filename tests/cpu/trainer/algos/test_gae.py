"""GAE (trainer/algos/gae.py) against a straightforward per-sequence loop, and the critic's values
through both pad modes into it."""
import pytest
import torch

from polyfsdp.trainer.algos.advantages import WHITEN_EPS
from polyfsdp.trainer.data.batch import build_batch, per_sequence, response_mask
from polyfsdp.trainer.algos.gae import explained_variance, gae_advantages


def loop_gae(score, mask, values, gamma, lam, kl=None, kl_coef=0.0):
    """One sequence, plain Python over its response positions: (raw advantages, returns)."""
    idx = [t for t in range(len(mask)) if mask[t] > 0]
    adv = [0.0] * len(mask)
    ret = [0.0] * len(mask)
    next_adv = 0.0
    for k in reversed(range(len(idx))):
        t = idx[k]
        reward = (score if k == len(idx) - 1 else 0.0) - (kl_coef * float(kl[t]) if kl is not None else 0.0)
        next_value = float(values[idx[k + 1]]) if k + 1 < len(idx) else 0.0
        delta = reward + gamma * next_value - float(values[t])
        next_adv = delta + gamma * lam * next_adv
        adv[t] = next_adv
        ret[t] = next_adv + float(values[t])
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def loop_whiten(advs, masks):
    picked = torch.cat([a[m > 0] for a, m in zip(advs, masks)])
    mean, var = picked.mean(), picked.var(unbiased=True)
    return [(a - mean) / torch.sqrt(var + WHITEN_EPS) * (m > 0) for a, m in zip(advs, masks)]


def _case(seed, prompt_lens, response_lens):
    g = torch.Generator().manual_seed(seed)
    pairs = [(list(range(1, p + 1)), list(range(1, r + 1))) for p, r in zip(prompt_lens, response_lens)]
    masks = [response_mask(p, r) for p, r in pairs]
    values = [torch.randn(len(m), generator=g) for m in masks]
    kl = [torch.randn(len(m), generator=g) * 0.3 for m in masks]
    scores = torch.rand(len(pairs), generator=g).tolist()
    return pairs, masks, values, kl, scores


def test_hand_computed_two_tokens():
    # Prompt of 2, response of 2: response positions 1 and 2 (position 3 is the last token).
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0])
    values = torch.tensor([9.0, 0.5, 0.25, 7.0])
    adv, ret = gae_advantages([1.0], [mask], [values], gamma=0.5, lam=0.5)
    # delta_2 = 1 - 0.25 = 0.75; delta_1 = 0 + 0.5*0.25 - 0.5 = -0.375; A_1 = -0.375 + 0.25*0.75 = -0.1875
    assert torch.allclose(ret[0], torch.tensor([0.0, -0.1875 + 0.5, 0.75 + 0.25, 0.0]))
    # Whitened over the two tokens: +-1/sqrt(2) (unbiased variance of two values).
    assert torch.allclose(adv[0], torch.tensor([0.0, -(0.5 ** 0.5), 0.5 ** 0.5, 0.0]), atol=1e-6)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (0.0, 0.95)])
def test_environment_turns_are_skipped_as_if_only_the_sampled_tokens_existed(gamma, lam):
    """A multi-turn response: sampled turns (mask 1) with environment turns (mask 0) between
    them. GAE over it equals GAE over the sampled tokens alone, laid back in place: an
    environment token's value and position never reach an advantage."""
    g = torch.Generator().manual_seed(5)
    masks = [torch.tensor([0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 1, 0], dtype=torch.float32),
             torch.tensor([0, 1, 0, 1, 1, 0, 0], dtype=torch.float32)]
    values = [torch.randn(len(m), generator=g) for m in masks]
    kl = [torch.randn(len(m), generator=g) * 0.3 for m in masks]
    scores = [0.7, -0.2]
    adv, ret = gae_advantages(scores, masks, values, gamma, lam, kl=kl, kl_coef=0.1)
    # The reference: the sampled tokens alone, as one contiguous response (no holes).
    compact = [(m > 0).nonzero().flatten() for m in masks]
    c_adv, c_ret = gae_advantages(scores, [torch.ones(len(i)) for i in compact], [v[i] for v, i in zip(values, compact)],
                                  gamma, lam, kl=[k[i] for k, i in zip(kl, compact)], kl_coef=0.1)
    for a, r, m, i, ca, cr in zip(adv, ret, masks, compact, c_adv, c_ret):
        torch.testing.assert_close(a[i], ca, atol=1e-6, rtol=0)
        torch.testing.assert_close(r[i], cr, atol=1e-6, rtol=0)
        assert torch.all(a[m == 0] == 0) and torch.all(r[m == 0] == 0)
    # Negative control: the environment tokens' values are not ignored by accident of the data.
    bumped = [v + 5.0 * (1 - m) for v, m in zip(values, masks)]
    adv2, _ = gae_advantages(scores, masks, bumped, gamma, lam, kl=kl, kl_coef=0.1)
    assert all(torch.equal(a, b) for a, b in zip(adv, adv2))


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (1.0, 0.0), (0.0, 0.95)])
@pytest.mark.parametrize("kl_coef", [0.0, 0.2])
def test_matches_the_per_sequence_loop(gamma, lam, kl_coef):
    # Length-1 responses, an empty response, varied prompt lengths (masked prompt positions).
    pairs, masks, values, kl, scores = _case(3, [1, 3, 2, 5, 1, 4], [4, 1, 6, 1, 3, 0])
    adv, ret = gae_advantages(scores, masks, values, gamma, lam, kl=kl if kl_coef else None, kl_coef=kl_coef)
    raw, expected_ret = zip(*(loop_gae(s, m, v, gamma, lam, k if kl_coef else None, kl_coef)
                              for s, m, v, k in zip(scores, masks, values, kl)))
    expected_adv = loop_whiten(raw, masks)
    for a, r, ea, er, m in zip(adv, ret, expected_adv, expected_ret, masks):
        assert a.shape == m.shape and r.shape == m.shape
        assert torch.allclose(r.double(), er, atol=1e-6)
        assert torch.allclose(a.double(), ea, atol=1e-5)
        assert torch.all(a[m == 0] == 0) and torch.all(r[m == 0] == 0)


def test_lambda_one_gamma_one_is_the_reward_to_go_minus_the_value():
    # Negative control for the recurrence: with gamma = lam = 1 the raw advantage telescopes.
    pairs, masks, values, _, scores = _case(5, [2, 3], [3, 2])
    _, ret = gae_advantages(scores, masks, values, 1.0, 1.0)
    for r, m, s in zip(ret, masks, scores):
        assert torch.allclose(r[m > 0], torch.full((int(m.sum()),), s), atol=1e-6)


def test_ranks_share_the_whitening_statistics():
    # Two "ranks" holding two sequences each whiten like one rank holding all four when
    # sum_over_ranks adds the other rank's moments (computed by the loop reference).
    _, masks, values, _, scores = _case(7, [2, 3, 1, 2], [3, 2, 4, 1])
    whole, _ = gae_advantages(scores, masks, values, 0.9, 0.9)

    def moments(part):
        raw = [loop_gae(s, m, v, 0.9, 0.9)[0] for s, m, v in zip(scores[part], masks[part], values[part])]
        return [sum(float(a.sum()) for a in raw), sum(float((a ** 2).sum()) for a in raw),
                sum(float(m.sum()) for m in masks[part])]

    halves = []
    for part, other in ((slice(0, 2), slice(2, 4)), (slice(2, 4), slice(0, 2))):
        add_other = lambda mine, other=other: [x + y for x, y in zip(mine, moments(other))]  # noqa: E731
        halves += gae_advantages(scores[part], masks[part], values[part], 0.9, 0.9, sum_over_ranks=add_other)[0]
    for a, b in zip(whole, halves):
        assert torch.allclose(a, b, atol=1e-5)
    # Negative control: each rank whitening alone gives other advantages.
    alone = gae_advantages(scores[:2], masks[:2], values[:2], 0.9, 0.9)[0]
    assert not all(torch.allclose(a, b, atol=1e-3) for a, b in zip(alone, whole[:2]))


def test_explained_variance():
    masks = [torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0])]
    returns = [torch.tensor([5.0, 1.0, 2.0, -5.0]), torch.tensor([3.0, 4.0])]
    assert explained_variance(returns, returns, masks) == pytest.approx(1.0)
    constant = [torch.full_like(r, 2.5) for r in returns]  # the mean of the masked returns
    assert explained_variance(constant, returns, masks) == pytest.approx(0.0, abs=1e-9)
    # Errors (0, 1, -1, 0) off returns (1, 2, 3, 4): 1 - 0.5 / 1.25.
    noisy = [torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([4.0, 4.0])]
    assert explained_variance(noisy, returns, masks) == pytest.approx(1 - 0.5 / 1.25)


def test_critic_values_feed_the_same_gae_in_both_pad_modes():
    from polyfsdp.engines.config import EngineConfig, ModelConfig
    from polyfsdp.engines.engine import FSDPEngine

    pairs, masks, _, _, scores = _case(9, [2, 4, 1], [3, 1, 5])
    results = {}
    for pad_mode in ("no_padding", "left_right"):
        critic = FSDPEngine(ModelConfig(preset="qwen2-tiny", seed=1, value_head=True, value_head_init_std=0.5),
                            EngineConfig(pad_mode=pad_mode)).initialize()
        batch = build_batch(pairs, pad_mode, pad_token_id=0)
        values = per_sequence(critic.infer_values(batch)["values"], batch, pad_mode)
        assert all(v.shape == m.shape for v, m in zip(values, masks))
        adv, ret = gae_advantages(scores, masks, values, 0.9, 0.95)
        raw, exp_ret = zip(*(loop_gae(s, m, v, 0.9, 0.95) for s, m, v in zip(scores, masks, values)))
        for a, r, ea, er in zip(adv, ret, loop_whiten(raw, masks), exp_ret):
            assert torch.allclose(r.double(), er, atol=1e-6) and torch.allclose(a.double(), ea, atol=1e-5)
        results[pad_mode] = (values, adv)
    for a, b in zip(results["no_padding"][0], results["left_right"][0]):
        assert torch.allclose(a, b, atol=1e-5)

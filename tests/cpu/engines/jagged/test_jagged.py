"""polyfsdp.engines.jagged against a plain per-sequence loop reference.

Every conversion runs with two strategies: "native" (host kernels, host-validated sizes)
and "portable" (the gather path used on accelerators, with sizes treated as device-resident
and trusted once ``total`` is given), so the accelerator path is exercised on CPU too.
"""
from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polyfsdp.engines import jagged as J
from polyfsdp.engines.jagged import checks as jagged_checks
from polyfsdp.engines.jagged import kernels as jagged_kernels

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
DTYPES = (torch.int64, torch.float32, torch.bfloat16)
RESTS = ((), (3,), (2, 2))


def _host_only_kernel(*args, **kwargs):
    raise AssertionError("the portable strategy reached a host-only kernel")


def _pretend_everything_is_on_an_accelerator(monkeypatch):
    monkeypatch.setattr(jagged_checks, "on_host", lambda t: False)
    # Proof the pretence holds: a host-only kernel reached anyway fails the test.
    for name in ("_PAD_TO_JAGGED", "_JAGGED_TO_PAD", "_pack_host_rows"):
        monkeypatch.setattr(jagged_kernels, name, _host_only_kernel)


@pytest.fixture(params=["native", "portable"])
def strategy(request, monkeypatch):
    if request.param == "portable":
        _pretend_everything_is_on_an_accelerator(monkeypatch)
    return request.param


def _random(shape, dtype, gen):
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=gen)
    return torch.randn(shape, generator=gen).to(dtype)


@st.composite
def padded_batches(draw):
    B = draw(st.integers(1, 6))
    L = draw(st.integers(0, 7))
    lens = draw(st.lists(st.integers(0, L) | st.sampled_from([0, L]), min_size=B, max_size=B))
    dtype = draw(st.sampled_from(DTYPES))
    rest = draw(st.sampled_from(RESTS))
    seed = draw(st.integers(0, 2**31 - 1))
    give_total = draw(st.booleans())
    gen = torch.Generator().manual_seed(seed)
    return _random((B, L, *rest), dtype, gen), torch.tensor(lens, dtype=torch.int64), give_total


# ---------------------------------------------------------------- per-sequence loop references
def ref_values(dense, lens):
    return torch.cat([dense[i, :n] for i, n in enumerate(lens.tolist())]) if len(lens) else dense[:0, 0]


def ref_offsets(lens):
    out = [0]
    for n in lens.tolist():
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int64)


def ref_padded(seqs, L, pad, side, rest, dtype):
    out = torch.full((len(seqs), L, *rest), pad, dtype=dtype)
    for i, s in enumerate(seqs):
        n = s.shape[0]
        if n:
            if side == "right":
                out[i, :n] = s
            else:
                out[i, L - n:] = s
    return out


def ref_labels(seqs, fill):
    out = []
    for s in seqs:
        lab = torch.full_like(s, fill)
        if s.shape[0] > 1:
            lab[:-1] = s[1:]
        out.append(lab)
    return torch.cat(out)


def _total_kw(lens, give_total, strategy):
    # The portable strategy models accelerator sizes: total must come from the host.
    if give_total or strategy == "portable":
        return {"total": int(lens.sum())}
    return {}


# ---------------------------------------------------------------- properties
@SETTINGS
@given(batch=padded_batches())
def test_dense_to_jagged_matches_loop_reference_and_round_trips(strategy, batch):
    dense, lens, give_total = batch
    B, L = dense.shape[:2]
    nt = J.dense_to_jagged(dense, lens, **_total_kw(lens, give_total, strategy))
    assert nt.layout == torch.jagged and nt.shape[0] == B and nt._ragged_idx == 1
    assert torch.equal(nt.values(), ref_values(dense, lens))
    assert nt.values().is_contiguous()
    assert torch.equal(J.offsets(nt), ref_offsets(lens))
    assert torch.equal(J.lengths(nt), lens)
    if strategy == "native":
        assert (nt._min_seqlen, nt._max_seqlen) == (int(lens.min()), int(lens.max()))
    seqs = [dense[i, :n] for i, n in enumerate(lens.tolist())]
    for side in ("right", "left"):
        back = J.jagged_to_dense(nt, padding_value=7, side=side, length=L)
        assert torch.equal(back, ref_padded(seqs, L, 7, side, dense.shape[2:], dense.dtype))


@SETTINGS
@given(batch=padded_batches())
def test_dense_to_flat_with_offsets_matches_lengths_form(strategy, batch):
    dense, lens, give_total = batch
    values, offs = J.dense_to_flat(dense, offsets=ref_offsets(lens), **_total_kw(lens, give_total, strategy))
    assert torch.equal(values, ref_values(dense, lens))
    assert torch.equal(offs, ref_offsets(lens)) and offs.dtype == torch.int64
    L = dense.shape[1]
    seqs = [dense[i, :n] for i, n in enumerate(lens.tolist())]
    assert torch.equal(J.flat_to_dense(values, offs, L, padding_value=-3),
                       ref_padded(seqs, L, -3, "right", dense.shape[2:], dense.dtype))


@st.composite
def left_right_batches(draw):
    B = draw(st.integers(1, 5))
    P, R = draw(st.integers(0, 4)), draw(st.integers(0, 4))
    prompts = draw(st.lists(st.integers(0, P), min_size=B, max_size=B))
    responses = draw(st.lists(st.integers(0, R), min_size=B, max_size=B))
    dtype = draw(st.sampled_from(DTYPES))
    rest = draw(st.sampled_from(RESTS))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask = torch.zeros(B, P + R, dtype=draw(st.sampled_from([torch.int64, torch.bool, torch.float32])))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        mask[i, P - p:P + r] = 1
    return _random((B, P + R, *rest), dtype, gen), mask


@SETTINGS
@given(batch=left_right_batches())
def test_left_right_round_trip_matches_loop_reference(strategy, batch):
    dense, mask = batch
    on = mask != 0
    seqs = [dense[i][on[i]] for i in range(dense.shape[0])]
    kw = {"total": int(on.sum())} if strategy == "portable" else {}
    nt = J.left_right_to_jagged(dense, mask, **kw)
    assert torch.equal(nt.values(), torch.cat(seqs))
    assert torch.equal(J.lengths(nt), on.sum(1))
    pad = torch.full_like(dense, 5)
    keep = on.reshape(*on.shape, *([1] * (dense.dim() - 2)))
    assert torch.equal(J.jagged_to_left_right(nt, mask, padding_value=5), torch.where(keep, dense, pad))
    values, offs = J.left_right_to_flat(dense, mask, **kw)
    assert torch.equal(J.flat_to_left_right(values, offs, mask, padding_value=5), torch.where(keep, dense, pad))


@SETTINGS
@given(batch=padded_batches(), fill=st.sampled_from([J.IGNORE_INDEX, 0]))
def test_next_token_labels_never_cross_sequences(strategy, batch, fill):
    dense, lens, _ = batch
    seqs = [dense[i, :n] for i, n in enumerate(lens.tolist())]
    nt = J.dense_to_jagged(dense, lens, total=int(lens.sum()))
    labels = J.next_token_labels(nt, pad_label=fill)
    assert torch.equal(labels.values(), ref_labels(seqs, fill))
    assert torch.equal(J.offsets(labels), ref_offsets(lens))
    flat = J.next_token_labels_flat(nt.values(), J.offsets(nt), fill=fill)
    assert torch.equal(flat, ref_labels(seqs, fill))


def test_next_token_labels_default_fill_is_ignore_index():
    nt = J.make_jagged(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 3, 3, 5]))
    assert J.next_token_labels(nt).values().tolist() == [2, 3, -100, 5, -100]


def test_scalar_row_gradients_match_loop_reference(strategy):
    lens = torch.tensor([3, 0, 5, 2])
    dense = torch.randn(4, 5, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ref_dense = dense.detach().clone().requires_grad_(True)
    w = torch.arange(10.0)
    (J.dense_to_flat(dense, lens, total=10)[0] * w).sum().backward()
    (ref_values(ref_dense, lens) * w).sum().backward()
    assert torch.equal(dense.grad, ref_dense.grad)


def test_gradients_match_loop_reference(strategy):
    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([3, 0, 5, 2])
    dense = torch.randn(4, 5, 3, generator=gen, requires_grad=True)
    ref_dense = dense.detach().clone().requires_grad_(True)
    w = torch.randn(int(lens.sum()), 3, generator=gen)
    values, offs = J.dense_to_flat(dense, lens, total=10)
    (values * w).sum().backward()
    (ref_values(ref_dense, lens) * w).sum().backward()
    assert torch.equal(dense.grad, ref_dense.grad)

    flat = torch.randn(10, 3, generator=gen, requires_grad=True)
    ref_flat = flat.detach().clone().requires_grad_(True)
    wd = torch.randn(4, 6, 3, generator=gen)
    for side in ("right", "left"):
        flat.grad = ref_flat.grad = None
        (J.flat_to_dense(flat, offs, 6, side=side) * wd).sum().backward()
        seqs = torch.split(ref_flat, lens.tolist())
        out = torch.stack([torch.cat([s, s.new_zeros(6 - s.shape[0], 3)]) if side == "right"
                           else torch.cat([s.new_zeros(6 - s.shape[0], 3), s]) for s in seqs])
        (out * wd).sum().backward()
        assert torch.equal(flat.grad, ref_flat.grad)


# ---------------------------------------------------------------- edge cases
def test_all_equal_lengths_keep_ragged_dim_one_and_pad_to_max(strategy):
    dense = torch.arange(24.0).reshape(3, 4, 2)
    nt = J.dense_to_jagged(dense, torch.tensor([4, 4, 4]), total=12)
    assert nt._ragged_idx == 1 and nt.dim() == 3
    assert torch.equal(J.jagged_to_dense(nt), dense)
    nt2 = J.dense_to_jagged(dense, torch.tensor([2, 2, 2]), total=6)
    # Accelerator-resident sizes only give the bound max_seqlen <= L, so pad via the flat form.
    assert torch.equal(J.flat_to_dense(nt2.values(), J.offsets(nt2), 2), dense[:, :2])
    if strategy == "native":
        assert torch.equal(J.jagged_to_dense(nt2), dense[:, :2])


def test_single_sequence_and_empty_batch_total_zero(strategy):
    dense = torch.arange(6).reshape(1, 6)
    nt = J.dense_to_jagged(dense, torch.tensor([6]), total=6)
    assert torch.equal(nt.values(), torch.arange(6)) and nt.shape[0] == 1
    empty = J.dense_to_jagged(torch.ones(3, 4, 2), torch.tensor([0, 0, 0]), total=0)
    assert empty.values().shape == (0, 2)
    assert torch.equal(J.jagged_to_dense(empty, padding_value=-1, length=4), torch.full((3, 4, 2), -1.0))
    assert J.next_token_labels(empty).values().shape == (0, 2)


def test_without_max_seqlen_padding_would_use_total_but_ours_uses_longest():
    nt = J.make_jagged(torch.arange(15.0), torch.tensor([0, 5, 8, 15]))
    assert (nt._min_seqlen, nt._max_seqlen) == (3, 7)
    assert J.jagged_to_dense(nt).shape == (3, 7)
    assert nt.to_padded_tensor(0.0).shape == (3, 7)


def test_accelerator_sizes_with_total_are_never_read_back(monkeypatch, caplog):
    _pretend_everything_is_on_an_accelerator(monkeypatch)
    monkeypatch.setattr(jagged_checks, "_warned_sync", False)
    with caplog.at_level(logging.INFO, logger=jagged_checks.__name__):
        J.dense_to_jagged(torch.ones(2, 3), torch.tensor([1, 3]), total=4)
        J.left_right_to_jagged(torch.ones(2, 3), torch.tensor([[0, 1, 0], [1, 1, 1]]), total=4)
    assert not caplog.records
    with caplog.at_level(logging.INFO, logger=jagged_checks.__name__):
        J.dense_to_jagged(torch.ones(2, 3), torch.tensor([1, 3]))
    assert "reading it back once" in caplog.text


# ---------------------------------------------------------------- bad inputs, one per rule
@pytest.mark.parametrize(
    "offsets, message",
    [
        (torch.tensor([[0, 2, 4]]), "offsets must be 1-D"),
        (torch.tensor([0.0, 2.0, 4.0]), "offsets must have an integer dtype"),
        (torch.tensor([1, 2, 4]), r"offsets must start at 0; got offsets\[0\] = 1"),
        (torch.tensor([0, 3, 2, 4]), r"offsets must be non-decreasing; got offsets\[2\] = 2 < offsets\[1\] = 3"),
        (torch.tensor([0, 2, 3]), r"offsets must end at values.shape\[0\] = 4; got offsets\[2\] = 3"),
        (torch.tensor([0, 2, 4], device="meta"), "offsets must be on values' device"),
        (torch.tensor([], dtype=torch.int64), "offsets must have B \\+ 1 >= 1 elements"),
    ],
)
def test_make_jagged_rejects_bad_offsets_naming_rule_and_index(offsets, message):
    with pytest.raises(ValueError, match=message):
        J.make_jagged(torch.zeros(4), offsets)


def test_dense_to_jagged_rejects_length_above_L():
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, L=3\]; got lengths\[1\] = 4"):
        J.dense_to_jagged(torch.zeros(2, 3), torch.tensor([1, 4]))


def test_dense_to_jagged_rejects_negative_length():
    with pytest.raises(ValueError, match=r"got lengths\[0\] = -1"):
        J.dense_to_jagged(torch.zeros(2, 3), torch.tensor([-1, 2]))


def test_dense_to_jagged_rejects_offsets_with_a_row_longer_than_L():
    with pytest.raises(ValueError, match=r"offsets.diff\(\) must lie in \[0, L=3\]; got offsets.diff\(\)\[0\] = 5"):
        J.dense_to_jagged(torch.zeros(2, 3), offsets=torch.tensor([0, 5, 6]))


def test_dense_to_jagged_rejects_offsets_passed_as_lengths_with_hint():
    with pytest.raises(ValueError, match="lengths must have B = 2 elements; got 3 \\(to pass offsets use offsets=\\)"):
        J.dense_to_jagged(torch.zeros(2, 3), torch.tensor([0, 1, 3]))


def test_dense_to_jagged_needs_exactly_one_size_argument():
    with pytest.raises(ValueError, match="exactly one of lengths"):
        J.dense_to_jagged(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="exactly one of lengths"):
        J.dense_to_jagged(torch.zeros(2, 3), torch.tensor([1, 2]), offsets=torch.tensor([0, 1, 3]))


def test_dense_to_jagged_rejects_total_that_disagrees_with_lengths():
    with pytest.raises(ValueError, match="total must equal the sum of lengths = 3; got total=4"):
        J.dense_to_jagged(torch.zeros(2, 3), torch.tensor([1, 2]), total=4)
    with pytest.raises(ValueError, match="total must be a non-negative int; got -1"):
        J.dense_to_jagged(torch.zeros(2, 3), torch.tensor([1, 2]), total=-1)


def test_dense_to_jagged_rejects_float_lengths_and_non_batched_dense():
    with pytest.raises(ValueError, match="lengths must have an integer dtype; got torch.float32"):
        J.dense_to_jagged(torch.zeros(2, 3), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"dense must have shape \(B, L, \*rest\); got shape \(3,\)"):
        J.dense_to_jagged(torch.zeros(3), torch.tensor([1]))


def test_jagged_to_dense_rejects_bad_side_short_length_and_dense_input():
    nt = J.make_jagged(torch.zeros(5), torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="side must be one of \\('right', 'left'\\); got 'middle'"):
        J.jagged_to_dense(nt, side="middle")
    with pytest.raises(ValueError, match="length must be an int >= the longest sequence \\(3\\); got 2"):
        J.jagged_to_dense(nt, length=2)
    with pytest.raises(TypeError, match="must be a jagged nested tensor"):
        J.jagged_to_dense(torch.zeros(2, 3))


def test_flat_to_dense_rejects_sequence_longer_than_max_len():
    with pytest.raises(ValueError, match=r"offsets.diff\(\) must lie in \[0, L=2\]; got offsets.diff\(\)\[1\] = 3"):
        J.flat_to_dense(torch.zeros(5), torch.tensor([0, 2, 5]), 2)


def test_left_right_rejects_mask_values_other_than_zero_and_one():
    with pytest.raises(ValueError, match=r"attention_mask must hold only 0 and 1; got attention_mask\[1, 2\] = 2"):
        J.left_right_to_jagged(torch.zeros(2, 3), torch.tensor([[0, 1, 1], [1, 1, 2]]))


def test_left_right_rejects_mask_with_a_hole():
    with pytest.raises(ValueError, match="row 1 has 2 runs"):
        J.left_right_to_jagged(torch.zeros(2, 4), torch.tensor([[0, 1, 1, 0], [1, 0, 1, 0]]))


def test_left_right_rejects_mask_of_wrong_shape():
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(B, L\) = \(2, 3\)"):
        J.left_right_to_jagged(torch.zeros(2, 3), torch.ones(2, 4))


def test_jagged_to_left_right_rejects_lengths_that_disagree_with_mask():
    nt = J.make_jagged(torch.zeros(4), torch.tensor([0, 1, 4]))
    with pytest.raises(ValueError, match="sequence 0 has 1 tokens but attention_mask row 0 has 2 ones"):
        J.jagged_to_left_right(nt, torch.tensor([[0, 1, 1], [1, 1, 0]]))

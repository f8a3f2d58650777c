"""flashtriton.bert_padding against docs/api.md §9.1, with plain Python loops as the reference."""

import pytest
import torch
from torch.autograd import gradcheck

from flashtriton import bert_padding as bp
from flashtriton.bert_padding import (
    IndexFirstAxis,
    IndexFirstAxisResidual,
    IndexPutFirstAxis,
    index_first_axis,
    index_first_axis_residual,
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MASK_DTYPES = [torch.bool, torch.int32, torch.int64, torch.uint8]


def _random_mask(batch, seqlen, dtype, device, p=0.6):
    return (torch.rand(batch, seqlen, device=device) < p).to(dtype)


def _loop_unpad_reference(attention_mask, unused_mask=None):
    """(indices, cu_seqlens, max_seqlen, seqused) as Python lists/ints, one token at a time."""
    batch, seqlen = attention_mask.shape
    am = attention_mask.cpu().tolist()
    um = unused_mask.cpu().tolist() if unused_mask is not None else [[0] * seqlen for _ in range(batch)]
    indices, cu_seqlens, seqused = [], [0], []
    for b in range(batch):
        count = 0
        for s in range(seqlen):
            if am[b][s] or um[b][s]:
                indices.append(b * seqlen + s)
                count += 1
        cu_seqlens.append(cu_seqlens[-1] + count)
        seqused.append(sum(1 for s in range(seqlen) if am[b][s]))
    lengths = [cu_seqlens[b + 1] - cu_seqlens[b] for b in range(batch)]
    return indices, cu_seqlens, max(lengths, default=0), seqused


def _loop_concat_reference(attention_mask_in_length):
    """(indices, cu_seqlens, max_seqlen) for packed rows, one sequence at a time."""
    batch, seqlen = attention_mask_in_length.shape
    indices, cu_seqlens, max_seqlen = [], [0], 0
    for b, row in enumerate(attention_mask_in_length.cpu().tolist()):
        start = 0
        for length in row:
            if length == 0:
                continue
            indices.extend(b * seqlen + start + i for i in range(length))
            cu_seqlens.append(cu_seqlens[-1] + length)
            max_seqlen = max(max_seqlen, length)
            start += length
    return indices, cu_seqlens, max_seqlen


def _check_unpad_outputs(out, x, attention_mask, unused_mask=None):
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = out
    ref_indices, ref_cu, ref_max, ref_used = _loop_unpad_reference(attention_mask, unused_mask)
    assert indices.dtype == torch.int64 and indices.device == x.device
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.device == x.device
    assert seqused.dtype == torch.int32 and seqused.device == x.device
    assert type(max_seqlen) is int
    assert indices.tolist() == ref_indices
    assert cu_seqlens.tolist() == ref_cu
    assert max_seqlen == ref_max
    assert seqused.tolist() == ref_used
    assert x_unpad.dtype == x.dtype and x_unpad.device == x.device
    assert x_unpad.shape == (len(ref_indices), *x.shape[2:])
    torch.testing.assert_close(x_unpad, x.flatten(0, 1)[torch.tensor(ref_indices, dtype=torch.long, device=x.device)],
                               rtol=0, atol=0)


# ----------------------------------------------------------------------------------------- unpad_input / pad_input


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_dtype", MASK_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 4), (3, 7, 5), (4, 113, 2, 3), (2, 16, 3, 2, 2)], ids=str)
def test_unpad_pad_round_trip(shape, mask_dtype, device):
    x = torch.randn(shape, device=device)
    mask = _random_mask(shape[0], shape[1], mask_dtype, device)
    out = unpad_input(x, mask)
    assert len(out) == 5
    _check_unpad_outputs(out, x, mask)
    x_unpad, indices = out[0], out[1]
    padded = pad_input(x_unpad, indices, shape[0], shape[1])
    expected = x * mask.view(*mask.shape, *([1] * (x.ndim - 2))).to(x.dtype)
    assert padded.shape == x.shape and padded.dtype == x.dtype and padded.device == x.device
    torch.testing.assert_close(padded, expected, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_unpad_preserves_dtype(dtype, device):
    x = torch.randn(3, 9, 2, 4, device=device).to(dtype)
    mask = _random_mask(3, 9, torch.bool, device)
    x_unpad, indices, *_ = unpad_input(x, mask)
    assert x_unpad.dtype == dtype
    padded = pad_input(x_unpad, indices, 3, 9)
    assert padded.dtype == dtype
    torch.testing.assert_close(padded, x * mask[..., None, None].to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_unpad_nonbinary_int_mask_means_nonzero(device):
    x = torch.randn(2, 5, 3, device=device)
    mask = torch.tensor([[3, 0, -1, 1, 0], [0, 0, 0, 0, 7]], device=device)
    _check_unpad_outputs(unpad_input(x, mask), x, mask)
    _, _, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask)
    assert cu_seqlens.tolist() == [0, 3, 4] and max_seqlen == 3 and seqused.tolist() == [3, 1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64], ids=str)
def test_unpad_all_zero_and_full_rows(mask_dtype, device):
    batch, seqlen = 4, 6
    x = torch.randn(batch, seqlen, 3, device=device)
    mask = torch.tensor([[0] * 6, [1] * 6, [1, 1, 0, 0, 0, 0], [0] * 6], device=device).to(mask_dtype)
    out = unpad_input(x, mask)
    _check_unpad_outputs(out, x, mask)
    assert out[2].tolist() == [0, 0, 6, 8, 8]
    assert out[3] == 6
    assert out[4].tolist() == [0, 6, 2, 0]
    torch.testing.assert_close(pad_input(out[0], out[1], batch, seqlen), x * mask[..., None].to(x.dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_unpad_all_masked_and_all_valid(device):
    x = torch.randn(3, 5, 2, device=device)
    none = torch.zeros(3, 5, dtype=torch.bool, device=device)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, none)
    assert x_unpad.shape == (0, 2) and indices.numel() == 0
    assert cu_seqlens.tolist() == [0, 0, 0, 0] and max_seqlen == 0 and seqused.tolist() == [0, 0, 0]
    torch.testing.assert_close(pad_input(x_unpad, indices, 3, 5), torch.zeros_like(x))

    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, ~none)
    torch.testing.assert_close(x_unpad, x.flatten(0, 1), rtol=0, atol=0)
    assert indices.tolist() == list(range(15))
    assert cu_seqlens.tolist() == [0, 5, 10, 15] and max_seqlen == 5 and seqused.tolist() == [5, 5, 5]


@pytest.mark.parametrize("device", DEVICES)
def test_unpad_empty_batch(device):
    x = torch.randn(0, 4, 2, device=device)
    empty_mask = torch.zeros(0, 4, dtype=torch.bool, device=device)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, empty_mask)
    assert x_unpad.shape == (0, 2) and indices.shape == (0,) and seqused.shape == (0,)
    assert cu_seqlens.tolist() == [0] and max_seqlen == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_dtype", MASK_DTYPES, ids=str)
def test_unpad_unused_mask(mask_dtype, device):
    # Row 0: 3 used + 2 unused; row 1: all used; row 2: 0 used + 2 unused; row 3: nothing.
    attention_mask = torch.tensor(
        [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], device=device
    ).to(mask_dtype)
    unused_mask = torch.tensor(
        [[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], device=device
    ).to(mask_dtype)
    x = torch.randn(4, 6, 2, 3, device=device)
    out = unpad_input(x, attention_mask, unused_mask)
    _check_unpad_outputs(out, x, attention_mask, unused_mask)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = out
    assert cu_seqlens.tolist() == [0, 5, 11, 13, 13]
    assert max_seqlen == 6
    assert seqused.tolist() == [3, 6, 0, 0]
    selected = (attention_mask != 0) | (unused_mask != 0)
    torch.testing.assert_close(pad_input(x_unpad, indices, 4, 6), x * selected[..., None, None].to(x.dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_unpad_unused_mask_random_and_overlap(device):
    batch, seqlen = 5, 17
    attention_mask = _random_mask(batch, seqlen, torch.int32, device, p=0.5)
    unused_mask = _random_mask(batch, seqlen, torch.int32, device, p=0.3)  # overlaps attention_mask
    x = torch.randn(batch, seqlen, 4, device=device)
    _check_unpad_outputs(unpad_input(x, attention_mask, unused_mask), x, attention_mask, unused_mask)
    # None is the same as an all-zero unused_mask.
    a = unpad_input(x, attention_mask)
    b = unpad_input(x, attention_mask, torch.zeros_like(attention_mask))
    for ta, tb in zip(a, b):
        assert (ta == tb).all() if torch.is_tensor(ta) else ta == tb


@pytest.mark.parametrize("device", DEVICES)
def test_unpad_random_stats_vs_loop(device):
    for batch, seqlen in [(1, 1), (2, 3), (7, 31), (16, 128)]:
        for p in (0.0, 0.2, 0.9, 1.0):
            mask = _random_mask(batch, seqlen, torch.bool, device, p=p)
            x = torch.randn(batch, seqlen, 3, device=device)
            _check_unpad_outputs(unpad_input(x, mask), x, mask)


@pytest.mark.parametrize("device", DEVICES)
def test_unpad_noncontiguous_hidden_states(device):
    base = torch.randn(6, 4, 10, 3, device=device)
    x = base.transpose(0, 1)[:, :, ::2]  # (4, 6, 5, 3), not contiguous
    mask = _random_mask(4, 6, torch.bool, device)
    out = unpad_input(x, mask)
    _check_unpad_outputs(out, x, mask)
    torch.testing.assert_close(pad_input(out[0], out[1], 4, 6), x * mask[..., None, None].to(x.dtype))


def test_unpad_shape_mismatch_raises():
    x = torch.randn(2, 5, 3)
    with pytest.raises(ValueError, match="attention_mask"):
        unpad_input(x, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="unused_mask"):
        unpad_input(x, torch.ones(2, 5, dtype=torch.bool), torch.ones(5, 2, dtype=torch.bool))


def test_unpad_input_gradient():
    x = torch.randn(3, 5, 2, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert gradcheck(lambda t: unpad_input(t, mask)[0], (x,))
    x_unpad = unpad_input(x, mask)[0]
    x_unpad.sum().backward()
    torch.testing.assert_close(x.grad, mask[..., None].expand_as(x).to(x.dtype))


# --------------------------------------------------------------------------------------------- index functions


def test_functions_are_autograd_apply():
    assert index_first_axis == IndexFirstAxis.apply
    assert index_put_first_axis == IndexPutFirstAxis.apply
    assert index_first_axis_residual == IndexFirstAxisResidual.apply
    for cls in (IndexFirstAxis, IndexPutFirstAxis, IndexFirstAxisResidual):
        assert issubclass(cls, torch.autograd.Function)
    for name in ("unpad_input", "pad_input", "index_first_axis", "index_put_first_axis", "index_first_axis_residual",
                 "unpad_input_for_concatenated_sequences", "IndexFirstAxis", "IndexPutFirstAxis",
                 "IndexFirstAxisResidual"):
        assert name in bp.__all__ and hasattr(bp, name)
    # Positional calls, as upstream callers write them.
    x = torch.randn(5, 3, requires_grad=True)
    idx = torch.tensor([4, 0, 2])
    out = index_first_axis(x, idx)
    assert out.grad_fn is not None and type(out.grad_fn).__name__.startswith("IndexFirstAxis")
    torch.testing.assert_close(out, x[idx].detach())
    put = index_put_first_axis(out, idx, 5)
    assert put.shape == (5, 3)
    gathered, residual = index_first_axis_residual(x, idx)
    assert gathered.shape == (3, 3) and residual.shape == (5, 3)


@pytest.mark.parametrize("bad", [torch.randn(6), torch.tensor(1.0)], ids=["1d", "0d"])
def test_index_first_axis_asserts_ndim(bad):
    with pytest.raises(AssertionError, match="ndim >= 2"):
        index_first_axis(bad, torch.tensor([0]))
    with pytest.raises(AssertionError, match="ndim >= 2"):
        index_first_axis_residual(bad, torch.tensor([0]))


def test_index_put_first_axis_asserts_1d_indices():
    with pytest.raises(AssertionError, match="1-D"):
        index_put_first_axis(torch.randn(2, 3), torch.tensor([[0, 1]]), 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
def test_index_first_axis_forward_backward(index_dtype, device):
    x = torch.randn(7, 2, 3, device=device, requires_grad=True)
    idx = torch.tensor([6, 1, 3], device=device, dtype=index_dtype)
    out = index_first_axis(x, idx)
    assert out.shape == (3, 2, 3) and out.is_contiguous()
    torch.testing.assert_close(out, x.detach()[idx.long()], rtol=0, atol=0)
    g = torch.randn_like(out)
    out.backward(g)
    expected = torch.zeros_like(x)
    expected[idx.long()] = g
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.bool, torch.complex64],
    ids=str,
)
@pytest.mark.parametrize("trailing", [(), (1,), (3,), (5, 3), (2, 4), (64,)], ids=str)
def test_scatter_rows_every_dtype_and_width(trailing, dtype, device):
    # Rows are reinterpreted as wider integers when their byte size allows; values must come back bit-exact.
    nnz, n = 5, 9
    values = (torch.randn(nnz, *trailing, device=device) * 10).to(dtype)
    idx = torch.tensor([7, 0, 3, 8, 4], device=device)
    out = index_put_first_axis(values, idx, n)
    expected = torch.zeros(n, *trailing, dtype=dtype, device=device)
    expected[idx] = values
    assert out.dtype == dtype and out.shape == expected.shape
    assert torch.equal(out, expected)
    if values.ndim >= 2:
        assert torch.equal(index_first_axis(out, idx), values)


def test_wide_rows_dtype_choice():
    def chosen(t):
        return bp._as_wide_rows(t)[0].dtype

    assert chosen(torch.zeros(3, 2, 64, dtype=torch.bfloat16)) == torch.int64
    assert chosen(torch.zeros(3, 6, dtype=torch.float16)) == torch.int32  # 12-byte rows
    assert chosen(torch.zeros(3, 3, dtype=torch.int8)) == torch.int8  # 3-byte rows stay as they are
    assert chosen(torch.zeros(3, 2, dtype=torch.float64)) == torch.float64  # nothing wider than 8 bytes
    # A view stays a view: writes through the wide rows land in the original tensor.
    t = torch.zeros(2, 4, dtype=torch.bfloat16)
    bp._as_wide_rows(t)[0].fill_(-1)
    assert torch.isnan(t).all()


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_rows_from_strided_and_offset_views(device):
    idx = torch.tensor([1, 4, 2], device=device)
    base = torch.randn(4, 3, 10, device=device, dtype=torch.bfloat16)
    for values in (base[1:, 0, 1:9],  # storage offset of 1 element: not 8-byte aligned
                   base[:3, :, ::2],  # strided rows
                   base[1:, :, 1:].transpose(1, 2)):  # transposed trailing dims
        out = pad_input(values, idx, 2, 3)
        expected = torch.zeros(6, *values.shape[1:], dtype=values.dtype, device=device)
        expected[idx] = values
        assert torch.equal(out, expected.view(2, 3, *values.shape[1:]))


@pytest.mark.parametrize("trailing", [(3,), (2, 3)], ids=str)
def test_gradcheck_index_first_axis(trailing):
    x = torch.randn(6, *trailing, dtype=torch.float64, requires_grad=True)
    assert gradcheck(index_first_axis, (x, torch.tensor([5, 0, 2])))
    assert gradcheck(index_first_axis, (x, torch.tensor([], dtype=torch.long)))


@pytest.mark.parametrize("trailing", [(), (3,), (2, 3)], ids=str)
def test_gradcheck_index_put_first_axis(trailing):
    values = torch.randn(3, *trailing, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([4, 0, 2])
    assert gradcheck(index_put_first_axis, (values, idx, 6))
    out = index_put_first_axis(values, idx, 6)
    expected = torch.zeros(6, *trailing, dtype=torch.float64)
    expected[idx] = values.detach()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_gradcheck_pad_input():
    values = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([0, 1, 5, 7])  # batch 2, seqlen 4
    assert gradcheck(lambda v: pad_input(v, idx, 2, 4), (values,))
    padded = pad_input(values, idx, 2, 4)
    assert padded.shape == (2, 4, 2, 3)
    g = torch.randn_like(padded)
    padded.backward(g)
    torch.testing.assert_close(values.grad, g.flatten(0, 1)[idx], rtol=0, atol=0)


def test_index_first_axis_residual_values_and_gradcheck():
    x = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([5, 0, 2])
    gathered, residual = index_first_axis_residual(x, idx)
    torch.testing.assert_close(gathered, x.detach()[idx], rtol=0, atol=0)
    torch.testing.assert_close(residual, x.detach(), rtol=0, atol=0)
    assert residual.requires_grad and gathered.requires_grad
    assert gradcheck(index_first_axis_residual, (x, idx))
    # Each output alone, the other's grad being zeros.
    assert gradcheck(lambda t: index_first_axis_residual(t, idx)[0], (x,))
    assert gradcheck(lambda t: index_first_axis_residual(t, idx)[1], (x,))
    # Backward adds the gathered rows' grad into the residual's grad.
    x.grad = None
    gathered, residual = index_first_axis_residual(x, idx)
    g_gathered, g_residual = torch.randn_like(gathered), torch.randn_like(residual)
    g_residual_copy = g_residual.clone()
    torch.autograd.backward([gathered, residual], [g_gathered, g_residual])
    expected = g_residual_copy.clone()
    expected[idx] += g_gathered
    torch.testing.assert_close(x.grad, expected)
    torch.testing.assert_close(g_residual, g_residual_copy, rtol=0, atol=0)  # incoming grad left untouched


# ---------------------------------------------------------------------------- unpad_input_for_concatenated_sequences


@pytest.mark.parametrize("device", DEVICES)
def test_concatenated_hand_made(device):
    x = torch.arange(2 * 6 * 2, dtype=torch.float32, device=device).view(2, 6, 2)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], device=device)
    x_unpad, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert indices.tolist() == [0, 1, 2, 3, 4]
    assert cu_seqlens.tolist() == [0, 2, 5]
    assert max_seqlen == 3 and type(max_seqlen) is int
    torch.testing.assert_close(x_unpad, x[0, :5], rtol=0, atol=0)
    assert indices.dtype == torch.int64 and cu_seqlens.dtype == torch.int32
    assert {t.device for t in (x_unpad, indices, cu_seqlens)} == {x.device}


@pytest.mark.parametrize("device", DEVICES)
def test_concatenated_two_rows_and_full_row(device):
    x = torch.randn(3, 4, 3, device=device)
    lengths = torch.tensor([[1, 1, 2, 0], [4, 0, 0, 0], [3, 0, 0, 0]], dtype=torch.int32, device=device)
    x_unpad, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert indices.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert cu_seqlens.tolist() == [0, 1, 2, 4, 8, 11]
    assert max_seqlen == 4
    torch.testing.assert_close(x_unpad, x.flatten(0, 1)[:11], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_dtype", [torch.int32, torch.int64], ids=str)
def test_concatenated_random_vs_loop(mask_dtype, device):
    gen = torch.Generator().manual_seed(1)
    for batch, seqlen in [(1, 1), (3, 8), (5, 37), (8, 64)]:
        rows = []
        for _ in range(batch):
            budget = int(torch.randint(0, seqlen + 1, (1,), generator=gen))
            row = []
            while budget > 0:
                length = int(torch.randint(1, budget + 1, (1,), generator=gen))
                row.append(length)
                budget -= length
            rows.append(row + [0] * (seqlen - len(row)))
        lengths = torch.tensor(rows, dtype=mask_dtype, device=device)
        x = torch.randn(batch, seqlen, 2, 3, device=device)
        x_unpad, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
        ref_indices, ref_cu, ref_max = _loop_concat_reference(lengths)
        assert indices.tolist() == ref_indices
        assert cu_seqlens.tolist() == ref_cu
        assert max_seqlen == ref_max
        torch.testing.assert_close(
            x_unpad, x.flatten(0, 1)[torch.tensor(ref_indices, dtype=torch.long, device=device)], rtol=0, atol=0
        )


def test_concatenated_interior_zeros_are_skipped():
    lengths = torch.tensor([[2, 0, 1, 0, 0]])
    x = torch.randn(1, 5, 2)
    _, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert indices.tolist() == [0, 1, 2] and cu_seqlens.tolist() == [0, 2, 3] and max_seqlen == 2


def test_concatenated_all_zero_and_gradient():
    x = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)
    no_sequences = torch.zeros(2, 3, dtype=torch.long)
    x_unpad, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, no_sequences)
    assert x_unpad.shape == (0, 2) and indices.numel() == 0 and cu_seqlens.tolist() == [0] and max_seqlen == 0
    lengths = torch.tensor([[1, 2, 0], [2, 0, 0]])
    assert gradcheck(lambda t: unpad_input_for_concatenated_sequences(t, lengths)[0], (x,))


def test_concatenated_invalid_lengths_raise():
    x = torch.randn(1, 4, 2)
    with pytest.raises(ValueError, match="seqlen=4"):
        unpad_input_for_concatenated_sequences(x, torch.tensor([[3, 2, 0, 0]]))
    with pytest.raises(ValueError, match="non-negative"):
        unpad_input_for_concatenated_sequences(x, torch.tensor([[3, -1, 0, 0]]))
    with pytest.raises(ValueError, match="attention_mask_in_length"):
        unpad_input_for_concatenated_sequences(x, torch.tensor([[1, 0, 0]]))

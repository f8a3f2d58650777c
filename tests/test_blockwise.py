"""The low-level _flash_attn_backward / _flash_attn_varlen_backward (docs/api.md §7) on blocks of a longer sequence,
as ring attention calls them: out and softmax_lse come from the whole sequence, each block's backward runs with
them, and the blocks' gradients add up to the whole's (dq summed over key blocks, dk / dv of a key block the
whole's slice). Every CPU path runs: the Triton kernels under the interpreter (TRITON_INTERPRET=1) and the
reference path. Each result is also compared with the float64 reference."""

import pytest
import torch

from flashtriton.flash_attn_interface import (_flash_attn_backward, _flash_attn_forward, _flash_attn_varlen_backward,
                                              _flash_attn_varlen_forward)
from flashtriton.ops import backend
from flashtriton.testing import (Case, assert_checks_ok, compare_varlen_with_reference, compare_with_reference,
                                 cu_seqlens, make_case_inputs, poisoned_outputs)


@pytest.fixture(params=["interpreter", "reference"])
def cpu_path(request, monkeypatch):
    """The CPU path the low-level functions take: the interpreted Triton kernels or the reference path."""
    if request.param == "interpreter" and not backend.KERNELS_INTERPRETED:
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1")
    if request.param == "reference":
        monkeypatch.setattr(backend, "KERNELS_INTERPRETED", False)
    return request.param


def nan_like(tensor):
    return torch.full_like(tensor, float("nan"))


def dense_backward(dout, q, k, v, out, lse, scale, causal, softcap):
    """(dq, dk, dv) of one _flash_attn_backward call into NaN-filled buffers."""
    dq, dk, dv = nan_like(q), nan_like(k), nan_like(v)
    _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal, -1, -1, softcap, None, False, None)
    return dq, dk, dv


DENSE_CASES = {
    # key blocks against every query: dk / dv of a block are the whole's slice, dq the sum over blocks
    "key-blocks-gqa": (Case(batch=2, seqlen_q=24, seqlen_k=24, num_heads=4, num_heads_k=2, head_dim=16), 1),
    # causal tiles as ring attention runs them: the diagonal tile causal, tiles below it full, above it skipped
    "causal-tiles-softcap": (Case(batch=1, seqlen_q=24, seqlen_k=24, num_heads=2, num_heads_k=2, head_dim=16,
                                  causal=True, softcap=4.0), 3),
}


@pytest.mark.parametrize("name", DENSE_CASES)
def test_dense_blocks_add_up_to_the_whole(cpu_path, name):
    case, query_blocks = DENSE_CASES[name]
    blocks, size = 3, case.seqlen_k // 3
    q, k, v, _ = make_case_inputs(case)
    dout = torch.randn_like(q)
    scale = case.head_dim ** -0.5
    with poisoned_outputs():
        out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, scale, case.causal, -1, -1, case.softcap, None, False)
        whole = dense_backward(dout, q, k, v, out, lse, scale, case.causal, case.softcap)
        sums = [torch.zeros(t.shape, dtype=torch.float32) for t in (q, k, v)]
        query_rows = [slice(i * case.seqlen_q // query_blocks, (i + 1) * case.seqlen_q // query_blocks)
                      for i in range(query_blocks)]
        for i, rows_q in enumerate(query_rows):
            for j in range(blocks):
                rows_k = slice(j * size, (j + 1) * size)
                if case.causal and j > i:
                    continue
                grads = dense_backward(dout[:, rows_q], q[:, rows_q], k[:, rows_k], v[:, rows_k], out[:, rows_q],
                                       lse[:, :, rows_q], scale, case.causal and i == j, case.softcap)
                for total, grad, rows in zip(sums, grads, (rows_q, rows_k, rows_k)):
                    total[:, rows] += grad.float()
    for grad_name, total, full in zip(("dq", "dk", "dv"), sums, whole):
        torch.testing.assert_close(total, full.float(), atol=2e-3, rtol=2e-3, msg=lambda m: f"{grad_name}: {m}")
    blockwise = [total.to(q.dtype) for total in sums]
    assert_checks_ok(compare_with_reference(case, out, lse, q, k, v, None, blockwise, dout), f"{cpu_path} {name}")


def test_varlen_key_blocks_add_up_to_the_whole(cpu_path):
    lengths = [10, 14]
    halves = [[n // 2 for n in lengths], [n - n // 2 for n in lengths]]
    total, num_heads, num_heads_k, head_dim = sum(lengths), 4, 2, 16
    q = torch.randn(total, num_heads, head_dim).half()
    k = torch.randn(total, num_heads_k, head_dim).half()
    v = torch.randn(total, num_heads_k, head_dim).half()
    dout = torch.randn_like(q)
    cu = cu_seqlens(lengths)
    scale = head_dim ** -0.5
    starts = cu[:-1].tolist()
    # rows of k of each half: the first half of every sequence's keys, then the second half
    block_rows = [torch.cat([torch.arange(s, s + n) for s, n in zip(starts, halves[0])]),
                  torch.cat([torch.arange(s + a, s + a + n) for s, a, n in zip(starts, halves[0], halves[1])])]

    def backward(k_, v_, cu_k, max_k):
        dq, dk, dv = nan_like(q), nan_like(k_), nan_like(v_)
        _flash_attn_varlen_backward(dout, q, k_, v_, out, lse, dq, dk, dv, cu, cu_k, max(lengths), max_k, 0.0, scale,
                                    False, -1, -1, 0.0, None, False, None)
        return dq, dk, dv

    with poisoned_outputs():
        out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu, cu, max(lengths), max(lengths), 0.0, scale, False)
        whole = backward(k, v, cu, max(lengths))
        dq = torch.zeros(q.shape, dtype=torch.float32)
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        for rows, half in zip(block_rows, halves):
            block_dq, block_dk, block_dv = backward(k[rows], v[rows], cu_seqlens(half), max(half))
            dq += block_dq.float()
            dk[rows], dv[rows] = block_dk, block_dv
    for name, blockwise, full in zip(("dq", "dk", "dv"), (dq, dk, dv), whole):
        torch.testing.assert_close(blockwise.float(), full.float(), atol=2e-3, rtol=2e-3,
                                   msg=lambda m: f"{name}: {m}")
    assert_checks_ok(compare_varlen_with_reference(out, lse, q, k, v, cu, cu, max(lengths), (dq.half(), dk, dv), dout),
                     cpu_path)

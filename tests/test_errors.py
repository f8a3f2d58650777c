"""Argument validation of the dense API (docs/api.md §6, with §2.4, §4.3, §4.7): every error is raised with the
documented type and message BEFORE anything is launched. An autouse fixture replaces the Triton launchers and
the CPU reference path with functions that raise AssertionError("launched"), so a check that comes too late
(or is missing) surfaces as "launched" instead of the expected error."""

import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch

import flashtriton as flash_attn
import flashtriton.flash_attn_interface as fai
from flashtriton.ops import backend, reference_path
from flashtriton.testing import cu_seqlens

B, S, H, HK, D = 2, 8, 4, 2, 16
FP16 = torch.float16


def _launched(*args, **kwargs):
    raise AssertionError("launched")


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    for name in ("launch_fwd", "launch_bwd"):
        monkeypatch.setattr(backend, name, _launched)
    for name in ("dense_forward", "dense_backward", "varlen_forward", "varlen_backward", "kvcache_forward"):
        monkeypatch.setattr(reference_path, name, _launched)


def _tensor(*shape, dtype=FP16, device="cpu"):
    return torch.randn(*shape, dtype=torch.float32).to(dtype=dtype, device=device)


def _strided_slopes(*shape):
    return torch.rand(*shape[:-1], 2 * shape[-1])[..., ::2]


def test_valid_forward_reaches_the_patched_launcher():
    with pytest.raises(AssertionError, match="launched"):
        flash_attn.flash_attn_func(_tensor(B, S, H, D), _tensor(B, S, HK, D), _tensor(B, S, HK, D))


def test_valid_backward_reaches_the_patched_launcher():
    q, k, v = _tensor(B, S, H, D), _tensor(B, S, HK, D), _tensor(B, S, HK, D)
    with pytest.raises(AssertionError, match="launched"):
        fai._flash_attn_backward(*_backward_args(q, k, v))


# ------------------------------------------------------------------------------------------------------------
# Forward, through flash_attn_func
# ------------------------------------------------------------------------------------------------------------


def _q(batch=B, seqlen=S, heads=H, dim=D, dtype=FP16, device="cpu"):
    return lambda: _tensor(batch, seqlen, heads, dim, dtype=dtype, device=device)


def _kv(batch=B, seqlen=S, heads=HK, dim=D, dtype=FP16, device="cpu"):
    return lambda: _tensor(batch, seqlen, heads, dim, dtype=dtype, device=device)


@dataclass(frozen=True)
class Bad:
    """flash_attn_func(q(), k(), v(), **options) must raise RuntimeError matching `message`."""

    q: Callable = _q()
    k: Callable = _kv()
    v: Callable = _kv()
    options: dict = field(default_factory=dict)
    message: Optional[str] = None  # None: any message (docs/api.md §6 asks for a generic RuntimeError)


KV_SHAPE = "(batch_size, seqlen_k, num_heads_k, head_size)"
V_SHAPE = "(batch_size, seqlen_k, num_heads_k, head_size_v)"
GQA_MESSAGE = ("Number of heads in key/value must divide number of heads in query, got num_heads_k = 3 (k's heads) "
               "and num_heads = 4 (q's heads)")

FORWARD_CASES = {
    # §2.2 / §6: dtypes
    "q-fp32": Bad(q=_q(dtype=torch.float32), k=_kv(dtype=torch.float32), v=_kv(dtype=torch.float32),
                  message="FlashAttention only support fp16 and bf16 data type"),
    "q-fp64-kv-fp16": Bad(q=_q(dtype=torch.float64), message="FlashAttention only support fp16 and bf16 data type"),
    "k-bf16": Bad(k=_kv(dtype=torch.bfloat16), message="query and key must have the same dtype"),
    "v-bf16": Bad(v=_kv(dtype=torch.bfloat16), message="query and value must have the same dtype"),
    # §6: batch size
    "batch-0": Bad(q=_q(batch=0), k=_kv(batch=0), v=_kv(batch=0), message="batch size must be positive"),
    # §2.4: head dimension
    "head-dim-513": Bad(q=_q(dim=513), k=_kv(dim=513), v=_kv(dim=513),
                        message="FlashAttention forward only supports head dimension at most 512"),
    "head-dim-0": Bad(q=_q(dim=0), k=_kv(dim=0), v=_kv(dim=0), message="head dimension must be at least 1, got 0"),
    # §2.4: V's head dim may differ from q's, within the same range
    "v-head-dim-513": Bad(v=_kv(dim=513),
                          message="FlashAttention forward only supports head dimension at most 512, got 513 for v"),
    "v-head-dim-0": Bad(v=_kv(dim=0), message="head dimension of v must be at least 1, got 0"),
    # §2.5: GQA divisibility, with both head counts
    "heads-4-over-3": Bad(k=_kv(heads=3), v=_kv(heads=3), message=GQA_MESSAGE),
    "heads-4-over-0": Bad(k=_kv(heads=0), v=_kv(heads=0),
                          message="got num_heads_k = 0 (k's heads) and num_heads = 4 (q's heads)"),
    # §6: shapes
    "k-batch": Bad(k=_kv(batch=B + 1), message=f"k must have shape {KV_SHAPE}"),
    "k-head-dim": Bad(k=_kv(dim=D // 2), message=f"k must have shape {KV_SHAPE}"),
    "k-3d": Bad(k=lambda: _tensor(B, S, HK * D), message=f"k must have shape {KV_SHAPE}"),
    "v-seqlen": Bad(v=_kv(seqlen=S + 1), message=f"v must have shape {V_SHAPE}"),
    "v-heads": Bad(v=_kv(heads=H), message=f"v must have shape {V_SHAPE}"),
    # §4.3 / §4.7: softcap and dropout
    "softcap-with-dropout": Bad(options=dict(softcap=5.0, dropout_p=0.1),
                                message="Softcapping does not support dropout for now"),
    "dropout-1": Bad(options=dict(dropout_p=1.0)),
    "dropout-1.5": Bad(options=dict(dropout_p=1.5)),
    "dropout-negative": Bad(options=dict(dropout_p=-0.1)),
    # §4.4 / §6: ALiBi slopes
    "alibi-fp16": Bad(options=dict(alibi_slopes=torch.rand(H).half()), message="ALiBi slopes must have dtype fp32"),
    "alibi-fp64": Bad(options=dict(alibi_slopes=torch.rand(B, H).double()),
                      message="ALiBi slopes must have dtype fp32"),
    "alibi-strided": Bad(options=dict(alibi_slopes=_strided_slopes(H)),
                         message="ALiBi slopes tensor must have contiguous last dimension"),
    "alibi-batch-strided": Bad(options=dict(alibi_slopes=_strided_slopes(B, H)),
                               message="ALiBi slopes tensor must have contiguous last dimension"),
    "alibi-kv-heads": Bad(options=dict(alibi_slopes=torch.rand(HK))),
    "alibi-wrong-batch": Bad(options=dict(alibi_slopes=torch.rand(B + 1, H))),
    "alibi-3d": Bad(options=dict(alibi_slopes=torch.rand(B, H, 1))),
    # §2.2: one device for everything, and the error names the offending argument. Without a GPU the
    # other device is "meta".
    "k-other-device": Bad(k=_kv(device="meta"), message="k must be on"),
    "v-other-device": Bad(v=_kv(device="meta"), message="v must be on"),
    "alibi-other-device": Bad(options=dict(alibi_slopes=torch.rand(H, device="meta")),
                              message="alibi_slopes must be on"),
}


def _raises(message: Optional[str]):
    """pytest.raises(RuntimeError) matching `message` (any message when None).

    Callers also assert the error is not a NotImplementedError: that is a RuntimeError subclass too, and
    "dropout is not implemented yet" must not pass for a missing range check.
    """
    return pytest.raises(RuntimeError, match=None if message is None else re.escape(message))


@pytest.mark.parametrize("case", FORWARD_CASES.values(), ids=FORWARD_CASES.keys())
def test_flash_attn_func_rejects(case):
    with _raises(case.message) as excinfo:
        flash_attn.flash_attn_func(case.q(), case.k(), case.v(), **case.options)
    assert not isinstance(excinfo.value, NotImplementedError)


@pytest.mark.parametrize("case", FORWARD_CASES.values(), ids=FORWARD_CASES.keys())
def test_low_level_forward_rejects(case):
    q, k, v = case.q(), case.k(), case.v()
    options = dict(dropout_p=0.0, softcap=0.0, alibi_slopes=None) | case.options
    with _raises(case.message) as excinfo:
        fai._flash_attn_forward(q, k, v, options["dropout_p"], 0.25, False, -1, -1, options["softcap"],
                                options["alibi_slopes"], False)
    assert not isinstance(excinfo.value, NotImplementedError)


PACKED_CASES = {
    "qkvpacked-fp32": (lambda: (_tensor(B, S, 3, H, D, dtype=torch.float32),),
                       flash_attn.flash_attn_qkvpacked_func, "FlashAttention only support fp16 and bf16 data type"),
    "qkvpacked-batch-0": (lambda: (_tensor(0, S, 3, H, D),), flash_attn.flash_attn_qkvpacked_func,
                          "batch size must be positive"),
    "qkvpacked-head-dim-513": (lambda: (_tensor(B, S, 3, H, 513),), flash_attn.flash_attn_qkvpacked_func,
                               "FlashAttention forward only supports head dimension at most 512"),
    "kvpacked-kv-bf16": (lambda: (_tensor(B, S, H, D), _tensor(B, S, 2, HK, D, dtype=torch.bfloat16)),
                         flash_attn.flash_attn_kvpacked_func, "query and key must have the same dtype"),
    "kvpacked-heads-4-over-3": (lambda: (_tensor(B, S, H, D), _tensor(B, S, 2, 3, D)),
                                flash_attn.flash_attn_kvpacked_func, GQA_MESSAGE),
    "kvpacked-kv-batch": (lambda: (_tensor(B, S, H, D), _tensor(B + 1, S, 2, HK, D)),
                          flash_attn.flash_attn_kvpacked_func,
                          f"k must have shape {KV_SHAPE}"),
}


@pytest.mark.parametrize("make,fn,message", PACKED_CASES.values(), ids=PACKED_CASES.keys())
def test_packed_functions_reject(make, fn, message):
    with pytest.raises(RuntimeError, match=re.escape(message)):
        fn(*make())


# ------------------------------------------------------------------------------------------------------------
# Backward, through _flash_attn_backward (no forward needed: out and lse are just well-formed tensors)
# ------------------------------------------------------------------------------------------------------------


def _backward_args(q, k, v, dout=None, out=None, dropout_p=0.0, softcap=0.0):
    out = _tensor(*q.shape, dtype=q.dtype) if out is None else out
    dout = _tensor(*q.shape, dtype=q.dtype) if dout is None else dout
    lse = torch.randn(q.shape[0], q.shape[2], q.shape[1])
    grads = [torch.empty_like(t) for t in (q, k, v)]
    return (dout, q, k, v, out, lse, *grads, dropout_p, 0.25, False, -1, -1, softcap, None, False,
            torch.zeros(2, dtype=torch.int64))


BACKWARD_CASES = {
    "out-bf16": (dict(out=_tensor(B, S, H, D, dtype=torch.bfloat16)), "query and out must have the same dtype"),
    "dout-bf16": (dict(dout=_tensor(B, S, H, D, dtype=torch.bfloat16)), "query and dout must have the same dtype"),
    "softcap-with-dropout": (dict(softcap=5.0, dropout_p=0.1), "Softcapping does not support dropout for now"),
    "dropout-1": (dict(dropout_p=1.0), None),
    "dropout-negative": (dict(dropout_p=-0.1), None),
    "dout-other-device": (dict(dout=_tensor(B, S, H, D, device="meta")), "dout must be on"),
}


@pytest.mark.parametrize("overrides,message", BACKWARD_CASES.values(), ids=BACKWARD_CASES.keys())
def test_low_level_backward_rejects(overrides, message):
    q, k, v = _tensor(B, S, H, D), _tensor(B, S, HK, D), _tensor(B, S, HK, D)
    with _raises(message) as excinfo:
        fai._flash_attn_backward(*_backward_args(q, k, v, **overrides))
    assert not isinstance(excinfo.value, NotImplementedError)


@pytest.mark.parametrize("dtype,dim,message", [
    pytest.param(torch.float32, D, "FlashAttention only support fp16 and bf16 data type", id="fp32"),
    pytest.param(FP16, 513, "FlashAttention backward only supports head dimension at most 512", id="head-dim-513"),
])
def test_low_level_backward_rejects_inputs(dtype, dim, message):
    q, k, v = _q(dim=dim, dtype=dtype)(), _kv(dim=dim, dtype=dtype)(), _kv(dim=dim, dtype=dtype)()
    with pytest.raises(RuntimeError, match=re.escape(message)):
        fai._flash_attn_backward(*_backward_args(q, k, v))


# ------------------------------------------------------------------------------------------------------------
# Varlen (docs/api.md §6 rows for cu_seqlens and block_table), through flash_attn_varlen_func and the low-level op
# ------------------------------------------------------------------------------------------------------------

LENS = (3, 5)
T = sum(LENS)


def _cu(dtype=torch.int32, lengths=LENS, device="cpu"):
    return lambda: cu_seqlens(lengths, device, dtype)


def _strided_cu():
    return torch.tensor([0, 0, LENS[0], 0, T, 0], dtype=torch.int32)[::2]


def _table(dtype=torch.int32, rows=len(LENS), strided=False):
    def make():
        table = torch.arange(rows * 2 * (2 if strided else 1), dtype=dtype).view(rows, -1)
        return table[:, ::2] if strided else table
    return make


PAGED_KV = lambda: _tensor(4, 16, HK, D)  # noqa: E731  (num_pages, page_size, heads_k, head_dim)


@dataclass(frozen=True)
class BadVarlen:
    """flash_attn_varlen_func(q(), k(), v(), cu_q(), cu_k(), max, max, **options) must raise `message`."""

    q: Callable = lambda: _tensor(T, H, D)
    k: Callable = lambda: _tensor(T, HK, D)
    v: Callable = lambda: _tensor(T, HK, D)
    cu_q: Callable = _cu()
    cu_k: Callable = _cu()
    block_table: Optional[Callable] = None
    message: Optional[str] = None


VARLEN_CASES = {
    "cu-q-int64": BadVarlen(cu_q=_cu(torch.int64), message="cu_seqlens_q must have dtype int32"),
    "cu-k-int64": BadVarlen(cu_k=_cu(torch.int64), message="cu_seqlens_k must have dtype int32"),
    "cu-q-strided": BadVarlen(cu_q=_strided_cu, message="cu_seqlens_q must be contiguous"),
    "cu-k-strided": BadVarlen(cu_k=_strided_cu, message="cu_seqlens_k must be contiguous"),
    "cu-k-length": BadVarlen(cu_k=_cu(lengths=(3, 2, 3)), message="cu_seqlens_k must have shape (batch_size + 1)"),
    "cu-q-other-device": BadVarlen(cu_q=_cu(device="meta"), message="cu_seqlens_q must be on"),
    "q-fp32": BadVarlen(q=lambda: _tensor(T, H, D, dtype=torch.float32),
                        k=lambda: _tensor(T, HK, D, dtype=torch.float32),
                        v=lambda: _tensor(T, HK, D, dtype=torch.float32),
                        message="FlashAttention only support fp16 and bf16 data type"),
    "heads-4-over-3": BadVarlen(k=lambda: _tensor(T, 3, D), v=lambda: _tensor(T, 3, D), message=GQA_MESSAGE),
    "head-dim-0": BadVarlen(q=lambda: _tensor(T, H, 0), k=lambda: _tensor(T, HK, 0), v=lambda: _tensor(T, HK, 0),
                            message="head dimension must be at least 1, got 0"),
    "head-dim-513": BadVarlen(q=lambda: _tensor(T, H, 513), k=lambda: _tensor(T, HK, 513),
                              v=lambda: _tensor(T, HK, 513),
                              message="FlashAttention forward only supports head dimension at most 512"),
    "block-table-int64": BadVarlen(k=PAGED_KV, v=PAGED_KV, block_table=_table(torch.int64),
                                   message="block_table must have dtype torch.int32"),
    "block-table-strided": BadVarlen(k=PAGED_KV, v=PAGED_KV, block_table=_table(strided=True),
                                     message="block_table must have contiguous last dimension"),
    "block-table-rows": BadVarlen(k=PAGED_KV, v=PAGED_KV, block_table=_table(rows=len(LENS) + 1),
                                  message="block_table must have shape (batch_size, max_num_blocks_per_seq)"),
}


@pytest.mark.parametrize("case", VARLEN_CASES.values(), ids=VARLEN_CASES.keys())
def test_flash_attn_varlen_func_rejects(case):
    block_table = None if case.block_table is None else case.block_table()
    with _raises(case.message) as excinfo:
        flash_attn.flash_attn_varlen_func(case.q(), case.k(), case.v(), case.cu_q(), case.cu_k(), max(LENS),
                                          max(LENS), block_table=block_table)
    assert not isinstance(excinfo.value, NotImplementedError)


@pytest.mark.parametrize("case", VARLEN_CASES.values(), ids=VARLEN_CASES.keys())
def test_low_level_varlen_forward_rejects(case):
    block_table = None if case.block_table is None else case.block_table()
    with _raises(case.message) as excinfo:
        fai._flash_attn_varlen_forward(case.q(), case.k(), case.v(), case.cu_q(), case.cu_k(), max(LENS),
                                       max(LENS), 0.0, 0.25, False, block_table=block_table)
    assert not isinstance(excinfo.value, NotImplementedError)


def test_valid_varlen_forward_reaches_the_patched_launcher():
    """The cases above fail on their own argument: the same call with good arguments gets to the launch."""
    case = BadVarlen()
    with pytest.raises(AssertionError, match="launched"):
        flash_attn.flash_attn_varlen_func(case.q(), case.k(), case.v(), case.cu_q(), case.cu_k(), max(LENS),
                                          max(LENS))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the capability check applies to CUDA tensors")
def test_gpus_older_than_sm80_are_rejected(monkeypatch):
    from flashtriton.ops import checks

    monkeypatch.setattr(checks, "_major_capability", lambda device_index: 7)
    q, k, v = _q(device="cuda")(), _kv(device="cuda")(), _kv(device="cuda")()
    with _raises("FlashAttention only supports Ampere GPUs or newer."):
        flash_attn.flash_attn_func(q, k, v)


GRADIENT_BUFFER_CASES = {
    "dq-shape": (0, lambda t: torch.empty(t.shape[0], t.shape[1] + 1, *t.shape[2:], dtype=t.dtype),
                 "dq must have the shape of its input"),
    "dk-dtype": (1, lambda t: torch.empty_like(t, dtype=torch.bfloat16), "dk must have the dtype of q"),
    "dv-strided": (2, lambda t: torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)[..., ::2],
                   "dv must have contiguous last dimension"),
}


@pytest.mark.parametrize("index,make,message", GRADIENT_BUFFER_CASES.values(), ids=GRADIENT_BUFFER_CASES.keys())
def test_low_level_backward_rejects_gradient_buffers(index, make, message):
    """dq / dk / dv buffers the kernels cannot write into (wrong shape, dtype, or a strided last dim) are named in
    the error, before any launch."""
    q, k, v = _tensor(B, S, H, D), _tensor(B, S, HK, D), _tensor(B, S, HK, D)
    args = list(_backward_args(q, k, v))
    args[6 + index] = make((q, k, v)[index])
    with pytest.raises(RuntimeError, match=re.escape(message)):
        fai._flash_attn_backward(*args)


# ------------------------------------------------------------------------------------------------------------
# Python-level arguments of the public functions: the message names the argument, what it must be and what it is
# ------------------------------------------------------------------------------------------------------------

PUBLIC_CALLS = {
    "flash_attn_func": lambda **options: flash_attn.flash_attn_func(_tensor(B, S, H, D), _tensor(B, S, HK, D),
                                                                    _tensor(B, S, HK, D), **options),
    "flash_attn_varlen_func": lambda **options: flash_attn.flash_attn_varlen_func(
        _tensor(T, H, D), _tensor(T, HK, D), _tensor(T, HK, D), _cu()(), _cu()(), max(LENS), max(LENS), **options),
    "flash_attn_with_kvcache": lambda **options: flash_attn.flash_attn_with_kvcache(
        _tensor(B, 1, H, D), _tensor(B, S, HK, D), _tensor(B, S, HK, D), **options),
}


@pytest.mark.parametrize("window_size", [(16,), (1, 2, 3), None, 5, ("left", "right")], ids=repr)
@pytest.mark.parametrize("call", PUBLIC_CALLS.values(), ids=PUBLIC_CALLS.keys())
def test_window_size_must_be_a_pair_of_ints(call, window_size):
    with pytest.raises(ValueError, match=re.escape(f"window_size must be a pair of ints (left, right), -1 meaning "
                                                   f"unbounded, got {window_size!r}")):
        call(window_size=window_size)


def test_window_size_accepts_int_likes():
    """Elements may be one-element tensors (docs/api.md §3, note 18): the call gets to the launch."""
    with pytest.raises(AssertionError, match="launched"):
        PUBLIC_CALLS["flash_attn_func"](window_size=(torch.tensor(3), torch.tensor(-1)))


def test_head_dim_0_with_the_default_softmax_scale():
    """1 / sqrt(head_dim) is not computed for head_dim 0: the head-dimension error comes instead."""
    q, kv = _tensor(B, 1, H, 0), _tensor(B, S, HK, 0)
    with _raises("head dimension must be at least 1, got 0"):
        flash_attn.flash_attn_with_kvcache(q, kv, kv.clone())
    with _raises("head dimension must be at least 1, got 0"):
        flash_attn.flash_attn_qkvpacked_func(_tensor(B, S, 3, H, 0))


@pytest.mark.parametrize("cache_seqlens", [[3, 4], 3.0, (3, 4), "3"], ids=repr)
def test_cache_seqlens_must_be_an_int_or_a_tensor(cache_seqlens):
    """docs/api.md §5.1: an int or an int32 / int64 (batch_size,) tensor, as flash_attn; anything else is a TypeError
    naming the accepted types and the given one."""
    with pytest.raises(TypeError, match=re.escape("cache_seqlens must be an int or an int32 / int64 tensor of shape "
                                                  f"(batch_size), got {type(cache_seqlens).__name__}")):
        PUBLIC_CALLS["flash_attn_with_kvcache"](cache_seqlens=cache_seqlens)

"""The backend seam: validate, allocate, pick a config, launch. Same entry points as flash_attn's C extension.

Where kernels run:
  * CUDA tensors run the compiled Triton kernels on the tensors' device.
  * CPU tensors run the same kernels through Triton's interpreter when the kernels were decorated
    with TRITON_INTERPRET=1 set (it must be set before flashtriton is imported), and otherwise the
    exact PyTorch reference in float32 (flashtriton.reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .. import configs
from ..kernels.bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel
from ..kernels.fwd import attn_fwd_kernel
from ..reference import attention_reference, is_pure_causal, normalize_window
from . import checks

LOG2E = 1.4426950408889634

# TRITON_INTERPRET is read when @triton.jit runs, so the kernel objects themselves say how they run.
KERNELS_INTERPRETED = type(attn_fwd_kernel).__name__ == "InterpretedFunction"

DROPOUT_ISSUE = "dropout_p > 0 is not implemented yet in flashtriton (tracked by the dropout issue, #8)"

# Tests set this (flashtriton.testing.poisoned_outputs) so every output buffer starts as NaN/garbage
# and an element a kernel forgot to write fails the comparison.
POISON_OUTPUTS = False


def new_empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Allocate an output buffer; NaN-filled (or 0x7f.. for integers) while POISON_OUTPUTS is set."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if POISON_OUTPUTS:
        tensor.fill_(float("nan") if tensor.is_floating_point() else 0x7F)
    return tensor


def empty_like(tensor: torch.Tensor) -> torch.Tensor:
    return new_empty(tensor.shape, tensor.dtype, tensor.device)


def runs_triton(tensor: torch.Tensor) -> bool:
    """True when this tensor's attention runs the Triton kernels (compiled, or interpreted on CPU)."""
    return tensor.is_cuda or KERNELS_INTERPRETED


def round_multiple(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class ScoreParams:
    """Scalar semantics of one call, shared by forward and backward launches (all runtime kernel args)."""

    softmax_scale: float
    window_left: int
    window_right: int
    softcap: float
    alibi_pure_causal: bool

    @property
    def is_local(self) -> bool:
        return self.window_left >= 0

    def kernel_args(self):
        """(qk_scale_log2, softcap_in_scale, softcap_out_log2, window_left, window_right, alibi_pure_causal)."""
        has_softcap = self.softcap > 0.0
        return (
            self.softmax_scale * LOG2E,
            self.softmax_scale / self.softcap if has_softcap else 0.0,
            self.softcap * LOG2E if has_softcap else 0.0,
            self.window_left,
            self.window_right,
            int(self.alibi_pure_causal),
        )


def score_params(softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
                 seqlen_k_star: int) -> ScoreParams:
    window = (window_left, window_right)
    left, right = normalize_window(window, causal, seqlen_k_star)
    return ScoreParams(float(softmax_scale), left, right, float(softcap), is_pure_causal(window, causal, seqlen_k_star))


def _bsh_strides(tensor: torch.Tensor) -> Tuple[int, int, int]:
    """(batch, sequence, head) strides of a (B, S, H, D) tensor."""
    return tensor.stride(0), tensor.stride(1), tensor.stride(2)


def _alibi_batch_stride(alibi_slopes: Optional[torch.Tensor]) -> int:
    return alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0


def _device_guard(tensor: torch.Tensor):
    return torch.cuda.device(tensor.device) if tensor.is_cuda else _NullContext()


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _check_dropout(dropout_p: float) -> None:
    if dropout_p > 0.0:
        raise NotImplementedError(DROPOUT_ISSUE)


# ----------------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------------

def launch_fwd(q, k, v, out, lse, params: ScoreParams, alibi_slopes, lse_strides: Tuple[int, int],
               seqlen_q: int, seqlen_k: int, batch: int, cu_seqlens_q=None, cu_seqlens_k=None) -> None:
    """Run the forward kernel into preallocated out (q's layout) and lse (fp32, rows contiguous)."""
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_heads_k = k.shape[-2]
    config = configs.fwd_config(configs.arch_class(q.device), head_dim)
    if seqlen_q == 0 or batch == 0:
        return
    is_varlen = cu_seqlens_q is not None
    seq_strides = (lambda t: (0, t.stride(0), t.stride(1))) if is_varlen else _bsh_strides
    grid = (triton_cdiv(seqlen_q, config.block_m), batch * num_heads)
    with _device_guard(q):
        attn_fwd_kernel[grid](
            q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
            *seq_strides(q), *seq_strides(k), *seq_strides(v), *seq_strides(out),
            *lse_strides, _alibi_batch_stride(alibi_slopes),
            num_heads, num_heads // num_heads_k, seqlen_q, seqlen_k,
            *params.kernel_args(),
            HEAD_DIM=head_dim, BLOCK_D=configs.block_d(head_dim), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            IS_LOCAL=params.is_local, HAS_SOFTCAP=params.softcap > 0.0, HAS_ALIBI=alibi_slopes is not None,
            IS_VARLEN=is_varlen, RESCALE_THRESHOLD=config.rescale_threshold,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def mha_fwd(q, k, v, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
            window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor], return_softmax: bool):
    """Dense forward. Returns (out, softmax_lse (B, H, Sq), S_dmask, rng_state); see API.md §7."""
    checks.check_dense_qkv(q, k, v)
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    checks.check_options(dropout_p, softcap, alibi_slopes, batch, num_heads, q)
    checks.check(not return_softmax or dropout_p > 0.0, "return_softmax is only supported when p_dropout > 0.0")
    _check_dropout(dropout_p)
    q, k, v = (t if checks.has_contiguous_last_dim(t) else t.contiguous() for t in (q, k, v))
    rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
    s_dmask = torch.empty(0, dtype=q.dtype, device=q.device)

    if not runs_triton(q):
        out, lse = attention_reference(q, k, v, softmax_scale, causal, (window_size_left, window_size_right),
                                       softcap, alibi_slopes, compute_dtype=torch.float32)
        return out, lse, s_dmask, rng_state

    params = score_params(softmax_scale, causal, window_size_left, window_size_right, softcap, seqlen_k)
    out = new_empty((batch, seqlen_q, num_heads, head_dim), q.dtype, q.device)
    lse = new_empty((batch, num_heads, seqlen_q), torch.float32, q.device)
    launch_fwd(q, k, v, out, lse, params, alibi_slopes, (lse.stride(0), lse.stride(1)), seqlen_q, seqlen_k, batch)
    return out, lse, s_dmask, rng_state


# ----------------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------------

def launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, delta, params: ScoreParams, alibi_slopes,
               lse_strides: Tuple[int, int], seqlen_q: int, seqlen_k: int, batch: int,
               cu_seqlens_q=None, cu_seqlens_k=None) -> None:
    """Run preprocess, dK/dV and dQ into preallocated dq/dk/dv (any strides, last dim contiguous).

    delta has lse's layout (lse_strides) and receives rowsum(dout * out).
    """
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_heads_k = k.shape[-2]
    group_size = num_heads // num_heads_k
    config = configs.bwd_config(configs.arch_class(q.device), head_dim)
    is_varlen = cu_seqlens_q is not None
    seq_strides = (lambda t: (0, t.stride(0), t.stride(1))) if is_varlen else _bsh_strides
    block_dim = configs.block_d(head_dim)
    flags = dict(IS_LOCAL=params.is_local, HAS_SOFTCAP=params.softcap > 0.0, HAS_ALIBI=alibi_slopes is not None,
                 IS_VARLEN=is_varlen)
    score_args = params.kernel_args()
    alibi_stride = _alibi_batch_stride(alibi_slopes)
    with _device_guard(q):
        if seqlen_q > 0:
            preprocess_grid = (triton_cdiv(seqlen_q, config.preprocess_block), batch * num_heads)
            attn_bwd_preprocess_kernel[preprocess_grid](
                out, dout, delta, cu_seqlens_q, *seq_strides(out), *seq_strides(dout), *lse_strides,
                num_heads, seqlen_q,
                HEAD_DIM=head_dim, BLOCK_D=block_dim, BLOCK_M=config.preprocess_block, IS_VARLEN=is_varlen,
            )
        if seqlen_k > 0:
            dkdv_grid = (triton_cdiv(seqlen_k, config.block_n), batch * num_heads_k)
            attn_bwd_dkdv_kernel[dkdv_grid](
                q, k, v, dout, lse, delta, dk, dv, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                *seq_strides(q), *seq_strides(k), *seq_strides(v), *seq_strides(dout), *lse_strides,
                *seq_strides(dk), *seq_strides(dv), alibi_stride,
                num_heads_k, group_size, seqlen_q, seqlen_k, params.softmax_scale, *score_args,
                HEAD_DIM=head_dim, BLOCK_D=block_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n, **flags,
                num_warps=config.num_warps, num_stages=config.num_stages,
            )
        if seqlen_q > 0:
            dq_grid = (triton_cdiv(seqlen_q, config.block_m), batch * num_heads)
            attn_bwd_dq_kernel[dq_grid](
                q, k, v, dout, lse, delta, dq, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                *seq_strides(q), *seq_strides(k), *seq_strides(v), *seq_strides(dout), *lse_strides,
                *seq_strides(dq), alibi_stride,
                num_heads, group_size, seqlen_q, seqlen_k, params.softmax_scale, *score_args,
                HEAD_DIM=head_dim, BLOCK_D=block_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n, **flags,
                num_warps=config.num_warps, num_stages=config.num_stages,
            )


def _reference_grads(dout, q, k, v, reference_fn):
    """Gradients of reference_fn(q, k, v) -> out, in float32 through autograd; returns (dq, dk, dv)."""
    with torch.enable_grad():
        inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
        out = reference_fn(*inputs)
        return torch.autograd.grad(out, inputs, dout.float())


def _check_bwd_tensors(dout, q, out, dq, dk, dv, k, v) -> None:
    checks.check_dense_qkv(q, k, v, direction="backward")
    checks.check(out.dtype == q.dtype, "query and out must have the same dtype")
    checks.check(dout.dtype == q.dtype, "query and dout must have the same dtype")
    checks.check(checks.has_contiguous_last_dim(dout), "dout tensor must have contiguous last dimension")
    for name, grad, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        checks.check(tuple(grad.shape) == tuple(like.shape),
                     f"{name} must have the shape of its input {tuple(like.shape)}, got {tuple(grad.shape)}")
        checks.check(grad.dtype == q.dtype, f"{name} must have the dtype of q ({q.dtype}), got {grad.dtype}")
        checks.check(checks.has_contiguous_last_dim(grad), f"{name} must have contiguous last dimension")
    checks.check_same_device(q, dout=dout, out=out, dq=dq, dk=dk, dv=dv)


def mha_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p: float, softmax_scale: float, causal: bool,
            window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
            deterministic: bool, rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dense backward into preallocated dq, dk, dv. Returns softmax_d (B, H, R(Sq)) = rowsum(dout * out).

    The kernels never use atomics, so the result is bitwise reproducible whatever `deterministic` says.
    """
    _check_bwd_tensors(dout, q, out, dq, dk, dv, k, v)
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    checks.check_options(dropout_p, softcap, alibi_slopes, batch, num_heads, q)
    _check_dropout(dropout_p)
    softmax_d = torch.zeros(batch, num_heads, round_multiple(seqlen_q, 128), dtype=torch.float32, device=q.device)

    if not runs_triton(q):
        window = (window_size_left, window_size_right)
        grads = _reference_grads(dout, q, k, v, lambda q_, k_, v_: attention_reference(
            q_, k_, v_, softmax_scale, causal, window, softcap, alibi_slopes, compute_dtype=torch.float32)[0])
        for target, grad in zip((dq, dk, dv), grads):
            target.copy_(grad)
        softmax_d[:, :, :seqlen_q] = (dout.float() * out.float()).sum(-1).transpose(1, 2)
        return softmax_d

    params = score_params(softmax_scale, causal, window_size_left, window_size_right, softcap, seqlen_k)
    lse = softmax_lse.contiguous()
    delta = empty_like(lse)
    launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, delta, params, alibi_slopes,
               (lse.stride(0), lse.stride(1)), seqlen_q, seqlen_k, batch)
    softmax_d[:, :, :seqlen_q] = delta
    return softmax_d

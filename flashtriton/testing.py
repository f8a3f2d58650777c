"""Input generators, the tolerance rule and NaN-poisoning, shared by the tests and `flashtriton validate`.

The tolerance rule (docs/api.md §4.10): with `ref` the float64 reference and `pt` the same reference run
in the input dtype, a kernel result passes when max|kernel - ref| <= factor * max|pt - ref| + atol.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple

import torch

from .ops import backend
from .reference import (attention_probabilities, attention_reference, attention_reference_varlen, row_slopes,
                        sequence_slices)

__all__ = ["Case", "ErrorCheck", "check_error", "check_lse", "make_case_inputs", "poisoned_outputs", "strided_like",
           "compare_with_reference", "assert_compiled_matches_eager"]


@contextlib.contextmanager
def _overridden(module, name: str, value):
    """Within this block module.name is value; the previous value comes back afterwards."""
    previous = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, previous)


def poisoned_outputs(enabled: bool = True):
    """Within this block every buffer the library allocates for results starts as NaN."""
    return _overridden(backend, "POISON_OUTPUTS", enabled)


@contextlib.contextmanager
def _forced_config_fields(fwd_fields: dict, bwd_fields: dict):
    """Within this block configs.fwd_config / bwd_config return their configs with these fields replaced."""
    from . import configs

    original_fwd, original_bwd = configs.fwd_config, configs.bwd_config
    if fwd_fields:
        configs.fwd_config = lambda *args, **kwargs: replace(original_fwd(*args, **kwargs), **fwd_fields)
    if bwd_fields:
        configs.bwd_config = lambda *args, **kwargs: replace(original_bwd(*args, **kwargs), **bwd_fields)
    try:
        yield
    finally:
        configs.fwd_config, configs.bwd_config = original_fwd, original_bwd


def forced_tma(enabled: bool = True):
    """Within this block forward and backward configs use tensor descriptors (as sm90 does), also in the
    interpreter whose own configs have them off: host-built descriptors for dense forward layouts, in-kernel
    ones otherwise and in the backward. Tensors that descriptors cannot address still use pointer loads."""
    if not enabled:
        return contextlib.nullcontext()
    return _forced_config_fields(dict(use_tma=True), dict(use_tma=True))


def forced_dq_atomic():
    """Within this block backward configs add dQ with atomics inside the dK/dV kernel (BwdConfig.dq_atomic)
    unless deterministic=True, as the configs that enable it do on a GPU."""
    return _forced_config_fields({}, dict(dq_atomic=True))


@contextlib.contextmanager
def forced_heads_per_group(heads_per_group: Optional[int]):
    """Within this block launch-order groups (configs.heads_per_l2_group) hold heads_per_group (batch, head) pairs,
    the last group fewer, whatever L2 budget the configs give; None keeps the configs' choice."""
    from . import configs

    original = configs.heads_per_l2_group
    if heads_per_group is not None:
        configs.heads_per_l2_group = lambda _bytes, batch_heads, _causal: min(heads_per_group, batch_heads)
    try:
        yield
    finally:
        configs.heads_per_l2_group = original


def forced_gluon(enabled: bool = True):
    """Within this block the Gluon Hopper kernels (ops/hopper) may run where they cover the call (True) or never run
    (False: every forward and backward takes the Triton kernels), whatever FLASHTRITON_GLUON says."""
    from . import configs

    return _overridden(configs, "GLUON_ALLOWED", enabled)


def forced_rescale_threshold(threshold: float):
    """Within this block the Triton forward's configs have this A-1 rescale threshold (FwdConfig.rescale_threshold,
    log2 units; 0: every key block rescales), whatever their tables say."""
    return _forced_config_fields(dict(rescale_threshold=threshold), {})


def forced_hopper_grid(programs: Optional[int]):
    """Within this block the Gluon Hopper forward's grid has at most `programs` programs (None: as configured), so
    each program runs many work items (ops/hopper.forward_grid)."""
    from .ops import hopper

    return _overridden(hopper, "PROGRAMS_CAP", programs)


def unchecked_indices():
    """Within this block no call reads its index values on the host (ops/checks.index_tensors_to_check answers None,
    as for a GPU call outside strict mode), so CPU calls through the interpreter hand malformed cu_seqlens,
    block tables, cache_batch_idx and cache_seqlens to the kernels as a GPU call would (tests/test_kernel_bounds.py,
    tools/sanitize_cases.py)."""
    from .ops import checks

    return _overridden(checks, "index_tensors_to_check", lambda device, tensors: None)


def cu_seqlens(lengths: Sequence[int], device="cpu", dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """flash_attn's cu_seqlens for these sequence lengths: cumulative starts (0, l0, l0 + l1, ...), int32."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=dtype, device=device)


@dataclass(frozen=True)
class Case:
    """One dense attention configuration."""

    batch: int = 2
    seqlen_q: int = 64
    seqlen_k: int = 64
    num_heads: int = 4
    num_heads_k: int = 4
    head_dim: int = 64
    dtype: torch.dtype = torch.float16
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    softmax_scale: Optional[float] = None
    # or "bhsd" (transposed views), "sliced" (views into wider tensors), "wider-rows" (the aligned first D columns of
    # NaN-filled wider rows)
    layout: str = "contiguous"

    def label(self) -> str:
        parts = [f"b{self.batch}", f"sq{self.seqlen_q}", f"sk{self.seqlen_k}", f"h{self.num_heads}",
                 f"hk{self.num_heads_k}", f"d{self.head_dim}", str(self.dtype).replace("torch.", "")]
        if self.causal:
            parts.append("causal")
        if tuple(self.window_size) != (-1, -1):
            parts.append(f"win{self.window_size[0]}_{self.window_size[1]}")
        if self.softcap > 0:
            parts.append(f"cap{self.softcap:g}")
        if self.alibi:
            parts.append("alibi")
        if self.softmax_scale is not None:
            parts.append(f"scale{self.softmax_scale:g}")
        if self.layout != "contiguous":
            parts.append(self.layout)
        return "-".join(parts)


def strided_like(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as `tensor` (B, S, H, D) in a non-contiguous layout with a contiguous last dim."""
    if layout == "contiguous":
        return tensor
    if layout == "bhsd":
        return tensor.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "sliced":
        batch, seqlen, heads, dim = tensor.shape
        wide = torch.empty(batch, seqlen + 3, heads + 1, dim + 8, dtype=tensor.dtype, device=tensor.device)
        wide.normal_()
        view = wide[:, 2:seqlen + 2, 1:, 3:dim + 3]
        view.copy_(tensor)
        return view
    if layout == "wider-rows":
        # 16-byte aligned rows of a wider tensor whose other columns hold NaN: a kernel that reads past D shows it
        batch, seqlen, heads, dim = tensor.shape
        wide = torch.full((batch, seqlen, heads, dim + 64), float("nan"), dtype=tensor.dtype, device=tensor.device)
        view = wide[..., :dim]
        view.copy_(tensor)
        return view
    raise ValueError(f"unknown layout {layout!r}")


def quantize_e4m3(x: torch.Tensor, group: int = 1):
    """(e4m3 x, (B, heads / group) fp32 descale) for FP8 calls (docs/api.md §4.12: x = e4m3 x * descale): x (B, S,
    heads, D) scaled per (batch, group of heads) so that its largest magnitude lands on e4m3's 448."""
    x = x.float()
    batch, _, heads, _ = x.shape
    amax = x.abs().amax(dim=(1, 3)).view(batch, heads // group, group).amax(-1).clamp(min=1e-6)
    descale = amax / 448
    return (x / descale.repeat_interleave(group, 1)[:, None, :, None]).to(torch.float8_e4m3fn), descale


def make_case_inputs(case: Case, device="cpu", requires_grad: bool = False, scale: float = 1.0):
    """Fresh random (q, k, v, alibi_slopes) for a case, already rounded to its dtype."""
    shape_q = (case.batch, case.seqlen_q, case.num_heads, case.head_dim)
    shape_k = (case.batch, case.seqlen_k, case.num_heads_k, case.head_dim)
    tensors = []
    for shape in (shape_q, shape_k, shape_k):
        t = strided_like((torch.randn(shape, device=device) * scale).to(case.dtype), case.layout)
        tensors.append(t.requires_grad_(requires_grad))
    slopes = None
    if case.alibi:
        slopes = torch.rand(case.batch, case.num_heads, device=device, dtype=torch.float32) * 0.5
    return (*tensors, slopes)


@dataclass(frozen=True)
class ErrorCheck:
    """One tolerance-rule comparison."""

    name: str
    max_error: float       # max |kernel - ref|
    pytorch_error: float   # max |pt - ref|: what PyTorch itself reaches in this dtype
    bound: float
    finite: bool

    @property
    def ok(self) -> bool:
        return self.finite and self.max_error <= self.bound

    @property
    def ratio(self) -> float:
        if self.pytorch_error > 0:
            return self.max_error / self.pytorch_error
        return 0.0 if self.max_error == 0 else float("inf")

    def __str__(self) -> str:
        return (f"{self.name}: max err {self.max_error:.3e}, PyTorch's own {self.pytorch_error:.3e}, "
                f"bound {self.bound:.3e}, finite={self.finite}")


def check_error(name: str, actual: torch.Tensor, ref: torch.Tensor, pt: torch.Tensor, factor: float = 2.0,
                atol: float = 1e-5) -> ErrorCheck:
    """Apply the tolerance rule; NaN anywhere in `actual` where ref is finite fails."""
    actual64, ref64, pt64 = actual.detach().double(), ref.detach().double(), pt.detach().double()
    finite = bool(torch.isfinite(actual64[torch.isfinite(ref64)]).all()) if actual.numel() else True
    err = (actual64 - ref64).abs().nan_to_num(nan=float("inf"))
    max_error = float(err.max()) if err.numel() else 0.0
    pytorch_error = float((pt64 - ref64).abs().max()) if pt.numel() else 0.0
    return ErrorCheck(name, max_error, pytorch_error, factor * pytorch_error + atol, finite)


def check_lse(lse: torch.Tensor, ref_lse: torch.Tensor) -> ErrorCheck:
    """LSE must put +inf exactly where the reference does and match it elsewhere within 1e-4 relative."""
    inf_ref = torch.isinf(ref_lse)
    same_inf = torch.equal(torch.isinf(lse) & (lse > 0), inf_ref)
    finite_ref = ref_lse[~inf_ref].detach().double()
    err = (lse[~inf_ref].detach().double() - finite_ref).abs().nan_to_num(nan=float("inf"))
    max_error = float(err.max()) if err.numel() else 0.0
    bound = 1e-4 * (1.0 + (float(finite_ref.abs().max()) if err.numel() else 0.0))
    return ErrorCheck("lse", max_error, 0.0, bound, same_inf)


def flash_reference_grads(ref_out: torch.Tensor, ref_lse: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                          inputs64: Sequence[torch.Tensor]):
    """Float64 gradients of FlashAttention's backward algorithm, given the output the kernel stored.

    The backward takes delta_i = rowsum(dO_i * O_i) from the stored, rounded O (as FA2 does), so its
    dS = P * (dP - delta) carries -P_ij * e_i with e_i = rowsum(dO_i * (O_kernel_i - O_i)); since
    P_ij = dLSE_i / ds_ij, that is exactly the gradient of -sum_i e_i * LSE_i. With a saturated softmax this
    term dominates dQ and dK (they are tiny there), so gradients are compared with
    d/d(q, k, v) [sum(dO * O) - sum_i e_i * LSE_i] in float64 rather than with the exact gradient.
    ref_out/ref_lse come from the float64 reference built on inputs64, out is the kernel's output in
    ref_out's layout, and ref_lse has out's rows on its last axis ((B, H, Sq) or (H, T)).
    """
    dout64 = dout.detach().double()
    rounding = (dout64 * (out.detach().double() - ref_out.detach())).sum(-1).transpose(-1, -2)
    lse = ref_lse.double()
    finite = torch.isfinite(lse)
    rounding = torch.where(finite, rounding, 0.0)
    with torch.enable_grad():
        objective = (ref_out * dout64).sum() - (rounding * torch.where(finite, lse, 0.0)).sum()
    return torch.autograd.grad(objective, list(inputs64))


def fp32_backward_floor(q, k, v, out, dout, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, dropout_p: float = 0.0, seqlen_k_star: Optional[int] = None
                        ) -> Tuple[float, float]:
    """(dq, dk) error allowance for the fp32 arithmetic of FlashAttention's backward, measured with PyTorch.

    dS_ij = P_ij * (dP_ij - delta_i) subtracts two fp32 sums of D products, dP_ij = dO_i . V_j and
    delta_i = rowsum(dO_i * O_i). Where row i sees a single key j they are equal in exact arithmetic: the true
    dS is 0, PyTorch's same-dtype gradient can be exactly 0 as well (it takes delta from dP itself), and what
    any fp32 implementation leaves is rounding. This computes dP - delta in float32 with PyTorch, takes its
    difference from float64 on the same inputs, and carries it through dq = scale * dS . K and
    dk = scale * dS^T . Q with absolute values (GQA groups summed), times 2 (the kernel sums in another order).
    Elsewhere the result is far below PyTorch's same-dtype error and changes nothing.
    """
    probs = attention_probabilities(q.detach(), k.detach(), v.detach(), softmax_scale, causal, window_size, softcap,
                                    alibi_slopes, seqlen_k_star=seqlen_k_star, compute_dtype=torch.float64)
    head_dim, num_heads_k = q.shape[-1], k.shape[2]
    group = q.shape[2] // num_heads_k

    def dp_minus_delta(dtype):  # (B, H, Sq, Sk)
        dout_, out_ = dout.detach().to(dtype), out.detach().to(dtype)
        dp = torch.einsum("bqhd,bkhd->bhqk", dout_, v.detach().to(dtype).repeat_interleave(group, dim=2))
        return dp - (dout_ * out_).sum(-1).transpose(1, 2)[..., None]

    rounding = (dp_minus_delta(torch.float32).double() - dp_minus_delta(torch.float64)).abs()
    ds_error = 2.0 * probs * rounding / (1.0 - dropout_p)
    scale = abs(head_dim ** -0.5 if softmax_scale is None else softmax_scale)
    abs_q, abs_k = q.detach().double().abs(), k.detach().double().abs().repeat_interleave(group, dim=2)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds_error, abs_k) * scale
    dk = (torch.einsum("bhqk,bqhd->bkhd", ds_error, abs_q) * scale).unflatten(2, (num_heads_k, group)).sum(3)
    return (float(dq.max()) if dq.numel() else 0.0), (float(dk.max()) if dk.numel() else 0.0)


def _compare(reference, fp32_floors, out, lse, inputs, grads, dout, out_factor: float, grad_factor: float):
    """The checks both layouts share. reference(q, k, v, compute_dtype) -> (out, lse) is the float64 oracle
    and, with compute_dtype None, PyTorch's same-dtype math; fp32_floors() -> fp32_backward_floor's (dq, dk)."""
    with_grad = grads is not None
    inputs64 = [t.detach().double().requires_grad_(with_grad) for t in inputs]
    inputs_pt = [t.detach().clone().requires_grad_(with_grad) for t in inputs]
    with torch.enable_grad():
        ref_out, ref_lse = reference(*inputs64, compute_dtype=torch.float64)
        pt_out, _ = reference(*inputs_pt, compute_dtype=None)
    checks = [check_error("out", out, ref_out, pt_out, factor=out_factor), check_lse(lse, ref_lse)]
    if with_grad:
        ref_grads = flash_reference_grads(ref_out, ref_lse, out, dout, inputs64)
        pt_grads = torch.autograd.grad(pt_out, inputs_pt, dout)
        # the tolerance rule with atol 1e-4, plus the fp32 floor for dq and dk
        checks += [check_error(name, grad, ref_grad, pt_grad, factor=grad_factor, atol=1e-4 + floor)
                   for name, grad, ref_grad, pt_grad, floor in zip(("dq", "dk", "dv", "dsink"), grads, ref_grads,
                                                                    pt_grads, (*fp32_floors(), 0.0, 0.0))]
    return checks


def assert_checks_ok(checks: Sequence, context: str = "") -> None:
    """Raise AssertionError naming every failed ErrorCheck of checks (prefixed by context, if given)."""
    failed = [str(c) for c in checks if not c.ok]
    if failed:
        raise AssertionError((context + ": " if context else "") + "; ".join(failed))


def compare_with_reference(case: Case, out: torch.Tensor, lse: torch.Tensor, q, k, v, alibi_slopes,
                           grads: Optional[Sequence[torch.Tensor]] = None, dout: Optional[torch.Tensor] = None,
                           grad_factor: float = 3.0, dropout_p: float = 0.0,
                           dropout_mask: Optional[torch.Tensor] = None,
                           learnable_sink: Optional[torch.Tensor] = None):
    """ErrorChecks of out (and, with grads and dout, dq/dk/dv, and dsink with learnable_sink) against float64 and
    same-dtype references.

    LSE (check_lse) must put +inf exactly where the float64 reference does and match it elsewhere
    within 1e-4 * (1 + max|lse|). Gradients are compared with flash_reference_grads. With dropout_p > 0
    the references drop with dropout_mask (bool (B, H, Sq, Sk), True where kept: the kernel's own mask).
    """
    scores = (case.softmax_scale, case.causal, case.window_size, case.softcap, alibi_slopes)

    def reference(q_, k_, v_, sink=None, *, compute_dtype):
        return attention_reference(q_, k_, v_, *scores, dropout_p, dropout_mask, compute_dtype=compute_dtype,
                                   learnable_sink=sink)

    inputs = (q, k, v) if learnable_sink is None else (q, k, v, learnable_sink)
    return _compare(reference, lambda: fp32_backward_floor(q, k, v, out, dout, *scores, dropout_p=dropout_p),
                    out, lse, inputs, grads, dout, 2.0, grad_factor)


def run_forward_case(case: Case, grads: bool = False):
    """flash_attn_func (and, with grads, its backward) of one case on the GPU with NaN-poisoned outputs; returns
    (its ErrorChecks against the references, whether the Gluon forward ran)."""
    from .interface import flash_attn_func
    from .ops import hopper

    q, k, v, slopes = make_case_inputs(case, "cuda", requires_grad=grads)
    before = hopper.fwd_launch_count
    with poisoned_outputs():
        out, lse, _ = flash_attn_func(q, k, v, 0.0, case.softmax_scale, case.causal, case.window_size, case.softcap,
                                      slopes, return_attn_probs=True)
        dout = torch.randn_like(out) if grads else None
        grad_values = torch.autograd.grad(out, (q, k, v), dout) if grads else None
    ran = hopper.fwd_launch_count > before
    return compare_with_reference(case, out, lse, q, k, v, slopes, grad_values, dout), ran


def compare_varlen_with_reference(out: torch.Tensor, lse: torch.Tensor, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                  max_seqlen_k: int, grads: Optional[Sequence[torch.Tensor]] = None,
                                  dout: Optional[torch.Tensor] = None, out_factor: float = 2.0,
                                  grad_factor: float = 3.0, **options):
    """compare_with_reference for the varlen layout: q (Tq, H, D), k/v (Tk, Hk, D), lse (H, Tq); options are
    attention_reference_varlen's (softmax_scale, causal, window_size, softcap, alibi_slopes, learnable_sink).

    Every row counts: the reference gives rows past the last sequence out 0, lse +inf and zero gradients.
    """
    learnable_sink = options.pop("learnable_sink", None)

    def reference(q_, k_, v_, sink=None, *, compute_dtype):
        return attention_reference_varlen(q_, k_, v_, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, **options,
                                          compute_dtype=compute_dtype, learnable_sink=sink)

    def fp32_floors():
        return _varlen_fp32_backward_floor(q, k, v, out, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, **options)

    inputs = (q, k, v) if learnable_sink is None else (q, k, v, learnable_sink)
    return _compare(reference, fp32_floors, out, lse, inputs, grads, dout, out_factor, grad_factor)


def _varlen_fp32_backward_floor(q, k, v, out, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_k: int,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                alibi_slopes=None) -> Tuple[float, float]:
    """fp32_backward_floor of every sequence (window normalized with S* = max_seqlen_k); the largest."""
    floors = [(0.0, 0.0)]
    for b, rows_q, rows_k in sequence_slices(cu_seqlens_q, cu_seqlens_k):
        if rows_q.stop > rows_q.start and rows_k.stop > rows_k.start:
            floors.append(fp32_backward_floor(q[None, rows_q], k[None, rows_k], v[None, rows_k], out[None, rows_q],
                                              dout[None, rows_q], softmax_scale, causal, window_size, softcap,
                                              row_slopes(alibi_slopes, b), seqlen_k_star=max_seqlen_k))
    return max(f[0] for f in floors), max(f[1] for f in floors)


def assert_compiled_matches_eager(attention, make_leaves, dout: torch.Tensor) -> None:
    """attention(*leaves) -> (out, lse) eager and under torch.compile(fullgraph=True, backend="aot_eager"): outputs
    and the leaves' gradients (from out.backward(dout)) bitwise equal."""
    results = []
    for fn in (attention, torch.compile(attention, fullgraph=True, backend="aot_eager")):
        leaves = make_leaves()
        out, lse = fn(*leaves)
        out.backward(dout)
        results.append((out, lse, *(leaf.grad for leaf in leaves)))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)

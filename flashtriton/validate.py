"""`flashtriton validate`: run the kernels on this machine and check them against the float64 reference.

Sections: every public API path with every feature (tolerance rule + NaN/Inf), a forward accuracy sweep
(relative L_inf, cosine and the tolerance rule), backward gradients (tolerance rule with factor 3), edge probes
(including dropout: the keep mask read back from S_dmask, out and gradients against the reference with that
mask, the drop rate) and, on CUDA, a latency table. The API paths include the varlen functions (packed, and
the paged K/V form of flash_attn_varlen_func, forward only) on mixed lengths with a 0- and a 1-length sequence, max_seqlen upper bounds
and uncovered rows after the last sequence; they are checked against the float64 varlen reference. An edge probe
checks that varlen on equal lengths is bitwise the dense result. flash_attn_with_kvcache is checked on a contiguous
and a paged cache (page size 48) against the float64 kvcache reference: out, lse, and the caches after the append
(bit-exact; rotated keys within 1e-3 or one ulp), with num_splits 3 and 1 agreeing.

On CPU the kernels run through Triton's interpreter: the command re-executes itself with TRITON_INTERPRET=1 when
needed. bf16 is then left out: Triton 3.6-3.9's interpreter computes a bf16 tl.dot as an integer matmul on
the raw bits (a Triton bug; the library does not patch Triton), so only a GPU run validates bf16.

The tolerance rule is flashtriton.testing's: max|kernel - ref| <= factor * max|pt - ref| + atol, with `pt` the
same reference computed in the input dtype ("vs PyTorch" in the tables is max|kernel - ref| / max|pt - ref|).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from . import bench
from .interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                        flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from .ops import backend
from .reference import attention_reference, kvcache_reference
from .testing import (Case, ErrorCheck, check_error, check_lse, compare_varlen_with_reference,
                      compare_with_reference, cu_seqlens, make_case_inputs, poisoned_outputs)

COSINE_GATE = 0.9995
OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
# --inject-fault multiplies the softmax scale given to the kernels (not the reference's) by this factor.
FAULT_SCALE_FACTOR = 1.01
REPORT_STEM = "validate"

FUNCTIONS = {fn.__name__: fn for fn in (flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func,
                                         flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func,
                                         flash_attn_varlen_kvpacked_func)}
# Page sizes of the paged K/V checks: one that is not a power of two, one that is.
PAGE_SIZES = (48, 16)
# Varlen inputs get this many rows after the last sequence (they must come back 0), and the kernels get
# max_seqlen = true maximum + this slack (max_seqlen is an upper bound in the API).
VARLEN_TAIL = 3
MAX_SEQLEN_SLACK = 4
# flash_attn_with_kvcache: the page size of its paged cache (not a power of two); the tolerance factors of out
# (ALiBi's larger); how far rotated keys written into the cache may be from the reference's; how far out of
# num_splits=3 may be from out of num_splits=1 (they differ only in rounding).
KVCACHE_PAGE_SIZE = 48
KVCACHE_OUT_FACTOR = 3.0
KVCACHE_ALIBI_OUT_FACTOR = 5.0
ROTARY_K_CACHE_ATOL = 1e-3
DROPOUT_P = 0.17


def rotated_key_tolerance(ref_k_cache: torch.Tensor) -> float:
    """1e-3, or one ulp of the cache dtype at its largest key if that is more: rotating in fp32 and rounding
    may land one step apart when the GPU fuses a multiply-add that the reference does not."""
    ulp = torch.finfo(ref_k_cache.dtype).eps * float(ref_k_cache.detach().abs().max())
    return max(ROTARY_K_CACHE_ATOL, ulp)
SPLIT_AGREEMENT_ATOL = 2e-3


@dataclass(frozen=True)
class ApiPath:
    """A public function; for flash_attn_varlen_func and flash_attn_with_kvcache also the page size of a paged K/V
    cache (block_table)."""

    function: str
    page_size: Optional[int] = None

    @property
    def name(self) -> str:
        return self.function if self.page_size is None else f"{self.function} paged{self.page_size}"

    @property
    def is_varlen(self) -> bool:
        return "varlen" in self.function

    @property
    def packing(self) -> str:
        """What the function packs into one tensor: 'qkv', 'kv', or '' for separate q, k, v."""
        return "qkv" if "qkvpacked" in self.function else "kv" if "kvpacked" in self.function else ""

    @property
    def has_backward(self) -> bool:
        return self.page_size is None


DENSE_PATH = ApiPath("flash_attn_func")
VARLEN_PATH = ApiPath("flash_attn_varlen_func")
API_PATHS = (tuple(ApiPath(name) for name in FUNCTIONS)
             + tuple(ApiPath(VARLEN_PATH.function, page_size) for page_size in PAGE_SIZES))
KVCACHE_PATHS = tuple(ApiPath(flash_attn_with_kvcache.__name__, page_size) for page_size in (None, KVCACHE_PAGE_SIZE))
SECTIONS = ("api", "accuracy", "backward", "edge")


def emit(text: str = "") -> None:
    """The command's user-facing output."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


@dataclass(frozen=True)
class Plan:
    """Sizes of one validation run (interpreter sizes on CPU, larger ones on CUDA)."""

    batch: int
    heads: int
    api_seqlen: int
    api_head_dim: int
    api_dtypes: tuple
    sweep_seqlens: tuple    # (seqlen_q, seqlen_k) pairs
    sweep_head_dims: tuple
    bwd_cases: tuple        # (seqlen_q, seqlen_k, head_dim)
    edge_seqlen: int
    varlen_lens: tuple      # (lens_q, lens_k) of the varlen API paths
    latency_shapes: tuple = ()
    kv_batch: int = 2       # flash_attn_with_kvcache: batch rows and keys each cache row holds
    kv_capacity: int = 96

    @property
    def window(self) -> tuple:
        """(32, 32) at interpreter sizes, a quarter of the sequence on each side at GPU sizes."""
        side = max(32, self.api_seqlen // 4)
        return side, side


INTERPRETER_BF16_NOTE = ("interpreter: bf16 not validated (Triton's interpreter computes bf16 tl.dot as an integer "
                         "matmul); run `flashtriton validate` on a GPU for bf16")


def validated_dtypes() -> tuple:
    """fp16 and bf16, or fp16 alone under Triton's interpreter (see the module docstring)."""
    return (torch.float16,) if backend.KERNELS_INTERPRETED else (torch.float16, torch.bfloat16)


def make_plan(device_type: str, full: bool) -> Plan:
    both = validated_dtypes()
    # Sequences with Sq > Sk, an empty query, a 1-length one, queries without any key and Sq < Sk.
    cpu_varlen = ((40, 0, 1, 30, 18), (23, 9, 1, 0, 61))
    if device_type == "cpu":
        if not full:
            return Plan(1, 2, 96, 64, (torch.float16,), ((128, 128), (77, 113)), (64, 128),
                        ((128, 128, 64), (113, 77, 128)), 64, cpu_varlen)
        return Plan(2, 2, 96, 64, both, ((17, 17), (64, 64), (128, 128), (77, 113), (113, 77), (200, 200)),
                    (32, 40, 64, 96, 128, 256),
                    ((17, 17, 32), (64, 64, 64), (128, 128, 128), (77, 113, 96), (113, 77, 64), (128, 128, 256)), 96,
                    (cpu_varlen[0] + (77,), cpu_varlen[1] + (128,)), kv_batch=3, kv_capacity=128)
    quick_latency = (bench.Shape(4, 4096, 16, 128),)
    gpu_varlen = ((700, 0, 1, 300, 517, 128), (411, 64, 1, 0, 1000, 128))
    if not full:
        return Plan(2, 4, 512, 128, (torch.float16,), ((128, 128), (1024, 1024), (333, 1000)), (64, 128, 256),
                    ((1024, 1024, 128), (333, 1000, 64), (1000, 333, 256)), 256, gpu_varlen, quick_latency,
                    kv_batch=4, kv_capacity=1000)
    return Plan(2, 4, 1024, 128, both,
                ((1, 1), (128, 128), (1024, 1024), (333, 1000), (1000, 333), (2048, 2048), (4096, 4096)),
                (32, 64, 96, 128, 256),
                ((1024, 1024, 128), (333, 1000, 64), (1000, 333, 256), (2048, 2048, 128), (4096, 4096, 64)), 512,
                (gpu_varlen[0] + (2049,), gpu_varlen[1] + (3000,)),
                quick_latency + (bench.Shape(4, 4096, 32, 64), bench.Shape(4, 4096, 8, 256),
                                 bench.Shape(1, 16384, 16, 128)),
                kv_batch=5, kv_capacity=5000)


@dataclass
class CheckResult:
    """One validated case. max_error/pytorch_error describe its worst comparison (named by `worst`)."""

    section: str
    case: str
    passed: bool
    worst: str = ""
    max_error: Optional[float] = None
    pytorch_error: Optional[float] = None
    detail: str = ""
    measures: list = field(default_factory=list)
    seconds: Optional[float] = None

    @property
    def ratio(self) -> Optional[float]:
        if self.max_error is None or not self.pytorch_error:
            return None
        return self.max_error / self.pytorch_error


@dataclass
class Check:
    section: str
    label: str
    run: Callable[[], CheckResult]


@dataclass(frozen=True)
class VarlenBatch:
    """The sequences of a varlen call: lengths, the max_seqlen arguments and uncovered rows after the last one."""

    lens_q: tuple
    lens_k: tuple
    max_seqlen_q: int
    max_seqlen_k: int
    tail: int = VARLEN_TAIL

    @classmethod
    def from_lengths(cls, lens_q: Sequence[int], lens_k: Sequence[int], slack: int = MAX_SEQLEN_SLACK,
                     tail: int = VARLEN_TAIL) -> "VarlenBatch":
        return cls(tuple(lens_q), tuple(lens_k), max(lens_q) + slack, max(lens_k) + slack, tail)

    @property
    def total_q(self) -> int:
        return sum(self.lens_q) + self.tail

    @property
    def total_k(self) -> int:
        return sum(self.lens_k) + self.tail

    def cu_seqlens(self, device) -> tuple:
        """(cu_seqlens_q, cu_seqlens_k), int32 cumulative starts."""
        return tuple(cu_seqlens(lens, device) for lens in (self.lens_q, self.lens_k))


@dataclass(frozen=True)
class KVCase:
    """One flash_attn_with_kvcache configuration: seqlen_new keys appended to caches of `capacity` keys per row
    (paged: rounded up to whole pages), then seqlen_q queries attend to each row's keys."""

    batch: int
    capacity: int
    num_heads: int
    num_heads_k: int
    head_dim: int
    dtype: torch.dtype
    seqlen_q: int = 1
    seqlen_new: int = 1
    causal: bool = False
    softcap: float = 0.0
    alibi: bool = False
    rotary_dim: int = 0             # 0: no rotary; else interleaved (GPT-J) rotary on that many features
    batch_idx_leftpad: bool = False  # cache_batch_idx into a cache of batch + 2 rows, and cache_leftpad
    page_size: Optional[int] = None
    num_splits: tuple = (0,)        # each value is run and checked; several must agree with each other
    softmax_scale: Optional[float] = None

    @property
    def pages_per_row(self) -> int:
        return -(-self.capacity // self.page_size)

    @property
    def row_capacity(self) -> int:
        return self.capacity if self.page_size is None else self.pages_per_row * self.page_size


def make_kvcache_inputs(case: KVCase, device) -> tuple:
    """(q, k_cache, v_cache, keyword arguments of flash_attn_with_kvcache and kvcache_reference), in case.dtype.

    Row 0's new keys end exactly at the capacity; paged, row 1's start at the last slot of a page; the next row's
    cache is empty; further rows are random. Paged caches have shuffled pages and one page that no row uses.
    """
    gen = dict(device=device)
    room = case.row_capacity - case.seqlen_new
    lengths = torch.randint(0, room + 1, (case.batch,), **gen)
    edges = (room, 0) if case.page_size is None else (room, min(room, case.page_size - 1), 0)
    for row, length in enumerate(edges[:case.batch]):
        lengths[row] = length
    inputs = dict(cache_seqlens=lengths.to(torch.int32))
    cache_rows = case.batch + 2 if case.batch_idx_leftpad else case.batch
    cache_shape = (cache_rows, case.capacity, case.num_heads_k, case.head_dim)
    if case.page_size is not None:
        num_pages = case.batch * case.pages_per_row + 1
        table = torch.randperm(num_pages, **gen)[:case.batch * case.pages_per_row]
        inputs["block_table"] = table.view(case.batch, case.pages_per_row).to(torch.int32)
        cache_shape = (num_pages, case.page_size, case.num_heads_k, case.head_dim)
    k_cache, v_cache = (torch.randn(cache_shape, **gen).to(case.dtype) for _ in range(2))
    new_shape = (case.batch, case.seqlen_new, case.num_heads_k, case.head_dim)
    inputs["k"], inputs["v"] = (torch.randn(new_shape, **gen).to(case.dtype) for _ in range(2))
    if case.batch_idx_leftpad:
        inputs["cache_batch_idx"] = torch.randperm(cache_rows, **gen)[:case.batch].to(torch.int32)
        leftpad = torch.randint(0, 40, (case.batch,), **gen).minimum(lengths)
        inputs["cache_leftpad"] = leftpad.to(torch.int32)
    if case.rotary_dim:
        angles = torch.rand(case.row_capacity, case.rotary_dim // 2, **gen) * 6.28
        inputs.update(rotary_cos=angles.cos().to(case.dtype), rotary_sin=angles.sin().to(case.dtype),
                      rotary_interleaved=True)
    if case.alibi:
        inputs["alibi_slopes"] = torch.rand(case.num_heads, **gen) * 0.5
    q = torch.randn(case.batch, case.seqlen_q, case.num_heads, case.head_dim, **gen).to(case.dtype)
    return q, k_cache, v_cache, inputs


@dataclass
class Outcome:
    """What one kernel call produced, with the inputs it was given (varlen: packed rows, and their sequences)."""

    case: Case
    inputs: tuple           # q, k, v, alibi_slopes
    out: torch.Tensor
    lse: torch.Tensor
    s_dmask: torch.Tensor
    grads: Optional[tuple] = None
    dout: Optional[torch.Tensor] = None
    varlen: Optional[VarlenBatch] = None


def _measure(check: ErrorCheck) -> dict:
    return {"name": check.name, "max_error": check.max_error, "pytorch_error": check.pytorch_error,
            "bound": check.bound, "finite": check.finite, "ok": check.ok}


def _failure_text(check: ErrorCheck) -> str:
    if not check.finite:
        return f"{check.name} not finite"
    return f"{check.name} error {check.max_error:.2e} > bound {check.bound:.2e}"


def summarize(section: str, case: str, checks: Sequence[ErrorCheck], failures: Sequence[str] = (),
              extra: Sequence[dict] = ()) -> CheckResult:
    """One CheckResult from tolerance-rule checks plus named extra failures; reports the worst check."""
    def badness(c: ErrorCheck):
        return (not c.ok, c.max_error / c.bound if c.bound > 0 else float("inf"))

    failed = [_failure_text(c) for c in checks if not c.ok] + list(failures)
    worst = max(checks, key=badness) if checks else None
    return CheckResult(section, case, not failed, worst.name if worst else "",
                       worst.max_error if worst else None, worst.pytorch_error if worst else None,
                       "; ".join(failed), [_measure(c) for c in checks] + list(extra))


class Validator:
    """Builds and runs the checks of a plan on one device; `fault_factor` corrupts the kernels' softmax scale."""

    def __init__(self, device: str, plan: Plan, fault_factor: float = 1.0):
        self.device = device
        self.plan = plan
        self.fault_factor = fault_factor

    # ---- calling the kernels ----------------------------------------------------------------------------------

    def kernel_scale(self, case) -> Optional[float]:
        """The softmax_scale passed to the kernels: the case's (None = default) unless a fault is injected.

        `case` is a Case or a KVCase.
        """
        if self.fault_factor == 1.0:
            return case.softmax_scale
        return (case.softmax_scale or case.head_dim ** -0.5) * self.fault_factor

    def run_kernels(self, case: Case, path: ApiPath = DENSE_PATH, with_grad: bool = True,
                    input_scale: float = 1.0, inputs: Optional[tuple] = None, dout: Optional[torch.Tensor] = None,
                    varlen: Optional[VarlenBatch] = None) -> Outcome:
        """One forward (and backward) through a public API path, with NaN-poisoned output buffers.

        Varlen paths need `varlen`; their inputs are packed rows (total, heads, head_dim).
        """
        if inputs is None:
            inputs = (make_case_inputs(case, self.device, scale=input_scale) if varlen is None
                      else make_varlen_inputs(case, varlen, self.device, scale=input_scale))
        q, k, v, slopes = inputs
        options = dict(softmax_scale=self.kernel_scale(case), causal=case.causal, window_size=case.window_size,
                       softcap=case.softcap, alibi_slopes=slopes, return_attn_probs=True)
        leaves, call = _api_call(path, q, k, v, with_grad, varlen)
        with poisoned_outputs(), torch.set_grad_enabled(with_grad):
            out, lse, s_dmask = call(**options)
            grads = None
            if with_grad:
                dout = torch.randn_like(out) if dout is None else dout
                grads = _unpack_grads(path, torch.autograd.grad(out, leaves, dout), pack_dim=q.dim() - 2)
        return Outcome(case, (q, k, v, slopes), out.detach(), lse, s_dmask, grads, dout, varlen)

    def tolerance_checks(self, outcome: Outcome) -> list[ErrorCheck]:
        q, k, v, slopes = outcome.inputs
        if outcome.varlen is not None:
            return varlen_checks(outcome)
        return compare_with_reference(outcome.case, outcome.out, outcome.lse, q, k, v, slopes, outcome.grads,
                                      outcome.dout, grad_factor=GRAD_FACTOR)

    # ---- sections ---------------------------------------------------------------------------------------------

    def checks(self, sections: Sequence[str] = SECTIONS) -> list[Check]:
        builders = {"api": self.api_checks, "accuracy": self.accuracy_checks, "backward": self.backward_checks,
                    "edge": self.edge_checks}
        return [check for name in sections for check in builders[name]()]

    def base_case(self, **changes) -> Case:
        plan = self.plan
        case = Case(batch=plan.batch, seqlen_q=plan.api_seqlen, seqlen_k=plan.api_seqlen, num_heads=plan.heads,
                    num_heads_k=plan.heads, head_dim=plan.api_head_dim)
        return replace(case, **changes)

    def api_variants(self, dtype: torch.dtype) -> dict:
        heads = self.plan.heads
        return {
            "base": self.base_case(dtype=dtype),
            "causal": self.base_case(dtype=dtype, causal=True),
            "window": self.base_case(dtype=dtype, window_size=self.plan.window),
            "alibi": self.base_case(dtype=dtype, alibi=True),
            "softcap": self.base_case(dtype=dtype, softcap=2.0),
            "gqa": self.base_case(dtype=dtype, num_heads=2 * heads, num_heads_k=heads),
        }

    def api_checks(self) -> list[Check]:
        checks = []
        for dtype in self.plan.api_dtypes:
            for variant, case in self.api_variants(dtype).items():
                for path in API_PATHS:
                    if path.packing == "qkv" and case.num_heads != case.num_heads_k:
                        continue  # qkvpacked has H == Hk by construction
                    label = f"{path.name} {variant} {_dtype_name(dtype)}"
                    checks.append(Check("api", label, lambda c=case, p=path, n=label: self.check_api(n, c, p)))
            for path in KVCACHE_PATHS:
                for variant, case in self.kvcache_variants(dtype).items():
                    if path.page_size is not None and case.batch_idx_leftpad:
                        continue  # flash_attn rejects cache_batch_idx and cache_leftpad with a paged cache
                    case = replace(case, page_size=path.page_size)
                    label = f"{path.name} {variant} {_dtype_name(dtype)}"
                    checks.append(Check("api", label, lambda c=case, n=label: self.check_kvcache(n, c)))
        return checks

    def kvcache_variants(self, dtype: torch.dtype) -> dict:
        plan = self.plan
        base = KVCase(plan.kv_batch, plan.kv_capacity, plan.heads, plan.heads, plan.api_head_dim, dtype)
        chunk = replace(base, seqlen_q=5, seqlen_new=5, causal=True)
        return {
            "decode": base,
            "chunk": chunk,
            "rotary": replace(chunk, rotary_dim=32),
            "batch_idx+leftpad": replace(base, seqlen_q=2, seqlen_new=2, causal=True, batch_idx_leftpad=True),
            "alibi": replace(chunk, alibi=True),
            "softcap": replace(base, seqlen_q=2, softcap=2.0),
            "gqa": replace(base, num_heads=2 * plan.heads),
            "num_splits 3 vs 1": replace(base, num_splits=(3, 1)),
        }

    def varlen_batch(self, path: ApiPath) -> Optional[VarlenBatch]:
        """The plan's sequences for a varlen path (qkvpacked: the query lengths for keys too); None if dense."""
        if not path.is_varlen:
            return None
        lens_q, lens_k = self.plan.varlen_lens
        return VarlenBatch.from_lengths(lens_q, lens_q if path.packing == "qkv" else lens_k)

    def check_api(self, label: str, case: Case, path: ApiPath) -> CheckResult:
        outcome = self.run_kernels(case, path, with_grad=path.has_backward, varlen=self.varlen_batch(path))
        failures = [] if outcome.s_dmask.shape == (0,) else [f"S_dmask shape {tuple(outcome.s_dmask.shape)}"]
        if outcome.varlen is not None:
            failures += uncovered_row_failures(outcome)
        return summarize("api", label, self.tolerance_checks(outcome), failures)

    def check_kvcache(self, label: str, case: KVCase) -> CheckResult:
        """flash_attn_with_kvcache on fresh caches per num_splits value: out, lse and both caches after the append
        against kvcache_reference; with several num_splits values, out and lse of each against the first's."""
        q, k_cache, v_cache, inputs = make_kvcache_inputs(case, self.device)
        options = dict(inputs, softmax_scale=case.softmax_scale, causal=case.causal, softcap=case.softcap)
        ref_out, ref_lse, ref_k_cache, ref_v_cache = kvcache_reference(q, k_cache, v_cache, **options)
        pt_out = kvcache_reference(q, k_cache, v_cache, **options, compute_dtype=None)[0]
        factor = KVCACHE_ALIBI_OUT_FACTOR if case.alibi else KVCACHE_OUT_FACTOR
        k_atol = rotated_key_tolerance(ref_k_cache) if case.rotary_dim else 0.0
        kernel_options = dict(options, softmax_scale=self.kernel_scale(case), return_softmax_lse=True)
        checks, failures, extra, results = [], [], [], {}
        for splits in case.num_splits:
            suffix = f" (num_splits={splits})" if len(case.num_splits) > 1 else ""
            caches = (k_cache.clone(), v_cache.clone())
            with poisoned_outputs():
                out, lse = flash_attn_with_kvcache(q, *caches, **kernel_options, num_splits=splits)
            results[splits] = out, lse
            checks += [replace(check_error("out", out, ref_out, pt_out, factor=factor), name="out" + suffix),
                       replace(check_lse(lse, ref_lse), name="lse" + suffix)]
            for name, cache, ref_cache, atol in zip(("k_cache", "v_cache"), caches, (ref_k_cache, ref_v_cache),
                                                    (k_atol, 0.0)):
                error = float((cache.double() - ref_cache.double()).abs().nan_to_num(nan=float("inf")).max())
                extra.append({"name": name + suffix, "max_error": error, "bound": atol, "ok": error <= atol})
                if not error <= atol:
                    failures.append(f"{name}{suffix} after the append differs from the reference by {error:.3e} "
                                    f"(allowed {atol:g})")
        first, *others = case.num_splits
        for splits in others:
            agreement = self.split_agreement(results[splits], results[first], f"num_splits={first} vs {splits}")
            extra += agreement
            failures += [f"{m['name']} disagree (max difference {m['max_error']:.3e}, bound {m['bound']:.1e})"
                         for m in agreement if not m["ok"]]
        return summarize("api", label, checks, failures, extra)

    @staticmethod
    def split_agreement(result: tuple, first: tuple, what: str) -> list[dict]:
        """Measures of out (absolute) and lse (check_lse's rule) of one split count against another's."""
        out_error = float((result[0].double() - first[0].double()).abs().nan_to_num(nan=float("inf")).max())
        lse = check_lse(result[1], first[1])
        return [{"name": f"out {what}", "max_error": out_error, "bound": SPLIT_AGREEMENT_ATOL,
                 "ok": out_error <= SPLIT_AGREEMENT_ATOL},
                {"name": f"lse {what}", "max_error": lse.max_error, "bound": lse.bound, "ok": lse.ok}]

    def accuracy_checks(self) -> list[Check]:
        plan, checks = self.plan, []
        for dtype in validated_dtypes():
            for seqlen_q, seqlen_k in plan.sweep_seqlens:
                for head_dim in plan.sweep_head_dims:
                    for causal in (False, True):
                        case = Case(plan.batch, seqlen_q, seqlen_k, plan.heads, plan.heads, head_dim, dtype, causal)
                        checks.append(Check("accuracy", case.label(), lambda c=case: self.check_accuracy(c)))
        return checks

    def check_accuracy(self, case: Case) -> CheckResult:
        """Forward only: tolerance rule, relative L_inf and cosine similarity against float64."""
        outcome = self.run_kernels(case, with_grad=False)
        q, k, v, _ = outcome.inputs
        options = (case.softmax_scale, case.causal, case.window_size, case.softcap, None)
        ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), *options, compute_dtype=torch.float64)
        pt, _ = attention_reference(q, k, v, *options, compute_dtype=None)
        checks = [check_error("out", outcome.out, ref, pt, factor=OUT_FACTOR), check_lse(outcome.lse, ref_lse)]
        rel = bench.relative_linf(outcome.out, ref)
        cosine = _cosine(outcome.out, ref)
        gate = bench.REL_LINF_GATES[case.dtype]
        failures = []
        if not rel <= gate:
            failures.append(f"rel_Linf {rel:.3e} > {gate:g}")
        if not cosine >= COSINE_GATE:
            failures.append(f"cosine {cosine:.6f} < {COSINE_GATE}")
        extra = [{"name": "rel_Linf", "value": rel, "gate": gate}, {"name": "cosine", "value": cosine,
                                                                    "gate": COSINE_GATE}]
        result = summarize("accuracy", case.label(), checks, failures, extra)
        result.detail = result.detail or f"rel_Linf {rel:.2e}, cosine {cosine:.6f}"
        return result

    def backward_checks(self) -> list[Check]:
        plan, checks = self.plan, []
        for dtype in validated_dtypes():
            for seqlen_q, seqlen_k, head_dim in plan.bwd_cases:
                for causal in (False, True):
                    case = Case(plan.batch, seqlen_q, seqlen_k, plan.heads, plan.heads, head_dim, dtype, causal)
                    checks.append(Check("backward", case.label(), lambda c=case: self.check_tolerance("backward", c)))
        return checks

    def check_tolerance(self, section: str, case: Case, input_scale: float = 1.0, label: str = "") -> CheckResult:
        outcome = self.run_kernels(case, input_scale=input_scale)
        return summarize(section, label or case.label(), self.tolerance_checks(outcome))

    def edge_checks(self) -> list[Check]:
        seqlen = self.plan.edge_seqlen
        base = self.base_case(seqlen_q=seqlen, seqlen_k=seqlen, head_dim=64)
        probes = {
            "Sq=1": lambda: self.check_tolerance("edge", replace(base, seqlen_q=1), label="Sq=1"),
            "Sq=2 causal": lambda: self.check_tolerance("edge", replace(base, seqlen_q=2, causal=True),
                                                        label="Sq=2 causal"),
            "H=1": lambda: self.check_tolerance("edge", replace(base, num_heads=1, num_heads_k=1), label="H=1"),
            "D=256": lambda: self.check_tolerance("edge", replace(base, head_dim=256), label="D=256"),
            "window (0,0) is V": lambda: self.check_window_zero(replace(base, window_size=(0, 0))),
            "softcap+causal, inputs x5": lambda: self.check_tolerance(
                "edge", replace(base, causal=True, softcap=5.0), input_scale=5.0, label="softcap+causal, inputs x5"),
            "no visible key": lambda: self.check_empty_rows(replace(base, seqlen_q=seqlen + 33, seqlen_k=seqlen // 2,
                                                                    causal=True)),
            "determinism": lambda: self.check_determinism(replace(base, causal=True, num_heads=2 * base.num_heads)),
            "varlen = dense": lambda: self.check_varlen_equals_dense(
                replace(base, batch=3, causal=True, alibi=True, num_heads=2 * base.num_heads)),
            "dropout": lambda: self.check_dropout(replace(base, causal=True, num_heads=2 * base.num_heads)),
        }
        return [Check("edge", name, run) for name, run in probes.items()]

    def check_dropout(self, case: Case) -> CheckResult:
        """flash_attn_func with dropout: the keep mask read back from S_dmask, out and gradients against the
        reference with that mask (tolerance rule), the drop rate within 0.02 of p, LSE independent of dropout."""
        q, k, v, _ = make_case_inputs(case, self.device, requires_grad=True)
        scale = self.kernel_scale(case)
        with poisoned_outputs():
            out, lse, s_dmask = flash_attn_func(q, k, v, DROPOUT_P, scale, case.causal, return_attn_probs=True)
            dout = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        keep = ~torch.signbit(s_dmask[:, :, : case.seqlen_q, : case.seqlen_k])
        visible = s_dmask[:, :, : case.seqlen_q, : case.seqlen_k] != 0
        drop_rate = 1.0 - float((keep & visible).sum()) / max(1, int(visible.sum()))
        checks = compare_with_reference(replace(case, window_size=(-1, -1), softcap=0.0, alibi=False), out, lse,
                                        q, k, v, None, grads, dout, grad_factor=GRAD_FACTOR, dropout_p=DROPOUT_P,
                                        dropout_mask=keep)
        rate_ok = abs(drop_rate - DROPOUT_P) <= 0.02
        failures = [] if rate_ok else [f"drop rate {drop_rate:.3f}, expected {DROPOUT_P} +- 0.02"]
        extra = [{"name": "drop rate", "max_error": abs(drop_rate - DROPOUT_P), "bound": 0.02, "ok": rate_ok}]
        return summarize("edge", "dropout", checks, failures, extra)

    def check_window_zero(self, case: Case) -> CheckResult:
        """window (0, 0) with Sq == Sk: each row sees only its aligned key, so out must equal V exactly."""
        outcome = self.run_kernels(case, with_grad=False)
        v = outcome.inputs[2]
        error = float((outcome.out.double() - v.double()).abs().nan_to_num(nan=float("inf")).max())
        exact = torch.equal(outcome.out, v)
        return CheckResult("edge", "window (0,0) is V", exact, "out", error, None,
                           "" if exact else f"out differs from V by up to {error:.3e}",
                           [{"name": "out == V", "max_error": error, "ok": exact}])

    def check_empty_rows(self, case: Case) -> CheckResult:
        """Causal with Sq > Sk: the top Sq - Sk rows see no key; out 0, lse +inf, their dq 0, all finite."""
        outcome = self.run_kernels(case)
        empty = case.seqlen_q - case.seqlen_k
        failures = []
        if not torch.equal(outcome.out[:, :empty], torch.zeros_like(outcome.out[:, :empty])):
            failures.append("out of rows without keys is not exactly 0")
        if not bool((outcome.lse[:, :, :empty] == float("inf")).all()):
            failures.append("lse of rows without keys is not +inf")
        if not torch.equal(outcome.grads[0][:, :empty], torch.zeros_like(outcome.grads[0][:, :empty])):
            failures.append("dq of rows without keys is not 0")
        label = f"no visible key (Sq={case.seqlen_q}, Sk={case.seqlen_k}, causal)"
        return summarize("edge", label, self.tolerance_checks(outcome), failures)

    def check_determinism(self, case: Case) -> CheckResult:
        """Two identical calls must give bitwise-equal out, lse, dq, dk, dv."""
        first = self.run_kernels(case)
        second = self.run_kernels(case, inputs=first.inputs, dout=first.dout)
        pairs = {"out": (first.out, second.out), "lse": (first.lse, second.lse)}
        pairs.update({name: pair for name, pair in zip(("dq", "dk", "dv"), zip(first.grads, second.grads))})
        differing = [name for name, (a, b) in pairs.items() if not torch.equal(a, b)]
        extra = [{"name": f"{name} bitwise equal", "ok": name not in differing} for name in pairs]
        failures = [f"{', '.join(differing)} differ between two identical calls"] if differing else []
        return CheckResult("edge", f"determinism ({case.label()})", not failures, detail="; ".join(failures),
                           measures=extra)

    def check_varlen_equals_dense(self, case: Case) -> CheckResult:
        """flash_attn_varlen_func on a batch of equal lengths must give the dense call's results bitwise."""
        dense = self.run_kernels(case)
        q, k, v, slopes = dense.inputs
        lengths = (case.seqlen_q,) * case.batch
        batch = VarlenBatch.from_lengths(lengths, lengths, slack=0, tail=0)
        packed = (q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), slopes)
        varlen = self.run_kernels(case, VARLEN_PATH, inputs=packed, dout=dense.dout.flatten(0, 1), varlen=batch)
        pairs = {"out": (varlen.out, dense.out.flatten(0, 1)),
                 "lse": (varlen.lse, dense.lse.transpose(0, 1).flatten(1))}
        pairs.update({name: (grad, dense_grad.flatten(0, 1))
                      for name, grad, dense_grad in zip(("dq", "dk", "dv"), varlen.grads, dense.grads)})
        differing = [name for name, (a, b) in pairs.items() if not torch.equal(a, b)]
        extra = [{"name": f"{name} bitwise equal", "ok": name not in differing} for name in pairs]
        failures = [f"{', '.join(differing)} of varlen differ from dense"] if differing else []
        return CheckResult("edge", f"varlen = dense, equal lengths ({case.label()})", not failures,
                           detail="; ".join(failures), measures=extra)


def make_varlen_inputs(case: Case, batch: VarlenBatch, device="cpu", scale: float = 1.0) -> tuple:
    """Fresh random packed (q (total_q, H, D), k, v (total_k, Hk, D), alibi_slopes (batch, H)), in case.dtype.

    Only the case's heads, head dim, dtype and alibi flag are used; the rows come from `batch`.
    """
    shape_q = (batch.total_q, case.num_heads, case.head_dim)
    shape_k = (batch.total_k, case.num_heads_k, case.head_dim)
    q, k, v = ((torch.randn(shape, device=device) * scale).to(case.dtype) for shape in (shape_q, shape_k, shape_k))
    slopes = None
    if case.alibi:
        slopes = torch.rand(len(batch.lens_q), case.num_heads, device=device, dtype=torch.float32) * 0.5
    return q, k, v, slopes


def paginate(k: torch.Tensor, v: torch.Tensor, batch: VarlenBatch, page_size: int) -> tuple:
    """(k_cache, v_cache, block_table): each sequence's keys scattered into shuffled pages of a random cache."""
    num_seqs = len(batch.lens_k)
    pages_per_seq = -(-batch.max_seqlen_k // page_size)
    num_pages = num_seqs * pages_per_seq + 2  # two pages no sequence uses
    block_table = torch.randperm(num_pages, device=k.device)[: num_seqs * pages_per_seq]
    block_table = block_table.view(num_seqs, pages_per_seq).to(torch.int32)
    caches = []
    for packed in (k, v):
        cache = torch.randn(num_pages, page_size, *packed.shape[1:], device=k.device).to(packed.dtype)
        start = 0
        for seq, length in enumerate(batch.lens_k):
            positions = torch.arange(length, device=k.device)
            pages = block_table[seq, positions // page_size].long()
            cache[pages, positions % page_size] = packed.detach()[start:start + length]
            start += length
        caches.append(cache)
    return caches[0], caches[1], block_table


def _api_call(path: ApiPath, q, k, v, with_grad: bool, varlen: Optional[VarlenBatch] = None):
    """(leaves to differentiate, fn(**options) -> (out, lse, S_dmask)) for one public API path."""
    def leaf(t):
        return t.detach().clone().requires_grad_(with_grad)

    function = FUNCTIONS[path.function]
    pack_dim = q.dim() - 2
    extra = {}
    if path.packing == "qkv":
        leaves = (leaf(torch.stack((q, k, v), dim=pack_dim)),)
    elif path.packing == "kv":
        leaves = (leaf(q), leaf(torch.stack((k, v), dim=pack_dim)))
    elif path.page_size is not None:
        k_cache, v_cache, extra["block_table"] = paginate(k, v, varlen, path.page_size)
        leaves = (leaf(q), leaf(k_cache), leaf(v_cache))
    else:
        leaves = (leaf(q), leaf(k), leaf(v))
    sequences = ()
    if path.is_varlen:
        cu_seqlens_q, cu_seqlens_k = varlen.cu_seqlens(q.device)
        sequences = ((cu_seqlens_q, varlen.max_seqlen_q) if path.packing == "qkv"
                     else (cu_seqlens_q, cu_seqlens_k, varlen.max_seqlen_q, varlen.max_seqlen_k))
    return leaves, lambda **o: function(*leaves, *sequences, **o, **extra)


def _unpack_grads(path: ApiPath, grads, pack_dim: int) -> tuple:
    """(dq, dk, dv) from the gradients of an API path's leaves; packed leaves stack along pack_dim."""
    if path.packing == "qkv":
        return tuple(grads[0].unbind(dim=pack_dim))
    if path.packing == "kv":
        return (grads[0], *grads[1].unbind(dim=pack_dim))
    return tuple(grads)


def varlen_checks(outcome: Outcome) -> list[ErrorCheck]:
    """ErrorChecks of a varlen outcome against attention_reference_varlen (testing.compare_varlen_with_reference)."""
    case, batch = outcome.case, outcome.varlen
    q, k, v, slopes = outcome.inputs
    cu_seqlens_q, cu_seqlens_k = batch.cu_seqlens(q.device)
    return compare_varlen_with_reference(outcome.out, outcome.lse, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                         batch.max_seqlen_k, outcome.grads, outcome.dout, out_factor=OUT_FACTOR,
                                         grad_factor=GRAD_FACTOR, softmax_scale=case.softmax_scale,
                                         causal=case.causal, window_size=case.window_size, softcap=case.softcap,
                                         alibi_slopes=slopes)


def uncovered_row_failures(outcome: Outcome) -> list[str]:
    """Rows after the last sequence must come back exactly 0 in out (and dq, dk, dv), never NaN."""
    covered_q, covered_k = sum(outcome.varlen.lens_q), sum(outcome.varlen.lens_k)
    tensors = {"out": outcome.out[covered_q:]}
    if outcome.grads is not None:
        tensors.update({name: grad[covered:] for name, grad, covered in zip(
            ("dq", "dk", "dv"), outcome.grads, (covered_q, covered_k, covered_k))})
    return [f"{name} of uncovered rows is not 0" for name, rows in tensors.items() if not bool((rows == 0).all())]


def _cosine(actual: torch.Tensor, ref: torch.Tensor) -> float:
    a, b = actual.double().flatten(), ref.double().flatten()
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


# ----------------------------------------------------------------------------------------------------------------
# Running, reporting and the command
# ----------------------------------------------------------------------------------------------------------------

class Progress:
    """A progress indicator on stderr: one rewritten line on a terminal, one line per step otherwise."""

    def __init__(self, total: int, stream=None):
        self.total = total
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty()
        self.width = 0

    def update(self, done: int, label: str, total: Optional[int] = None) -> None:
        self.total = self.total if total is None else total
        text = f"[{done:>{len(str(self.total))}}/{self.total}] {label}"
        if self.interactive:
            self.stream.write("\r" + text.ljust(self.width))
            self.width = max(self.width, len(text))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.interactive and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


@dataclass
class Report:
    metadata: dict
    results: list
    latency: list = field(default_factory=list)     # bench.BenchRow

    @property
    def failed(self) -> list:
        return [r for r in self.results if not r.passed]

    @property
    def passed(self) -> bool:
        return not self.failed


def run_checks(checks: Sequence[Check], progress: Progress) -> list[CheckResult]:
    """Run each check with its own seed; an exception fails that check instead of stopping the run."""
    results = []
    for index, check in enumerate(checks):
        progress.update(index + 1, f"{check.section}: {check.label}")
        torch.manual_seed(index)
        started = time.monotonic()
        try:
            result = check.run()
        except Exception as error:  # noqa: BLE001 - a crash is a failed check, reported with its message
            message = str(error).strip().splitlines()[0] if str(error).strip() else ""
            result = CheckResult(check.section, check.label, False, detail=f"{type(error).__name__}: {message}")
        result.seconds = round(time.monotonic() - started, 2)
        results.append(result)
    return results


LATENCY_MODES = ("fwd", "bwd")


def measure_latency(shapes: Sequence[bench.Shape], dtype: torch.dtype, progress: Progress, done: int = 0) -> list:
    """flashtriton's forward and backward time on the current CUDA device (not gated)."""
    rows = []
    for shape in shapes:
        q, k, v = bench.random_inputs(shape, dtype)
        for causal in (False, True):
            for mode in LATENCY_MODES:
                progress.update(done + len(rows) + 1, f"latency: {shape.label()} causal={causal} {mode}")
                rows.append(bench.bench_config("flashtriton", shape, causal, dtype, mode, q, k, v))
    return rows


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def results_table(results: Sequence[CheckResult]) -> str:
    rows = [[r.section, r.case, r.worst or "-", _fmt(r.max_error, ".2e"), _fmt(r.ratio, ".2f"),
             "pass" if r.passed else "FAIL"] for r in results]
    return bench.markdown_table(["section", "case", "worst", "max error", "vs PyTorch", "verdict"], rows,
                                [False, False, False, True, True, False])


def latency_table(rows: Sequence) -> str:
    table = [[r.shape.label(), "yes" if r.causal else "no", r.dtype, r.mode, _fmt(r.ms, ".3f"),
              _fmt(r.tflops, ".1f"), r.status] for r in rows]
    return bench.markdown_table(["B x S x H x D", "causal", "dtype", "mode", "ms", "TF/s", "status"], table,
                                [False, False, False, False, True, True, False])


def report_markdown(report: Report) -> str:
    meta = report.metadata
    lines = ["# flashtriton validate", "",
             *(f"- {key}: {value}" for key, value in meta.items() if value not in (None, [], "")), "",
             "## Results", "", results_table(report.results), ""]
    if report.latency:
        lines += ["## Latency (flashtriton)", "", latency_table(report.latency), ""]
    if report.failed:
        lines += ["## Failures", "", *(f"- {r.section} / {r.case}: {r.detail}" for r in report.failed), ""]
    verdict = "PASSED" if report.passed else f"FAILED ({len(report.failed)} of {len(report.results)} checks)"
    lines += [f"Verdict: {verdict}", ""]
    return "\n".join(lines)


def write_report(report: Report, directory: Path) -> list[Path]:
    """Write <directory>/validate.md and <directory>/validate.json (created if missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    md_path, json_path = directory / f"{REPORT_STEM}.md", directory / f"{REPORT_STEM}.json"
    md_path.write_text(report_markdown(report))
    payload = {"metadata": report.metadata, "passed": report.passed,
               "results": [dict(asdict(r), ratio=r.ratio) for r in report.results],
               "latency": [asdict(r) for r in report.latency]}
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return [md_path, json_path]


def validate(device: str, full: bool = False, inject_fault: bool = False,
             sections: Sequence[str] = SECTIONS, stderr=None) -> Report:
    """Run the validation on `device` ("cpu" or "cuda") in-process; CPU needs interpreted kernels."""
    started = time.monotonic()
    plan = make_plan(device, full)
    metadata = {"device": _device_description(device), "kernels": _kernels_description(device),
                "mode": "full" if full else "quick", "dtypes": [_dtype_name(d) for d in validated_dtypes()],
                "fault_injected": f"softmax_scale x{FAULT_SCALE_FACTOR} in the kernels" if inject_fault else None}
    validator = Validator(device, plan, FAULT_SCALE_FACTOR if inject_fault else 1.0)
    checks = validator.checks(sections)
    latency_shapes = plan.latency_shapes if device == "cuda" else ()
    progress = Progress(len(checks) + len(latency_shapes) * 2 * len(LATENCY_MODES), stderr)
    results = run_checks(checks, progress)
    latency = measure_latency(latency_shapes, torch.bfloat16, progress, done=len(checks))
    progress.finish()
    metadata.update(bench.run_metadata())
    metadata["seconds"] = round(time.monotonic() - started, 1)
    return Report(metadata, results, latency)


def _device_description(device: str) -> str:
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        return f"cuda ({torch.cuda.get_device_name()}, sm_{major}{minor})"
    return "cpu"


def _kernels_description(device: str) -> str:
    if device == "cuda" and not backend.KERNELS_INTERPRETED:
        return "compiled Triton"
    return "Triton interpreter" if backend.KERNELS_INTERPRETED else "PyTorch float32 reference (not the kernels)"


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def needs_interpreter_reexec(device: str) -> bool:
    """On CPU the kernels only run when TRITON_INTERPRET=1 was set before flashtriton was imported."""
    return device == "cpu" and not backend.KERNELS_INTERPRETED and os.environ.get("TRITON_INTERPRET") != "1"


def reexec_under_interpreter(argv: Sequence[str]) -> int:
    """Run `python -m flashtriton <argv>` again with TRITON_INTERPRET=1; returns its exit status."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.call([sys.executable, "-m", "flashtriton", *argv], env=env)


def run_command(device: str, full: bool, report_dir: Optional[Path], inject_fault: bool,
                argv: Sequence[str]) -> int:
    """`flashtriton validate`: 0 when every gate passes, 1 when one fails, 2 when it cannot run here."""
    device = resolve_device(device)
    if device == "cuda" and not torch.cuda.is_available():
        sys.stderr.write("flashtriton validate: --device cuda but no CUDA GPU is available\n")
        return 2
    if needs_interpreter_reexec(device):
        sys.stderr.write("flashtriton validate: re-running with TRITON_INTERPRET=1 so the Triton kernels (not the "
                         "PyTorch reference) are validated on CPU\n")
        return reexec_under_interpreter(argv)
    if device == "cpu" and not backend.KERNELS_INTERPRETED:
        sys.stderr.write("flashtriton validate: TRITON_INTERPRET=1 was set after flashtriton was imported; the "
                         "kernels are not interpreted. Set it before starting Python.\n")
        return 2
    emit(f"flashtriton validate: device {_device_description(device)}, kernels: {_kernels_description(device)}, "
         f"{'full' if full else 'quick'}")
    if backend.KERNELS_INTERPRETED:
        emit(INTERPRETER_BF16_NOTE)
    if inject_fault:
        emit(f"fault injected: kernels get softmax_scale x{FAULT_SCALE_FACTOR}; the reference the true scale")
    report = validate(device, full, inject_fault)
    emit()
    emit(results_table(report.results))
    if report.latency:
        emit()
        emit(latency_table(report.latency))
    for failure in report.failed:
        emit(f"FAIL {failure.section} / {failure.case}: {failure.detail}")
    emit()
    verdict = "PASSED" if report.passed else f"FAILED: {len(report.failed)} of {len(report.results)} checks"
    emit(f"{verdict} ({report.metadata['seconds']} s)")
    if report_dir is not None:
        paths = write_report(report, Path(report_dir))
        emit("report: " + ", ".join(str(p) for p in paths))
    return 0 if report.passed else 1

"""The checks of `flashtriton validate`: each runs the kernels through a public API path on a case of
flashtriton.validate_cases and compares against the float64 reference, giving a CheckResult.

The tolerance rule is flashtriton.testing's: max|kernel - ref| <= factor * max|pt - ref| + atol, with `pt` the
same reference computed in the input dtype. The accuracy sweep adds relative L_inf and cosine gates; edge probes
check exact properties (window (0, 0) is V, rows without keys, bitwise determinism, varlen = dense, dropout)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch

from . import bench
from .interface import flash_attn_func, flash_attn_with_kvcache
from .reference import attention_reference, kvcache_reference
from .testing import (Case, ErrorCheck, check_error, check_lse, compare_varlen_with_reference,
                      compare_with_reference, make_case_inputs, poisoned_outputs)
from .validate_cases import (API_PATHS, DENSE_PATH, KVCACHE_PATHS, VARLEN_PATH, ApiPath, KVCase, Plan, VarlenBatch,
                             api_call, dtype_name, make_kvcache_inputs, make_varlen_inputs, unpack_grads,
                             validated_dtypes)

COSINE_GATE = 0.9995
OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
# flash_attn_with_kvcache: the tolerance factors of out (ALiBi's larger); how far rotated keys written into the
# cache may be from the reference's; how far out of num_splits=3 may be from out of num_splits=1 (they differ only
# in rounding).
KVCACHE_OUT_FACTOR = 3.0
KVCACHE_ALIBI_OUT_FACTOR = 5.0
ROTARY_K_CACHE_ATOL = 1e-3
SPLIT_AGREEMENT_ATOL = 2e-3
DROPOUT_P = 0.17
SECTIONS = ("api", "accuracy", "backward", "edge")


def rotated_key_tolerance(ref_k_cache: torch.Tensor) -> float:
    """1e-3, or one ulp of the cache dtype at its largest key if that is more: rotating in fp32 and rounding
    may land one step apart when the GPU fuses a multiply-add that the reference does not."""
    ulp = torch.finfo(ref_k_cache.dtype).eps * float(ref_k_cache.detach().abs().max())
    return max(ROTARY_K_CACHE_ATOL, ulp)


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
        leaves, call = api_call(path, q, k, v, with_grad, varlen)
        with poisoned_outputs(), torch.set_grad_enabled(with_grad):
            out, lse, s_dmask = call(**options)
            grads = None
            if with_grad:
                dout = torch.randn_like(out) if dout is None else dout
                grads = unpack_grads(path, torch.autograd.grad(out, leaves, dout), pack_dim=q.dim() - 2)
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
                    label = f"{path.name} {variant} {dtype_name(dtype)}"
                    checks.append(Check("api", label, lambda c=case, p=path, n=label: self.check_api(n, c, p)))
            for path in KVCACHE_PATHS:
                for variant, case in self.kvcache_variants(dtype).items():
                    if path.page_size is not None and case.batch_idx_leftpad:
                        continue  # flash_attn rejects cache_batch_idx and cache_leftpad with a paged cache
                    case = replace(case, page_size=path.page_size)
                    label = f"{path.name} {variant} {dtype_name(dtype)}"
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
            "learnable sink": lambda: self.check_extension(replace(base, causal=True), sink=True),
            "V head dim 32, q's 64": lambda: self.check_extension(replace(base, causal=True), head_dim_v=32),
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

    def check_extension(self, case: Case, sink: bool = False, head_dim_v: int = 0) -> CheckResult:
        """The extensions of the API (docs/api.md §2.4, §4.11): learnable sinks (dsink too) or a V head dim apart
        from q's, forward and backward, against the reference (tolerance rule)."""
        q, k, v, _ = make_case_inputs(case, self.device, requires_grad=True)
        if head_dim_v:
            v = torch.randn(*v.shape[:-1], head_dim_v, device=self.device).to(case.dtype).requires_grad_()
        learnable_sink = torch.randn(case.num_heads, device=self.device).requires_grad_() if sink else None
        leaves = (q, k, v) if learnable_sink is None else (q, k, v, learnable_sink)
        scale = self.kernel_scale(case)
        with poisoned_outputs():
            out, lse, _ = flash_attn_func(q, k, v, 0.0, scale, case.causal, return_attn_probs=True,
                                          learnable_sink=learnable_sink)
            dout = torch.randn_like(out)
            grads = torch.autograd.grad(out, leaves, dout)
        checks = compare_with_reference(case, out, lse, q, k, v, None, grads, dout, grad_factor=GRAD_FACTOR,
                                        learnable_sink=learnable_sink)
        return summarize("edge", "learnable sink" if sink else f"V head dim {head_dim_v}, q's {case.head_dim}",
                         checks)

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

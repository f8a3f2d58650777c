"""`flashtriton validate`: run the kernels on this machine and check them against the float64 reference.

Sections: every public API path with every feature (tolerance rule + NaN/Inf), a forward accuracy sweep
(relative L_inf, cosine and the tolerance rule), backward gradients (tolerance rule with factor 3), edge probes
and, on CUDA, a latency table. On CPU the kernels run through Triton's interpreter: the command re-executes
itself with TRITON_INTERPRET=1 when needed and applies flashtriton._interpreter_patches explicitly.

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
from .interface import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from .ops import backend
from .reference import attention_reference
from .testing import (Case, ErrorCheck, check_error, check_lse, compare_with_reference, make_case_inputs,
                      poisoned_outputs)

COSINE_GATE = 0.9995
OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
# --inject-fault multiplies the softmax scale given to the kernels (not the reference's) by this factor.
FAULT_SCALE_FACTOR = 1.01
REPORT_STEM = "validate"

API_PATHS = ("flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func")
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
    latency_shapes: tuple = ()

    @property
    def window(self) -> tuple:
        """(32, 32) at interpreter sizes, a quarter of the sequence on each side at GPU sizes."""
        side = max(32, self.api_seqlen // 4)
        return side, side


def make_plan(device_type: str, full: bool) -> Plan:
    both = (torch.float16, torch.bfloat16)
    if device_type == "cpu":
        if not full:
            return Plan(1, 2, 96, 64, (torch.float16,), ((128, 128), (77, 113)), (64, 128),
                        ((128, 128, 64), (113, 77, 128)), 64)
        return Plan(2, 2, 96, 64, both, ((17, 17), (64, 64), (128, 128), (77, 113), (113, 77), (200, 200)),
                    (32, 40, 64, 96, 128, 256),
                    ((17, 17, 32), (64, 64, 64), (128, 128, 128), (77, 113, 96), (113, 77, 64), (128, 128, 256)), 96)
    quick_latency = (bench.Shape(4, 4096, 16, 128),)
    if not full:
        return Plan(2, 4, 512, 128, (torch.float16,), ((128, 128), (1024, 1024), (333, 1000)), (64, 128, 256),
                    ((1024, 1024, 128), (333, 1000, 64), (1000, 333, 256)), 256, quick_latency)
    return Plan(2, 4, 1024, 128, both,
                ((1, 1), (128, 128), (1024, 1024), (333, 1000), (1000, 333), (2048, 2048), (4096, 4096)),
                (32, 64, 96, 128, 256),
                ((1024, 1024, 128), (333, 1000, 64), (1000, 333, 256), (2048, 2048, 128), (4096, 4096, 64)), 512,
                quick_latency + (bench.Shape(4, 4096, 32, 64), bench.Shape(4, 4096, 8, 256),
                                 bench.Shape(1, 16384, 16, 128)))


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
    """What one kernel call produced, with the inputs it was given."""

    case: Case
    inputs: tuple           # q, k, v, alibi_slopes
    out: torch.Tensor
    lse: torch.Tensor
    s_dmask: torch.Tensor
    grads: Optional[tuple] = None
    dout: Optional[torch.Tensor] = None


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

    def kernel_scale(self, case: Case) -> Optional[float]:
        """The softmax_scale passed to the kernels: the case's (None = default) unless a fault is injected."""
        if self.fault_factor == 1.0:
            return case.softmax_scale
        return (case.softmax_scale or case.head_dim ** -0.5) * self.fault_factor

    def run_kernels(self, case: Case, path: str = "flash_attn_func", with_grad: bool = True,
                    input_scale: float = 1.0, inputs: Optional[tuple] = None,
                    dout: Optional[torch.Tensor] = None) -> Outcome:
        """One forward (and backward) through a public API path, with NaN-poisoned output buffers."""
        q, k, v, slopes = inputs or make_case_inputs(case, self.device, scale=input_scale)
        options = dict(softmax_scale=self.kernel_scale(case), causal=case.causal, window_size=case.window_size,
                       softcap=case.softcap, alibi_slopes=slopes, return_attn_probs=True)
        leaves, call = _api_call(path, q, k, v, with_grad)
        with poisoned_outputs(), torch.set_grad_enabled(with_grad):
            out, lse, s_dmask = call(**options)
            grads = None
            if with_grad:
                dout = torch.randn_like(out) if dout is None else dout
                grads = _unpack_grads(path, torch.autograd.grad(out, leaves, dout))
        return Outcome(case, (q, k, v, slopes), out.detach(), lse, s_dmask, grads, dout)

    def tolerance_checks(self, outcome: Outcome) -> list[ErrorCheck]:
        q, k, v, slopes = outcome.inputs
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
                    if path == "flash_attn_qkvpacked_func" and case.num_heads != case.num_heads_k:
                        continue  # qkvpacked has H == Hk by construction
                    label = f"{path} {variant} {_dtype_name(dtype)}"
                    checks.append(Check("api", label, lambda c=case, p=path, n=label: self.check_api(n, c, p)))
        return checks

    def check_api(self, label: str, case: Case, path: str) -> CheckResult:
        outcome = self.run_kernels(case, path)
        failures = [] if outcome.s_dmask.shape == (0,) else [f"S_dmask shape {tuple(outcome.s_dmask.shape)}"]
        return summarize("api", label, self.tolerance_checks(outcome), failures)

    def accuracy_checks(self) -> list[Check]:
        plan, checks = self.plan, []
        for dtype in (torch.float16, torch.bfloat16):
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
        for dtype in (torch.float16, torch.bfloat16):
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
        }
        return [Check("edge", name, run) for name, run in probes.items()]

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


def _api_call(path: str, q, k, v, with_grad: bool):
    """(leaves to differentiate, fn(**options) -> (out, lse, S_dmask)) for one public API path."""
    def leaf(t):
        return t.detach().clone().requires_grad_(with_grad)

    if path == "flash_attn_func":
        leaves = (leaf(q), leaf(k), leaf(v))
        return leaves, lambda **o: flash_attn_func(*leaves, **o)
    if path == "flash_attn_qkvpacked_func":
        leaves = (leaf(torch.stack((q, k, v), dim=2)),)
        return leaves, lambda **o: flash_attn_qkvpacked_func(*leaves, **o)
    if path == "flash_attn_kvpacked_func":
        leaves = (leaf(q), leaf(torch.stack((k, v), dim=2)))
        return leaves, lambda **o: flash_attn_kvpacked_func(*leaves, **o)
    raise ValueError(f"unknown API path {path!r}")


def _unpack_grads(path: str, grads) -> tuple:
    """(dq, dk, dv) from the gradients of an API path's leaves."""
    if path == "flash_attn_qkvpacked_func":
        return tuple(grads[0].unbind(dim=2))
    if path == "flash_attn_kvpacked_func":
        return (grads[0], *grads[1].unbind(dim=2))
    return tuple(grads)


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
                "mode": "full" if full else "quick", "interpreter_patches": [],
                "fault_injected": f"softmax_scale x{FAULT_SCALE_FACTOR} in the kernels" if inject_fault else None}
    if backend.KERNELS_INTERPRETED:
        from ._interpreter_patches import apply_interpreter_patches

        metadata["interpreter_patches"] = apply_interpreter_patches()
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
        from ._interpreter_patches import apply_interpreter_patches

        for patch in apply_interpreter_patches():
            emit(f"interpreter: {patch}")
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

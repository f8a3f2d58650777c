"""`flashtriton validate`: run the kernels on this machine and check them against the float64 reference.

Sections: every public API path with every feature (tolerance rule + NaN/Inf), a forward accuracy sweep
(relative L_inf, cosine and the tolerance rule), backward gradients (tolerance rule with factor 3), edge probes
(including dropout: the keep mask read back from S_dmask, out and gradients against the reference with that
mask, the drop rate) and, on CUDA, a latency table. The API paths include the varlen functions (packed, and
the paged K/V form of flash_attn_varlen_func, forward only) on mixed lengths with a 0- and a 1-length sequence,
max_seqlen upper bounds and uncovered rows after the last sequence; they are checked against the float64 varlen
reference. An edge probe checks that varlen on equal lengths is bitwise the dense result. flash_attn_with_kvcache
is checked on a contiguous and a paged cache (page size 48) against the float64 kvcache reference: out, lse, and
the caches after the append (bit-exact; rotated keys within 1e-3 or one ulp), with num_splits 3 and 1 agreeing.

On CPU the kernels run through Triton's interpreter: the command re-executes itself with TRITON_INTERPRET=1 when
needed. The accuracy and backward sections cover fp16 and bf16 there as on a GPU (the kernels' products go through
flashtriton.kernels.common.mma, right in bf16 in the interpreter too).

The tolerance rule is flashtriton.testing's: max|kernel - ref| <= factor * max|pt - ref| + atol, with `pt` the
same reference computed in the input dtype ("vs PyTorch" in the tables is max|kernel - ref| / max|pt - ref|).

This module runs the checks and reports them; validate_cases.py holds the cases and their inputs,
validate_checks.py the checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from . import bench
from .ops import backend
from .validate_cases import dtype_name, make_plan, validated_dtypes
from .validate_checks import SECTIONS, Check, CheckResult, Validator

# --inject-fault multiplies the softmax scale given to the kernels (not the reference's) by this factor.
FAULT_SCALE_FACTOR = 1.01
REPORT_STEM = "validate"


def emit(text: str = "") -> None:
    """The command's user-facing output."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


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
                "mode": "full" if full else "quick", "dtypes": [dtype_name(d) for d in validated_dtypes()],
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

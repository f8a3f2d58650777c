"""Timing harness shared by `flashtriton bench`, `flashtriton validate` and benchmarks/: FLOP counts, providers,
timed rows with metadata, and their JSON / Markdown / PNG outputs.

Providers are flashtriton and PyTorch's SDPA backends (FLASH, CUDNN, EFFICIENT). A provider that cannot run a
configuration gives a row marked unavailable. flashtriton's output is checked against the float32 reference on
every timed configuration; the row records the max error and whether it passed the relative-L_inf gate.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .reference import attention_reference

PROVIDERS = ("flashtriton", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "fa4")
# timed unless --providers says otherwise; fa4 (FlashAttention-4's CuTe DSL kernels, `flash_attn.cute` of the
# flash-attn-4 package) only on request, as it is rarely installed
DEFAULT_PROVIDERS = PROVIDERS[:4]
MODES = ("fwd", "bwd", "fwd+bwd", "fwd+bwd-graph")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# max|out - ref| / max|ref| allowed against the float64 / float32 reference.
REL_LINF_GATES = {torch.float16: 2e-2, torch.bfloat16: 1e-2}

# Backward FLOPs are 2.5x the forward's (two matmuls forward, five backward).
BWD_FLOP_FACTOR = 2.5

# Reference chunks are sized to keep one float32 score matrix near this many bytes.
_REFERENCE_CHUNK_BYTES = 1 << 30


@dataclass(frozen=True)
class Shape:
    """A self-attention shape in flash_attn's (batch, seqlen, heads, head_dim) layout; Sq == Sk."""

    batch: int
    seqlen: int
    heads: int
    head_dim: int

    def label(self) -> str:
        return f"{self.batch}x{self.seqlen}x{self.heads}x{self.head_dim}"

    def __iter__(self):
        """Unpacks as (batch, seqlen, heads, head_dim)."""
        return iter(astuple(self))


# The baseline shapes: 16k tokens (batch x seqlen), hidden 2048 (heads = 2048 / head_dim), in (B, S, H, D) memory.
BASELINE_SHAPES = (Shape(16, 1024, 16, 128), Shape(4, 4096, 16, 128), Shape(1, 16384, 16, 128),
                   Shape(4, 4096, 32, 64), Shape(4, 4096, 8, 256))
QUICK_SHAPES = (Shape(4, 2048, 16, 128), Shape(4, 2048, 32, 64))
SHAPE_SETS = {"baseline": BASELINE_SHAPES, "quick": QUICK_SHAPES}


def select_shapes(spec: str, shapes: Sequence[Shape] = BASELINE_SHAPES) -> list:
    """The benchmark scripts' --shapes: 'all', or comma-separated indices into shapes (e.g. '1,3')."""
    return list(shapes) if spec == "all" else [shapes[int(i)] for i in spec.split(",")]


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool,
                    mode: str = "fwd") -> float:
    """Matmul FLOPs: forward 4*B*H*Sq*Sk*D, halved when causal; backward 2.5x forward; fwd+bwd (also replayed from
    a CUDA graph) the sum."""
    forward = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    if causal:
        forward /= 2
    factors = {"fwd": 1.0, "bwd": BWD_FLOP_FACTOR, "fwd+bwd": 1.0 + BWD_FLOP_FACTOR,
               "fwd+bwd-graph": 1.0 + BWD_FLOP_FACTOR}
    if mode not in factors:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    return forward * factors[mode]


def tflops_per_second(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def relative_linf(actual: torch.Tensor, ref: torch.Tensor) -> float:
    """max|actual - ref| / max|ref| (NaN counts as infinitely wrong)."""
    err = (actual.double() - ref.double()).abs().nan_to_num(nan=float("inf"))
    scale = float(ref.double().abs().max()) if ref.numel() else 0.0
    max_err = float(err.max()) if err.numel() else 0.0
    return max_err / scale if scale > 0 else max_err


@dataclass
class BenchRow:
    """One timed (provider, shape, causal, dtype, mode). ms/tflops are None when the provider is unavailable."""

    provider: str
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    causal: bool
    dtype: str
    mode: str
    ms: Optional[float] = None
    tflops: Optional[float] = None
    status: str = "ok"
    max_error: Optional[float] = None
    rel_error: Optional[float] = None
    correct: Optional[bool] = None
    peak_mem_mib: Optional[float] = None

    @property
    def shape(self) -> Shape:
        return Shape(self.batch, self.seqlen, self.heads, self.head_dim)


@dataclass
class BenchResult:
    rows: list[BenchRow]
    metadata: dict = field(default_factory=dict)


def git_commit() -> Optional[str]:
    """$FLASHTRITON_COMMIT if set (copies without git history), else `git rev-parse --short HEAD` of the checkout
    this package's files belong to, with "-dirty" where the package's tracked files differ from that commit (work
    in progress, or files copied over an older checkout: HEAD alone would name a tree that did not run); None where
    they belong to none (an installed wheel, or a copy inside another repository's tree, which that repository
    does not track: its HEAD says nothing of the copy)."""
    if os.environ.get("FLASHTRITON_COMMIT"):
        return os.environ["FLASHTRITON_COMMIT"]
    here = Path(__file__).resolve()
    try:
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "--", here.name], cwd=here.parent,
                                 capture_output=True, text=True, timeout=10)
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here.parent, capture_output=True,
                              text=True, timeout=10)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
                                 cwd=here.parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if tracked.returncode != 0 or done.returncode != 0 or not done.stdout.strip():
        return None
    return done.stdout.strip() + ("-dirty" if changed.returncode != 0 or changed.stdout.strip() else "")


def run_metadata() -> dict:
    import triton

    from . import __version__

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "gpu": gpu,
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if gpu else None,
        "flashtriton": __version__,
        "commit": git_commit(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# ----------------------------------------------------------------------------------------------------------------
# Providers
# ----------------------------------------------------------------------------------------------------------------

def _sdpa_backend(provider: str):
    from torch.nn.attention import SDPBackend

    return {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}[provider]


def attention_callable(provider: str, causal: bool) -> Callable:
    """fn(q, k, v) -> out for a provider, with q/k/v in the provider's layout (see provider_inputs)."""
    if provider == "flashtriton":
        from .interface import flash_attn_func

        return lambda q, k, v: flash_attn_func(q, k, v, causal=causal)
    if provider == "fa4":
        from flash_attn.cute import flash_attn_func as fa4_func  # FA4 returns (out, lse)

        return lambda q, k, v: fa4_func(q, k, v, causal=causal)[0]
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}; expected one of {PROVIDERS}")
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    backend = _sdpa_backend(provider)

    def run_sdpa(q, k, v):
        with sdpa_kernel([backend]):
            return scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run_sdpa


def provider_inputs(provider: str, q, k, v, requires_grad: bool):
    """Leaf copies of (B, S, H, D) inputs, in (B, S, H, D) memory for every provider (the baseline shapes' layout):
    as they are for flashtriton and FA4, as (B, H, S, D) views of that memory for SDPA. Every provider reads the same
    memory layout; contiguous (B, H, S, D) copies would change SDPA's speed (its FLASH backward is slower on them at
    16x1024x16x128 causal)."""
    def prepare(t):
        t = t.detach().clone()
        return (t if provider in ("flashtriton", "fa4") else t.transpose(1, 2)).requires_grad_(requires_grad)

    return prepare(q), prepare(k), prepare(v)


def random_inputs(shape: Shape, dtype: torch.dtype, device="cuda", seed: int = 0):
    """N(0, 1) q, k, v of a shape, (B, S, H, D)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    size = (shape.batch, shape.seqlen, shape.heads, shape.head_dim)
    return tuple(torch.randn(size, generator=generator, device=device, dtype=dtype) for _ in range(3))


def timed_callable(provider: str, mode: str, causal: bool, q, k, v) -> Callable:
    """The function to time for a mode. bwd times the backward only, on a graph built once; fwd+bwd a training
    step (forward through autograd, then the backward), fwd+bwd-graph that step captured into a CUDA graph."""
    return timed_attention(attention_callable(provider, causal), provider, mode, q, k, v)


def timed_attention(attention: Callable, provider: str, mode: str, q, k, v) -> Callable:
    """timed_callable for any attention(q, k, v) in the provider's layout (e.g. with dropout)."""
    q, k, v = provider_inputs(provider, q, k, v, requires_grad=mode != "fwd")
    if mode == "fwd":
        def forward():
            with torch.no_grad():
                return attention(q, k, v)
        return forward
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    if mode == "bwd":
        out = attention(q, k, v)
        dout = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    # no autograd graph outlives this: a kept one holds q, k, v's gradient nodes on this stream, which breaks the
    # CUDA graph capture of fwd+bwd-graph (the capture runs on another stream)
    with torch.no_grad():
        dout = torch.randn_like(attention(q, k, v))

    def step():
        return torch.autograd.grad(attention(q, k, v), (q, k, v), dout)

    # fwd+bwd-graph: the same training step replayed from a CUDA graph, i.e. without the host's per-call cost
    return graphed(step) if mode == "fwd+bwd-graph" else step


def mixed_lengths(tokens: int, low: int = 128, high: int = 4096, seed: int = 0) -> list:
    """Varlen benchmark lengths: drawn uniformly from [low, high] (seeded) until `tokens` are filled, the last
    one cut to fit."""
    import random

    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(low, high), tokens - sum(lengths)))
    return lengths


def median_ms(fn: Callable, warmup: int = 25, rep: int = 100) -> float:
    """Median CUDA time of fn in milliseconds (triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def copy_bandwidth() -> float:
    """The device's copy bandwidth in TB/s (bytes read + written) of a 2 GiB device-to-device copy, far past L2:
    what a memory-bound kernel's TB/s is held against."""
    src = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * src.numel() / median_ms(lambda: dst.copy_(src)) * 1e-9


def matmul_tflops(size: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """TF/s of a size^3 matmul in dtype (torch.matmul, cuBLAS): the device's measured tensor-core rate, what a
    compute-bound kernel's TF/s is held against."""
    a, b = (torch.randn(size, size, device="cuda", dtype=dtype) for _ in range(2))
    return 2 * size ** 3 / median_ms(lambda: a @ b) * 1e-9


def profiled_kernels(fn: Callable, calls: int = 20):
    """torch.profiler's per-kernel averages (CUDA activity) over `calls` calls of fn, after one call outside it."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages()


def kernel_ms(fn: Callable, calls: int = 20) -> float:
    """Mean GPU time in ms of the kernels one call of fn launches (torch.profiler's CUDA activity): host time and
    the gaps between kernels are left out, so eager calls shorter than their host time read their GPU cost."""
    total_us = sum(event.device_time_total for event in profiled_kernels(fn, calls))
    if total_us <= 0:
        raise RuntimeError("kernel_ms: the profiler recorded no GPU kernel time for this call")
    return total_us / calls * 1e-3


TIMINGS = {"wall": "median of triton.testing.do_bench (events around each call, L2 flushed between calls)",
           "kernels": "mean GPU time of the call's kernels over 20 calls (torch.profiler; host time left out)"}


def time_ms(fn: Callable, timing: str = "wall", warmup: int = 25, rep: int = 100) -> float:
    """Milliseconds per call of fn by one of TIMINGS (warmup / rep: do_bench's, for "wall")."""
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {sorted(TIMINGS)}, got {timing!r}")
    return median_ms(fn, warmup=warmup, rep=rep) if timing == "wall" else kernel_ms(fn)


def graphed(call: Callable) -> Callable:
    """call captured into a CUDA graph; the returned function replays it and returns its (static) output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()

    def replay():
        graph.replay()
        return out
    return replay


def host_us_per_call(fn: Callable, calls: int = 100, drained: bool = False) -> float:
    """Host time of one call in microseconds: wall time of `calls` calls enqueued back to back after a sync
    (the GPU's queue absorbs them, so this is the host's cost even when the GPU is slower). drained: the time runs
    until the GPU has finished them too, what an eager loop of these calls gets (the larger of host and GPU cost)."""
    import time

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if drained:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def peak_memory_mib(fn: Callable) -> float:
    """Peak CUDA memory allocated by one call of fn above what was allocated before it, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def reference_output(q, k, v, causal: bool) -> torch.Tensor:
    """float32 reference in (B, S, H, D), computed a few heads at a time to bound memory."""
    batch, seqlen_q, heads, _ = q.shape
    scores_bytes = 4 * batch * seqlen_q * k.shape[1]
    step = max(1, min(heads, _REFERENCE_CHUNK_BYTES // max(scores_bytes, 1)))
    chunks = [attention_reference(q[:, :, h:h + step], k[:, :, h:h + step], v[:, :, h:h + step], causal=causal,
                                  compute_dtype=torch.float32)[0] for h in range(0, heads, step)]
    return torch.cat(chunks, dim=2)


def check_flashtriton_output(q, k, v, causal: bool) -> tuple[float, float, bool]:
    """(max abs error, relative L_inf error, passed) of flashtriton's forward against the float32 reference."""
    from .interface import flash_attn_func

    with torch.no_grad():
        out = flash_attn_func(q, k, v, causal=causal)
        ref = reference_output(q, k, v, causal)
    max_error = float((out.double() - ref.double()).abs().nan_to_num(nan=float("inf")).max())
    rel = relative_linf(out, ref)
    return max_error, rel, rel <= REL_LINF_GATES[q.dtype]


def _unavailable(error: Exception) -> str:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"unavailable: {type(error).__name__}: {first_line[:160]}"


def bench_config(provider: str, shape: Shape, causal: bool, dtype: torch.dtype, mode: str, q, k, v,
                 warmup: int = 25, rep: int = 100, timing: str = "wall") -> BenchRow:
    """Time one configuration (timing: a TIMINGS key); failures of the provider become an unavailable row."""
    dtype_name = next(name for name, value in DTYPES.items() if value == dtype)
    row = BenchRow(provider, shape.batch, shape.seqlen, shape.heads, shape.head_dim, causal, dtype_name, mode)
    try:
        fn = timed_callable(provider, mode, causal, q, k, v)
        row.ms = time_ms(fn, timing, warmup, rep)
        if mode == "fwd+bwd":
            row.peak_mem_mib = peak_memory_mib(fn)
    except Exception as error:  # noqa: BLE001 - any provider failure is data, not a crash
        row.status = _unavailable(error)
        row.ms = None
        return row
    flops = attention_flops(shape.batch, shape.heads, shape.seqlen, shape.seqlen, shape.head_dim, causal, mode)
    row.tflops = tflops_per_second(flops, row.ms)
    return row


def run_benchmarks(shapes: Sequence[Shape], providers: Sequence[str], modes: Sequence[str], dtype: torch.dtype,
                   causal_values: Sequence[bool] = (False, True), warmup: int = 25, rep: int = 100,
                   progress: Optional[Callable[[int, int, str], None]] = None, timing: str = "wall") -> BenchResult:
    """Time every (shape, causal, mode, provider) on the current CUDA device (timing: a TIMINGS key)."""
    configs = [(s, c) for s in shapes for c in causal_values]
    total = len(configs) * len(modes) * len(providers)
    rows, done = [], 0
    for shape, causal in configs:
        q, k, v = random_inputs(shape, dtype)
        check = None
        if "flashtriton" in providers:
            try:
                check = check_flashtriton_output(q, k, v, causal)
            except Exception as error:  # noqa: BLE001 - recorded on the rows below
                check = error
        for mode in modes:
            for provider in providers:
                done += 1
                if progress:
                    progress(done, total, f"{provider} {shape.label()} causal={causal} {mode}")
                row = bench_config(provider, shape, causal, dtype, mode, q, k, v, warmup, rep, timing)
                if provider == "flashtriton":
                    _attach_check(row, check)
                rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    return BenchResult(rows, {**run_metadata(), "timing": timing})


def _attach_check(row: BenchRow, check) -> None:
    if isinstance(check, Exception):
        row.correct = False
        row.status = f"{row.status}; check failed: {_unavailable(check)}"
    elif check is not None:
        row.max_error, row.rel_error, row.correct = check


# ----------------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------------

def markdown_table(headers: Sequence[str], rows: Sequence[Sequence], right_align: Sequence[bool] = ()) -> str:
    """A Markdown table padded so it also reads well as plain text."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    align = list(right_align) + [False] * (len(headers) - len(right_align))

    def line(row):
        padded = [c.rjust(w) if a else c.ljust(w) for c, w, a in zip(row, widths, align)]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if a else ("-" * (w + 2)) for w, a in zip(widths, align)) + "|"
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def _fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _ratio(numerator: Optional[float], denominator: Optional[float]) -> str:
    if numerator is None or not denominator:
        return "n/a"
    return f"{numerator / denominator:.2f}x"


def _row_key(row: BenchRow):
    return row.batch, row.seqlen, row.heads, row.head_dim, row.causal, row.dtype, row.mode


def results_markdown(rows: Sequence[BenchRow], metadata: Optional[dict] = None) -> str:
    """TF/s per provider for each configuration, with flashtriton/SDPA-flash and flashtriton/SDPA-cuDNN ratios (and
    flashtriton/FA4 where FA4 was timed), flashtriton's correctness check, and (fwd+bwd rows) peak extra memory per
    provider."""
    providers = [p for p in PROVIDERS if any(r.provider == p for r in rows)]
    groups: dict = {}
    for row in rows:
        groups.setdefault(_row_key(row), {})[row.provider] = row
    headers = ["B, S, H, D", "causal", "dtype", "mode"] + [f"{p} TF/s" for p in providers]
    with_fa4 = any(r.provider == "fa4" and r.tflops for r in rows)
    headers += ["ft/flash", "ft/cuDNN"] + (["ft/FA4"] if with_fa4 else []) + ["ft max err"]
    table = []
    for key, by_provider in groups.items():
        batch, seqlen, heads, head_dim, causal, dtype, mode = key
        ours = by_provider.get("flashtriton")
        flash, cudnn = by_provider.get("sdpa-flash"), by_provider.get("sdpa-cudnn")
        line = [f"{batch}, {seqlen}, {heads}, {head_dim}", "yes" if causal else "no", dtype, mode]
        line += [_fmt(by_provider[p].tflops, ".1f") if p in by_provider else "-" for p in providers]
        line += [_ratio(ours and ours.tflops, flash and flash.tflops),
                 _ratio(ours and ours.tflops, cudnn and cudnn.tflops)]
        if with_fa4:
            fa4 = by_provider.get("fa4")
            line.append(_ratio(ours and ours.tflops, fa4 and fa4.tflops))
        line.append(_error_cell(ours))
        table.append(line)
    right = [False] * 4 + [True] * (len(providers) + 2 + with_fa4)
    parts = []
    if metadata:
        parts.append(", ".join(f"{k}: {v}" for k, v in metadata.items() if v is not None))
    parts.append(markdown_table(headers, table, right))
    memory = memory_markdown(rows, providers)
    if memory:
        parts.append("Peak extra memory of fwd+bwd (MiB):\n\n" + memory)
    unavailable = sorted({f"{r.provider}: {r.status}" for r in rows if r.ms is None})
    if unavailable:
        parts.append("Unavailable:\n" + "\n".join(f"- {line}" for line in unavailable))
    return "\n\n".join(parts) + "\n"


def _error_cell(row: Optional[BenchRow]) -> str:
    if row is None or row.correct is None:
        return "-"
    return f"{_fmt(row.max_error, '.1e')} {'ok' if row.correct else 'WRONG'}"


def memory_markdown(rows: Sequence[BenchRow], providers: Sequence[str]) -> str:
    groups: dict = {}
    for row in rows:
        if row.mode == "fwd+bwd":
            groups.setdefault(_row_key(row)[:6], {})[row.provider] = row
    if not groups:
        return ""
    headers = ["B, S, H, D", "causal", "dtype"] + list(providers) + ["ft/flash"]
    table = []
    for (batch, seqlen, heads, head_dim, causal, dtype), by_provider in groups.items():
        mems = {p: by_provider[p].peak_mem_mib if p in by_provider else None for p in providers}
        table.append([f"{batch}, {seqlen}, {heads}, {head_dim}", "yes" if causal else "no", dtype]
                     + [_fmt(mems[p], ".0f") for p in providers]
                     + [_ratio(mems.get("flashtriton"), mems.get("sdpa-flash"))])
    return markdown_table(headers, table, [False] * 3 + [True] * (len(providers) + 1))


def write_plot(rows: Sequence[BenchRow], path: Path) -> bool:
    """TF/s vs seqlen per provider (one panel per mode and causal). False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.mode, r.causal) for r in rows}, key=lambda p: (MODES.index(p[0]), p[1]))
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (mode, causal) in zip(axes[0], panels):
        series: dict = {}
        for r in rows:
            if r.mode == mode and r.causal == causal and r.tflops is not None:
                series.setdefault((r.provider, r.head_dim), []).append((r.seqlen, r.tflops))
        for (provider, head_dim), points in sorted(series.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{provider} d{head_dim}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TF/s")
        ax.set_title(f"{mode}, causal={causal}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_results(result: BenchResult, out_dir: Path, stem: str = "bench") -> list[Path]:
    """Write <stem>.json (metadata + rows), <stem>.md and, with matplotlib, <stem>.png; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path, png_path = (out_dir / f"{stem}.{ext}" for ext in ("json", "md", "png"))
    payload = {"metadata": result.metadata, "rows": [asdict(r) for r in result.rows]}
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    md_path.write_text(results_markdown(result.rows, result.metadata))
    written = [json_path, md_path]
    if write_plot(result.rows, png_path):
        written.append(png_path)
    return written


def load_rows(path: Path) -> BenchResult:
    """Read a JSON file written by write_results."""
    payload = json.loads(Path(path).read_text())
    return BenchResult([BenchRow(**row) for row in payload["rows"]], payload.get("metadata", {}))

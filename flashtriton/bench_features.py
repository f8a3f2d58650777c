"""The feature matrix (`flashtriton bench --features`): forward and backward time of every feature models use,
flashtriton next to its peers in one process.

Rows: FEATURES x {not causal, causal} x dtypes x modes (fwd; bwd: the backward alone, on a graph built once). Every
row holds 16k query tokens (B=4, S=4096; varlen rows: mixed lengths 128..4096 filling 16k tokens) at hidden 2048
(heads = 2048 // head_dim) unless the row says otherwise; bf16 / fp16, N(0, 1) inputs.

Providers (PROVIDERS): flashtriton; flashtriton-triton, the same call with the Gluon kernels switched off
(configs.GLUON_ALLOWED): the path of every GPU but sm_90, timed here as its proxy; fa4 (flash_attn.cute of the
flash-attn-4 package, where it imports); sdpa-cudnn and sdpa-flash (PyTorch's SDPA backends) on the rows SDPA
expresses without an explicit mask: no window, softcap, ALiBi, varlen or paged cache. A provider that cannot run a
row gets no time (`-`), with its reason in the JSON.

Each row reports milliseconds (`bench.TIMINGS`), the throughput of flashtriton (TF/s of the scores a row really
computes: 4 * D per visible query-key pair forward, 2.5x that backward; one-row rows: TB/s of the K and V bytes),
and each peer's time divided by flashtriton's (above 1: flashtriton is faster). flashtriton's forward output is
checked on every row against the float32 reference on its first KV head's query heads.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from . import bench

PROVIDERS = ("flashtriton", "flashtriton-triton", "fa4", "sdpa-cudnn", "sdpa-flash")
PEERS = ("fa4", "sdpa-cudnn", "sdpa-flash")
MODES = ("fwd", "bwd")
HIDDEN = 2048
TOKENS = 16384
SEQLEN = 4096


class Unsupported(Exception):
    """A provider cannot run a row (the message says why)."""


@dataclass(frozen=True)
class Feature:
    """One row family of the matrix. heads None: HIDDEN // head_dim; heads_k None: heads. window: the left size of
    a sliding window (the right one is 0 causal, the same size otherwise). varlen: mixed lengths packed into one
    (T, H, D) tensor; page_size: varlen keys read through a block table of pages this size. one_row: one query row
    per sequence against batch x keys (decode-shaped; causal and not are the same attention, so not causal only).
    head_dim_v: V's own head dim (None: head_dim's); sinks: a learnable sink logit per query head (learnable_sink,
    N(0, 1) in fp32)."""

    name: str
    head_dim: int = 128
    heads: Optional[int] = None
    heads_k: Optional[int] = None
    window: Optional[int] = None
    softcap: float = 0.0
    alibi: bool = False
    varlen: bool = False
    page_size: int = 0
    one_row: bool = False
    batch: int = 4
    keys: int = SEQLEN
    head_dim_v: Optional[int] = None
    sinks: bool = False

    @property
    def value_dim(self) -> int:
        return self.head_dim_v or self.head_dim

    @property
    def num_heads(self) -> int:
        return self.heads or max(1, HIDDEN // self.head_dim)

    @property
    def num_heads_k(self) -> int:
        return self.heads_k or self.num_heads

    @property
    def modes(self) -> tuple:
        """Paged caches and one-row queries are inference shapes: forward only."""
        return ("fwd",) if self.page_size or self.one_row else MODES

    @property
    def causal_values(self) -> tuple:
        return (False,) if self.one_row else (False, True)


FEATURES = (
    Feature("plain"),
    Feature("gqa-32/8", heads=32, heads_k=8),
    Feature("window-256", window=256),
    Feature("window-1024", window=1024),
    Feature("softcap-30", softcap=30.0),
    Feature("alibi", alibi=True),
    Feature("d64", head_dim=64),
    Feature("d80", head_dim=80),
    Feature("d96", head_dim=96),
    Feature("d192", head_dim=192),
    Feature("d256", head_dim=256),
    Feature("varlen-mixed", varlen=True),
    Feature("paged-64", varlen=True, page_size=64),
    Feature("paged-256", varlen=True, page_size=256),
    Feature("one-row", heads=32, heads_k=8, one_row=True, keys=65536),
    Feature("sinks", sinks=True),
    Feature("mla-192/128", head_dim=192, head_dim_v=128),
    Feature("d512", head_dim=512),
)


def select_features(names: Optional[Sequence[str]]) -> list:
    """FEATURES by name (all when names is None); unknown names raise ValueError listing the known ones."""
    if names is None:
        return list(FEATURES)
    known = {feature.name: feature for feature in FEATURES}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown feature rows {unknown}; expected some of {list(known)}")
    return [known[name] for name in names]


@dataclass
class Problem:
    """The tensors and options of one row. Dense: q (B, Sq, H, D), k / v (B, Sk, Hk, D). Varlen: q (T, H, D), k / v
    (T, Hk, D), or paged (num_pages, page_size, Hk, D) with block_table and seqused_k. window: FA2's (left, right),
    -1 unbounded."""

    feature: Feature
    causal: bool
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    window: tuple = (-1, -1)
    alibi_slopes: Optional[torch.Tensor] = None
    lengths: list = field(default_factory=list)
    cu_seqlens: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None
    seqused_k: Optional[torch.Tensor] = None
    learnable_sink: Optional[torch.Tensor] = None
    pairs: Optional[int] = None  # visible_pairs' count

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths)


def make_problem(feature: Feature, causal: bool, dtype: torch.dtype, device="cuda", tokens: int = TOKENS,
                 seed: int = 0) -> Problem:
    """Fresh N(0, 1) inputs of a row (tokens: the query tokens; smaller for tests)."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

    heads, heads_k, dim, dim_v = feature.num_heads, feature.num_heads_k, feature.head_dim, feature.value_dim
    window = (-1, -1)
    if feature.window is not None:
        window = (feature.window, 0 if causal else feature.window)
    slopes = None
    if feature.alibi:
        slopes = torch.exp2(-8.0 * torch.arange(1, heads + 1, device=device, dtype=torch.float32) / heads)
    problem = Problem(feature, causal, None, None, None, window, slopes)
    if feature.sinks:
        problem.learnable_sink = torch.randn(heads, generator=generator, device=device, dtype=torch.float32)
    if feature.one_row:
        keys = max(1, feature.keys * tokens // TOKENS)
        problem.q = randn(feature.batch, 1, heads, dim)
        problem.k, problem.v = randn(feature.batch, keys, heads_k, dim), randn(feature.batch, keys, heads_k, dim_v)
        problem.lengths = [keys] * feature.batch
    elif feature.varlen:
        lengths = bench.mixed_lengths(tokens, low=min(128, tokens), high=min(SEQLEN, tokens))
        problem.lengths = lengths
        problem.cu_seqlens = _cumulative(lengths, device)
        total = sum(lengths)
        problem.q = randn(total, heads, dim)
        if feature.page_size:
            problem.k, problem.v, problem.block_table = _paged_cache(randn, lengths, feature.page_size, heads_k, dim,
                                                                     dim_v, generator, device)
            problem.seqused_k = torch.tensor(lengths, dtype=torch.int32, device=device)
        else:
            problem.k, problem.v = randn(total, heads_k, dim), randn(total, heads_k, dim_v)
    else:
        seqlen = min(SEQLEN, tokens)
        batch = max(1, tokens // seqlen)
        problem.q, problem.k, problem.v = (randn(batch, seqlen, h, d) for h, d in ((heads, dim), (heads_k, dim),
                                                                                  (heads_k, dim_v)))
        problem.lengths = [seqlen] * batch
    return problem


def _cumulative(lengths: Sequence[int], device) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)


def _paged_cache(randn, lengths, page_size: int, heads_k: int, dim: int, dim_v: int, generator, device):
    """K and V caches of (num_pages, page_size, Hk, D) holding each sequence in shuffled pages, and the block
    table (B, pages of the longest) naming them (unused entries name page 0)."""
    pages_per_sequence = [-(-length // page_size) for length in lengths]
    num_pages = sum(pages_per_sequence)
    order = torch.randperm(num_pages, generator=generator, device=device).to(torch.int32)
    table = torch.zeros(len(lengths), max(pages_per_sequence), dtype=torch.int32, device=device)
    start = 0
    for row, count in enumerate(pages_per_sequence):
        table[row, :count] = order[start:start + count]
        start += count
    return randn(num_pages, page_size, heads_k, dim), randn(num_pages, page_size, heads_k, dim_v), table


def visible_pairs(problem: Problem) -> int:
    """Query-key pairs the row's attention computes, over every sequence and query head (counted once a problem)."""
    from .reference import visible_mask
    from .scores import normalize_window

    if problem.pairs is None:
        pairs = 0
        for length in problem.lengths:
            rows = 1 if problem.feature.one_row else length
            left, right = normalize_window(problem.window, problem.causal, max(problem.lengths))
            pairs += int(visible_mask(rows, length, left, right).sum())
        problem.pairs = pairs * problem.feature.num_heads
    return problem.pairs


def throughput(problem: Problem, mode: str, ms: float) -> tuple:
    """(value, unit) of a time: TB/s of K and V for one-row rows, else TF/s of the visible pairs (2 (D + Dv) each
    forward: the Q K and P V products)."""
    if problem.feature.one_row:
        return (problem.k.numel() + problem.v.numel()) * problem.k.element_size() / (ms * 1e-3) / 1e12, "TB/s"
    flops = 2.0 * (problem.feature.head_dim + problem.feature.value_dim) * visible_pairs(problem)
    if mode == "bwd":
        flops *= bench.BWD_FLOP_FACTOR
    return flops / (ms * 1e-3) / 1e12, "TF/s"


# ----------------------------------------------------------------------------------------------------------------
# Providers
# ----------------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def triton_path():
    """The Gluon kernels switched off for the duration (ops/hopper.gluon_runs reads configs.GLUON_ALLOWED)."""
    from . import configs

    allowed = configs.GLUON_ALLOWED
    configs.GLUON_ALLOWED = False
    try:
        yield
    finally:
        configs.GLUON_ALLOWED = allowed


def on_triton_path(function: Callable) -> Callable:
    """function, called with the Gluon kernels switched off (triton_path)."""
    def call(*args):
        with triton_path():
            return function(*args)
    return call


def attention_call(provider: str, problem: Problem) -> Callable:
    """fn(q, k, v) -> out for the row, with q / k / v in the layout of the problem's tensors (SDPA's (B, H, S, D)
    views are made inside). Raises Unsupported where the provider cannot express the row."""
    if provider in ("flashtriton", "flashtriton-triton"):
        call = _flashtriton_call(problem)
        return call if provider == "flashtriton" else on_triton_path(call)
    if provider == "fa4":
        return _fa4_call(problem)
    if provider in ("sdpa-cudnn", "sdpa-flash"):
        return _sdpa_call(provider, problem)
    raise ValueError(f"unknown provider {provider!r}; expected one of {PROVIDERS}")


def _flashtriton_call(problem: Problem) -> Callable:
    from .interface import flash_attn_func, flash_attn_varlen_func

    options = dict(causal=problem.causal, window_size=problem.window, softcap=problem.feature.softcap,
                   alibi_slopes=problem.alibi_slopes, learnable_sink=problem.learnable_sink)
    if not problem.feature.varlen:
        return lambda q, k, v: flash_attn_func(q, k, v, **options)
    cu, max_seqlen = problem.cu_seqlens, problem.max_seqlen
    if problem.block_table is None:
        return lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, **options)
    cu_k = _cumulative(problem.lengths, problem.q.device)  # paged: the keys' lengths, rows found in the block table
    return lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu_k, max_seqlen, max_seqlen,
                                                  block_table=problem.block_table, **options)


def _fa4_call(problem: Problem) -> Callable:
    try:
        from flash_attn.cute import flash_attn_func as fa4_func, flash_attn_varlen_func as fa4_varlen_func
    except ImportError as error:
        raise Unsupported(f"flash_attn.cute does not import ({error})") from error
    if problem.alibi_slopes is not None:
        raise Unsupported("FA4 has no ALiBi")
    left, right = problem.window
    options = dict(causal=problem.causal, window_size=(None if left < 0 else left, None if right < 0 else right),
                   softcap=problem.feature.softcap)
    if problem.learnable_sink is not None:
        options["learnable_sink"] = problem.learnable_sink

    def first(result):
        return result[0] if isinstance(result, tuple) else result

    if not problem.feature.varlen:
        return lambda q, k, v: first(fa4_func(q, k, v, **options))
    cu, max_seqlen = problem.cu_seqlens, problem.max_seqlen
    if problem.block_table is None:
        return lambda q, k, v: first(fa4_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
                                                     max_seqlen_k=max_seqlen, **options))
    return lambda q, k, v: first(fa4_varlen_func(q, k, v, cu_seqlens_q=cu, max_seqlen_q=max_seqlen,
                                                 max_seqlen_k=max_seqlen, seqused_k=problem.seqused_k,
                                                 page_table=problem.block_table, **options))


def _sdpa_call(provider: str, problem: Problem) -> Callable:
    feature = problem.feature
    if feature.varlen:
        raise Unsupported("SDPA takes no packed varlen sequences or paged caches")
    if problem.window != (-1, -1) or feature.softcap or feature.alibi:
        raise Unsupported("SDPA expresses windows, softcap and ALiBi only through explicit masks or biases")
    if feature.sinks:
        raise Unsupported("SDPA has no learnable sinks")
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    backend = bench._sdpa_backend(provider)
    gqa = feature.num_heads != feature.num_heads_k
    # SDPA's causal mask is top-left aligned; every causal row here has Sq == Sk (one-row rows are not causal)
    causal = problem.causal

    def run(q, k, v):
        with sdpa_kernel([backend]):
            out = scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=causal, enable_gqa=gqa)
        return out.transpose(1, 2)
    return run


# ----------------------------------------------------------------------------------------------------------------
# Timing and checks
# ----------------------------------------------------------------------------------------------------------------

def timed(attention: Callable, problem: Problem, mode: str) -> Callable:
    """The function to time: the forward without autograd, or the backward alone (autograd.grad of one forward's
    output, its graph kept)."""
    if mode == "fwd":
        def forward():
            with torch.no_grad():
                return attention(problem.q, problem.k, problem.v)
        return forward
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (problem.q, problem.k, problem.v))
    out = attention(q, k, v)
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def reference_check(problem: Problem, out: torch.Tensor) -> tuple:
    """(relative L_inf error, passed) of a forward output against the float32 reference, on the query heads of the
    first KV head (all sequences)."""
    from .reference import attention_reference, attention_reference_varlen

    group = problem.feature.num_heads // problem.feature.num_heads_k
    slopes = None if problem.alibi_slopes is None else problem.alibi_slopes[:group]
    sinks = None if problem.learnable_sink is None else problem.learnable_sink[:group]
    options = dict(causal=problem.causal, window_size=problem.window, softcap=problem.feature.softcap,
                   alibi_slopes=slopes, compute_dtype=torch.float32, learnable_sink=sinks)
    q, k, v = problem.q[..., :group, :], problem.k[..., :1, :], problem.v[..., :1, :]
    if not problem.feature.varlen:
        ref = attention_reference(q, k, v, **options)[0]
        ours = out[..., :group, :]
    else:
        cu = problem.cu_seqlens
        if problem.block_table is not None:
            k, v = (_gather_pages(t, problem) for t in (k, v))
        ref = attention_reference_varlen(q, k, v, cu, cu, problem.max_seqlen, **options)[0]
        ours = out[:, :group]
    error = bench.relative_linf(ours, ref)
    return error, error <= bench.REL_LINF_GATES[problem.q.dtype]


def _gather_pages(cache: torch.Tensor, problem: Problem) -> torch.Tensor:
    """A paged cache's keys (or values) of every sequence, packed as (T, Hk, D)."""
    page_size = cache.shape[1]
    parts = []
    for row, length in enumerate(problem.lengths):
        pages = problem.block_table[row, :-(-length // page_size)].long()
        parts.append(cache[pages].flatten(0, 1)[:length])
    return torch.cat(parts)


@dataclass
class FeatureRow:
    """One timed (feature, causal, dtype, mode, provider); ms None where the provider cannot run it."""

    feature: str
    causal: bool
    dtype: str
    mode: str
    provider: str
    ms: Optional[float] = None
    throughput: Optional[float] = None
    unit: str = ""
    status: str = "ok"
    rel_error: Optional[float] = None
    correct: Optional[bool] = None


def run_features(features: Sequence[Feature], providers: Sequence[str], modes: Sequence[str],
                 dtypes: Sequence[torch.dtype], timing: str = "wall", warmup: int = 25, rep: int = 100,
                 progress: Optional[Callable[[int, int, str], None]] = None, device="cuda",
                 causal_values: Sequence[bool] = (False, True)) -> bench.BenchResult:
    """Time every row of the matrix on the current CUDA device (timing: a bench.TIMINGS key); causal_values narrows
    the causal settings each feature runs with."""
    plan = [(feature, causal, dtype, mode) for dtype in dtypes for feature in features
            for causal in feature.causal_values if causal in causal_values for mode in modes if mode in feature.modes]
    total, done, rows = len(plan) * len(providers), 0, []
    for feature, causal, dtype, mode in plan:
        problem = make_problem(feature, causal, dtype, device)
        dtype_name = next(name for name, value in bench.DTYPES.items() if value == dtype)
        for provider in providers:
            done += 1
            if progress:
                progress(done, total, f"{provider} {feature.name} causal={causal} {dtype_name} {mode}")
            row = FeatureRow(feature.name, causal, dtype_name, mode, provider)
            try:
                attention = attention_call(provider, problem)
                if mode == "fwd" and provider.startswith("flashtriton"):
                    with torch.no_grad():
                        row.rel_error, row.correct = reference_check(problem, attention(problem.q, problem.k,
                                                                                       problem.v))
                function = timed(attention, problem, mode)
                if provider == "flashtriton-triton":  # the backward picks its kernels when it runs, not at the forward
                    function = on_triton_path(function)
                row.ms = bench.time_ms(function, timing, warmup, rep)
                row.throughput, row.unit = throughput(problem, mode, row.ms)
            except Exception as error:  # noqa: BLE001 - a provider's failure is data, not a crash
                row.status = bench._unavailable(error) if not isinstance(error, Unsupported) else \
                    f"unsupported: {error}"
                row.ms = None
            rows.append(row)
        del problem
        torch.cuda.empty_cache()
    metadata = {**bench.run_metadata(), "timing": timing}
    if any(feature.head_dim > 256 for feature in features) and str(device).startswith("cuda"):
        # rows past head dim 256 are held against the matmul rate (their bar: a share of it)
        metadata["bf16 matmul TF/s"] = round(bench.matmul_tflops(), 1)
    return bench.BenchResult(rows, metadata)


# ----------------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------------

def _speedup(peer: Optional[FeatureRow], ours: Optional[FeatureRow]) -> str:
    """A peer's time divided by flashtriton's (above 1: flashtriton is faster)."""
    if peer is None or ours is None or peer.ms is None or not ours.ms:
        return "-"
    return f"{peer.ms / ours.ms:.2f}"


def features_markdown(rows: Sequence[FeatureRow], metadata: Optional[dict] = None) -> str:
    """One line per (feature, causal, dtype, mode): each provider's ms, flashtriton's throughput, each peer's time
    over flashtriton's, and flashtriton's check."""
    providers = [p for p in PROVIDERS if any(r.provider == p for r in rows)]
    peers = [p for p in PEERS if p in providers]
    groups: dict = {}
    for row in rows:
        groups.setdefault((row.feature, row.causal, row.dtype, row.mode), {})[row.provider] = row
    headers = (["row", "causal", "dtype", "mode"] + [f"{p} ms" for p in providers] + ["ours"]
               + [f"{p} / ours" for p in peers] + ["check"])
    table = []
    for (feature, causal, dtype, mode), by_provider in groups.items():
        ours = by_provider.get("flashtriton")
        line = [feature, "yes" if causal else "no", dtype, mode]
        line += [bench._fmt(by_provider[p].ms, ".3f") if p in by_provider else "-" for p in providers]
        line.append(f"{ours.throughput:.2f} {ours.unit}" if ours and ours.throughput else "-")
        line += [_speedup(by_provider.get(p), ours) for p in peers]
        line.append("-" if ours is None or ours.correct is None else
                    f"{ours.rel_error:.1e} {'ok' if ours.correct else 'WRONG'}")
        table.append(line)
    parts = []
    if metadata:
        parts.append(", ".join(f"{key}: {value}" for key, value in metadata.items() if value is not None))
    parts.append(bench.markdown_table(headers, table, [False] * 4 + [True] * (len(providers) + 1 + len(peers))))
    return "\n\n".join(parts) + "\n"


def write_plot(rows: Sequence[FeatureRow], path: Path) -> bool:
    """FA4's (else cuDNN's) time over flashtriton's per row, one panel per mode, causal rows. False without
    matplotlib or data."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_key = {(r.feature, r.causal, r.dtype, r.mode, r.provider): r for r in rows}
    panels = []
    for mode in MODES:
        bars = []
        for r in rows:
            if r.provider != "flashtriton" or r.mode != mode or not r.ms:
                continue
            for peer in PEERS:
                other = by_key.get((r.feature, r.causal, r.dtype, mode, peer))
                if other is not None and other.ms:
                    bars.append((f"{r.feature} {'causal' if r.causal else 'full'} {r.dtype} vs {peer}",
                                 other.ms / r.ms))
                    break
        if bars:
            panels.append((mode, bars))
    if not panels:
        return False
    height = max(len(bars) for _, bars in panels) * 0.22 + 1.5
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), height), squeeze=False)
    for ax, (mode, bars) in zip(axes[0], panels):
        ax.barh([label for label, _ in bars], [value for _, value in bars])
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=6)
        ax.set_xlabel("peer time / flashtriton time (above 1: flashtriton faster)")
        ax.set_title(mode)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_results(result: bench.BenchResult, out_dir: Path, stem: str = "features") -> list:
    """<stem>.json, <stem>.md and (with matplotlib) <stem>.png in out_dir; returns the paths written."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path, png_path = (out_dir / f"{stem}.{ext}" for ext in ("json", "md", "png"))
    json_path.write_text(json.dumps({"metadata": result.metadata, "rows": [asdict(r) for r in result.rows]},
                                    indent=2) + "\n")
    md_path.write_text(features_markdown(result.rows, result.metadata))
    written = [json_path, md_path]
    if write_plot(result.rows, png_path):
        written.append(png_path)
    return written


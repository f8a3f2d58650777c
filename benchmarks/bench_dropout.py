"""Dropout overhead (GPU): flashtriton at dropout_p = 0 and 0.1 in one process, SDPA's FLASH backend alongside.

    python benchmarks/bench_dropout.py --out DIR [--head-dims 64,128] [--causal both] [--seqlen 4096]

The target: the forward and the backward with p = 0.1 cost at most 10% more than with p = 0, i.e.
ms(p=0.1) / ms(p=0) <= 1.10. The shapes are the baseline shapes' sizes: 16k tokens (batch = tokens / seqlen) and
hidden 2048 (heads = 2048 / head_dim), random N(0, 1) inputs. Every (provider, mode, p) is the median of
triton.testing.do_bench (after a compiling call), taken --rounds times with p = 0 and p = 0.1 alternating; the
row keeps the smallest median. SDPA-flash (FA2's own kernels) is timed with the same dropout_p so its own
dropout overhead reads from the same run. FLOPs are those of attention without dropout (bench.py's count), so
TF/s at p = 0.1 is "effective" throughput.

Sanity checks per (head_dim, causal): the p = 0.1 output and gradients of the benchmarked shape are finite and
differ from p = 0; on a small shape (2 x 256 x 4 heads) the drop rate read from S_dmask (sign bit set = dropped,
among visible positions) is within 0.01 of p, and the output matches the float32 reference applied with that
keep mask.

Writes DIR/dropout.json (metadata + rows + checks) and DIR/dropout.md, after every configuration, and prints the
Markdown. Exit status: 0 measured and every sanity check passed; 1 a sanity check failed (results still written);
2 no CUDA GPU (nothing is measured: this benchmark times compiled kernels).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

if importlib.util.find_spec("flashtriton") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

EXIT_OK, EXIT_CHECK_FAILED, EXIT_CANNOT_RUN = 0, 1, 2
PROVIDERS = ("flashtriton", "sdpa-flash")
MODES = ("fwd", "bwd", "fwd+bwd")
TARGET_RATIO = 1.10  # ms(p) / ms(p=0), forward and backward
DROP_RATE_TOLERANCE = 0.01  # docs/api.md §4.7
SMALL_SHAPE = (2, 256, 4)  # batch, seqlen, heads of the drop-rate / mask check


def int_list(text: str) -> list:
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error


def name_list(choices):
    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if item not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {', '.join(choices)}")
        return items
    return parse


def default_out_dir() -> Path:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path(__file__).resolve().parent / "results" / f"{stamp}-dropout"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int_list, default=[64, 128], help="comma-separated (default 64,128)")
    parser.add_argument("--causal", choices=("both", "on", "off"), default="both")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seqlen (default 16384)")
    parser.add_argument("--hidden", type=int, default=2048, help="heads * head_dim (default 2048)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--dropout", type=float, default=0.1, help="the p compared with p = 0 (default 0.1)")
    parser.add_argument("--modes", type=name_list(MODES), default=list(MODES),
                        help="comma-separated subset of fwd, bwd (backward only), fwd+bwd")
    parser.add_argument("--providers", type=name_list(PROVIDERS), default=list(PROVIDERS))
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup in ms (default 25)")
    parser.add_argument("--rep", type=int, default=200, help="do_bench repetition time in ms (default 200)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternating p = 0 / p timings per (provider, mode); the smallest median is kept")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for dropout.json and dropout.md (default benchmarks/results/<UTC time>-dropout)")
    args = parser.parse_args(argv)
    if not 0.0 < args.dropout < 1.0:
        parser.error("--dropout must be in (0, 1)")
    if args.tokens % args.seqlen:
        parser.error("--tokens must be a multiple of --seqlen")
    bad = [d for d in args.head_dims if args.hidden % d]
    if bad:
        parser.error(f"--hidden {args.hidden} is not a multiple of head dims {bad}")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.out is None:
        args.out = default_out_dir()
    return args


# ----------------------------------------------------------------------------------------------------------------
# Timed functions
# ----------------------------------------------------------------------------------------------------------------

def attention_fn(provider: str, causal: bool, dropout_p: float):
    """fn(q, k, v) -> out in the provider's layout: (B, S, H, D) for flashtriton, (B, H, S, D) for SDPA."""
    import flashtriton

    if provider == "flashtriton":
        return lambda q, k, v: flashtriton.flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def run_sdpa(q, k, v):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)

    return run_sdpa


def timed_fn(provider: str, mode: str, causal: bool, dropout_p: float, q, k, v):
    """What do_bench times: fwd under no_grad; bwd the backward of a graph built once; fwd+bwd both."""
    from flashtriton.bench import timed_attention

    return timed_attention(attention_fn(provider, causal, dropout_p), provider, mode, q, k, v)


def unavailable(error: Exception) -> str:
    text = str(error).strip()
    first = text.splitlines()[0][:160] if text else ""
    return f"unavailable: {type(error).__name__}: {first}"


def time_pair(provider: str, mode: str, causal: bool, dropout_p: float, q, k, v, args) -> dict:
    """{p: (best median ms or None, all medians, status)} for p in (0, dropout_p), alternating over rounds."""
    import torch

    from flashtriton.bench import median_ms

    ps = (0.0, dropout_p)
    fns, status, medians = {}, {}, {p: [] for p in ps}
    for p in ps:
        try:
            fns[p] = timed_fn(provider, mode, causal, p, q, k, v)
            fns[p]()  # compiles outside the timed region
            torch.cuda.synchronize()
            status[p] = "ok"
        except Exception as error:  # noqa: BLE001 - a provider that cannot run this is data, not a crash
            status[p] = unavailable(error)
    for round_index in range(args.rounds):
        for p in (ps if round_index % 2 == 0 else ps[::-1]):
            if status[p] != "ok":
                continue
            try:
                medians[p].append(median_ms(fns[p], warmup=args.warmup, rep=args.rep))
            except Exception as error:  # noqa: BLE001
                status[p] = unavailable(error)
    del fns
    return {p: (min(medians[p]) if status[p] == "ok" and medians[p] else None, medians[p], status[p]) for p in ps}


# ----------------------------------------------------------------------------------------------------------------
# Sanity checks
# ----------------------------------------------------------------------------------------------------------------

def big_shape_checks(causal: bool, dropout_p: float, q, k, v) -> dict:
    """The p > 0 output and gradients of the benchmarked shape are finite and differ from p = 0."""
    import torch

    import flashtriton

    with torch.no_grad():
        out_0 = flashtriton.flash_attn_func(q, k, v, dropout_p=0.0, causal=causal)
        out_p = flashtriton.flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out_g = flashtriton.flash_attn_func(*leaves, dropout_p=dropout_p, causal=causal)
    grads = torch.autograd.grad(out_g, leaves, torch.randn_like(out_g))
    return {
        "out_finite": bool(torch.isfinite(out_p).all()),
        "grads_finite": all(bool(torch.isfinite(g).all()) for g in grads),
        "differs_from_p0": not torch.equal(out_0, out_p),
    }


def small_shape_checks(head_dim: int, causal: bool, dtype, dropout_p: float, device: str = "cuda") -> dict:
    """Drop rate from S_dmask (sign bit = dropped, among visible positions) and out vs the masked reference."""
    import torch

    import flashtriton
    from flashtriton.bench import REL_LINF_GATES, relative_linf
    from flashtriton.reference import attention_reference

    batch, seqlen, heads = SMALL_SHAPE
    generator = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, generator=generator, device=device, dtype=dtype)
               for _ in range(3))
    with torch.no_grad():
        out, _, s_dmask = flashtriton.flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal,
                                                      return_attn_probs=True)
    signed = s_dmask[:, :, :seqlen, :seqlen]
    visible = torch.ones(seqlen, seqlen, dtype=torch.bool, device=device)
    if causal:
        visible = visible.tril()
    dropped = torch.signbit(signed)
    rate = float(dropped[..., visible].float().mean())
    keep = ~dropped
    ref, _ = attention_reference(q, k, v, None, causal, (-1, -1), 0.0, None, dropout_p, keep,
                                 compute_dtype=torch.float32)
    rel = relative_linf(out, ref)
    return {
        "small_shape": f"{batch}x{seqlen}x{heads}x{head_dim}",
        "s_dmask_shape": list(s_dmask.shape),
        "drop_rate": rate,
        "drop_rate_ok": abs(rate - dropout_p) <= DROP_RATE_TOLERANCE,
        "dropped_outside_visible": int(dropped[..., ~visible].sum()),
        "masked_ref_rel_error": rel,
        "masked_ref_ok": rel <= REL_LINF_GATES[dtype],
    }


def run_checks(head_dim: int, causal: bool, dtype, dropout_p: float, q, k, v) -> dict:
    check = {"head_dim": head_dim, "causal": causal, "status": "ok"}
    try:
        check.update(big_shape_checks(causal, dropout_p, q, k, v))
        check.update(small_shape_checks(head_dim, causal, dtype, dropout_p, q.device.type))
    except Exception as error:  # noqa: BLE001 - reported as a failed check
        check["status"] = unavailable(error).replace("unavailable", "error", 1)
    flags = ("out_finite", "grads_finite", "differs_from_p0", "drop_rate_ok", "masked_ref_ok")
    check["passed"] = check["status"] == "ok" and all(check.get(flag) for flag in flags) \
        and check.get("dropped_outside_visible") == 0
    return check


# ----------------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------------

def fmt(value, spec: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def ratio(numerator, denominator):
    return numerator / denominator if numerator is not None and denominator else None


def summary_rows(rows: list, dropout_p: float) -> list:
    """One dict per (head_dim, causal, mode): ms/TF/s at p = 0 and p for each provider and the cost ratios."""
    groups: dict = {}
    for row in rows:
        key = (row["head_dim"], row["heads"], row["causal"], row["mode"])
        groups.setdefault(key, {})[(row["provider"], row["dropout_p"])] = row
    out = []
    for (head_dim, heads, causal, mode), by in groups.items():
        line = {"head_dim": head_dim, "heads": heads, "causal": causal, "mode": mode}
        for provider in PROVIDERS:
            zero, drop = by.get((provider, 0.0)), by.get((provider, dropout_p))
            line[provider] = {
                "ms0": zero and zero["ms"], "msp": drop and drop["ms"],
                "tf0": zero and zero["tflops"], "tfp": drop and drop["tflops"],
                "ratio": ratio(drop and drop["ms"], zero and zero["ms"]),
            } if zero or drop else None
        out.append(line)
    return out


def markdown(result: dict) -> str:
    args, rows, checks = result["args"], result["rows"], result["checks"]
    p = args["dropout"]
    meta = ", ".join(f"{k}: {v}" for k, v in result["metadata"].items() if v is not None)
    batch, seqlen = args["tokens"] // args["seqlen"], args["seqlen"]
    parts = [meta, f"Dropout overhead, {args['dtype']}, batch {batch} x seqlen {seqlen} ({args['tokens']} tokens), "
                   f"hidden {args['hidden']}; ratio = ms(p={p}) / ms(p=0); target: flashtriton ratio <= "
                   f"{TARGET_RATIO:.2f} (fwd and bwd). Median of do_bench (warmup {args['warmup']} ms, rep "
                   f"{args['rep']} ms), best of {args['rounds']} alternating rounds."]
    headers = ["D", "H", "causal", "mode", "ft ms p=0", f"ft ms p={p}", "ft TF/s p=0", f"ft TF/s p={p}", "ft ratio",
               "flash ms p=0", f"flash ms p={p}", "flash TF/s p=0", f"flash TF/s p={p}", "flash ratio",
               f"ft/flash TF/s p={p}", f"ft <= {TARGET_RATIO:.2f}"]
    table, verdicts = [], []
    for line in summary_rows(rows, p):
        ft, fl = line["flashtriton"] or {}, line["sdpa-flash"] or {}
        met = None if ft.get("ratio") is None else ft["ratio"] <= TARGET_RATIO
        if met is not None and line["mode"] in ("fwd", "bwd"):
            verdicts.append((met, ft["ratio"], line))
        table.append([line["head_dim"], line["heads"], "yes" if line["causal"] else "no", line["mode"],
                      fmt(ft.get("ms0"), ".3f"), fmt(ft.get("msp"), ".3f"), fmt(ft.get("tf0"), ".1f"),
                      fmt(ft.get("tfp"), ".1f"), fmt(ft.get("ratio"), ".3f"),
                      fmt(fl.get("ms0"), ".3f"), fmt(fl.get("msp"), ".3f"), fmt(fl.get("tf0"), ".1f"),
                      fmt(fl.get("tfp"), ".1f"), fmt(fl.get("ratio"), ".3f"),
                      fmt(ratio(ft.get("tfp"), fl.get("tfp")), ".2f"),
                      "-" if met is None else ("yes" if met else "NO")])
    from flashtriton.bench import markdown_table

    parts.append(markdown_table(headers, table, [True, True, False, False] + [True] * 11 + [False]))
    if verdicts:
        worst = max(verdicts, key=lambda v: v[1])
        w = worst[2]
        parts.append(f"Target (fwd and bwd rows): {sum(v[0] for v in verdicts)}/{len(verdicts)} within "
                     f"{TARGET_RATIO:.2f}; worst flashtriton ratio {worst[1]:.3f} (D={w['head_dim']}, "
                     f"causal={'yes' if w['causal'] else 'no'}, {w['mode']}).")
    check_headers = ["D", "causal", "out finite", "grads finite", "differs from p=0", "drop rate (small shape)",
                     f"rate within {DROP_RATE_TOLERANCE} of p", "out vs masked ref (rel)", "passed"]
    check_rows = []
    for c in checks:
        yes = lambda flag: "-" if c.get(flag) is None else ("yes" if c[flag] else "NO")  # noqa: E731
        check_rows.append([c["head_dim"], "yes" if c["causal"] else "no", yes("out_finite"), yes("grads_finite"),
                           yes("differs_from_p0"), fmt(c.get("drop_rate"), ".4f"), yes("drop_rate_ok"),
                           fmt(c.get("masked_ref_rel_error"), ".1e") + ("" if c.get("masked_ref_ok", True) else
                                                                        " WRONG"),
                           "yes" if c["passed"] else f"NO ({c['status']})" if c["status"] != "ok" else "NO"])
    if check_rows:
        parts.append(f"Sanity checks at p = {p} (drop rate and masked reference on a {SMALL_SHAPE[0]}x"
                     f"{SMALL_SHAPE[1]}x{SMALL_SHAPE[2]} shape per head dim):\n\n"
                     + markdown_table(check_headers, check_rows, [True, False, False, False, False, True]))
    problems = sorted({f"{r['provider']} p={r['dropout_p']} {r['mode']}: {r['status']}" for r in rows
                       if r["status"] != "ok"})
    if problems:
        parts.append("Unavailable:\n" + "\n".join(f"- {line}" for line in problems))
    return "\n\n".join(parts) + "\n"


def write(result: dict, out_dir: Path) -> list:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "dropout.json", out_dir / "dropout.md"
    json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    md_path.write_text(markdown(result))
    return [json_path, md_path]


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_dropout: no CUDA GPU; this benchmark times the compiled kernels on a GPU, nothing measured "
              "(exit 2).", file=sys.stderr)
        return EXIT_CANNOT_RUN

    from flashtriton.bench import DTYPES, Shape, attention_flops, random_inputs, run_metadata, tflops_per_second
    from flashtriton.ops import backend

    if backend.KERNELS_INTERPRETED:
        print("bench_dropout: TRITON_INTERPRET=1 is set; unset it to time compiled kernels (exit 2).",
              file=sys.stderr)
        return EXIT_CANNOT_RUN
    dtype = DTYPES[args.dtype]
    causal_values = {"both": (False, True), "on": (True,), "off": (False,)}[args.causal]
    batch = args.tokens // args.seqlen
    result = {"metadata": dict(run_metadata(), script="benchmarks/bench_dropout.py"),
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "rows": [], "checks": []}
    start = time.perf_counter()
    configs = [(d, c) for d in args.head_dims for c in causal_values]
    for index, (head_dim, causal) in enumerate(configs):
        shape = Shape(batch, args.seqlen, args.hidden // head_dim, head_dim)
        torch.manual_seed(0)
        q, k, v = random_inputs(shape, dtype)
        print(f"[{index + 1}/{len(configs)}] {shape.label()} causal={causal} ({time.perf_counter() - start:.0f} s)",
              file=sys.stderr, flush=True)
        result["checks"].append(run_checks(head_dim, causal, dtype, args.dropout, q, k, v))
        for mode in args.modes:
            flops = attention_flops(shape.batch, shape.heads, shape.seqlen, shape.seqlen, head_dim, causal, mode)
            for provider in args.providers:
                timings = time_pair(provider, mode, causal, args.dropout, q, k, v, args)
                for p, (ms, medians, status) in timings.items():
                    result["rows"].append({
                        "provider": provider, "batch": shape.batch, "seqlen": shape.seqlen, "heads": shape.heads,
                        "head_dim": head_dim, "causal": causal, "dtype": args.dtype, "mode": mode, "dropout_p": p,
                        "ms": ms, "tflops": None if ms is None else tflops_per_second(flops, ms),
                        "round_medians_ms": medians, "status": status})
        del q, k, v
        torch.cuda.empty_cache()
        write(result, args.out)  # partial results survive an interrupted run
    result["metadata"]["elapsed_s"] = round(time.perf_counter() - start, 1)
    paths = write(result, args.out)
    print(markdown(result))
    for path in paths:
        print(f"wrote {path}")
    return EXIT_OK if all(c["passed"] for c in result["checks"]) else EXIT_CHECK_FAILED


if __name__ == "__main__":
    sys.exit(main())

"""The `flashtriton` command (also `python -m flashtriton`): parse arguments, call the module that does the work.

Subcommands: validate (validate.py), env (env.py), bench (bench.py), warmup (warmup.py), inspect (kernel_inspect.py).
Exit status: 0 success, 1 a gate failed, 2 the command cannot run here (for example no CUDA GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

EXIT_OK, EXIT_GATE_FAILED, EXIT_CANNOT_RUN = 0, 1, 2


def out(text: str = "") -> None:
    """User-facing output of the command."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def err(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def comma_list(choices: Optional[Sequence[str]] = None) -> Callable[[str], list]:
    """argparse type: 'a,b' -> ['a', 'b'], each checked against choices."""
    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if choices is not None and item not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(choices or ['values'])}")
        return items
    return parse


def int_list(text: str) -> list:
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error


def cuda_unavailable(reason: str) -> bool:
    """True (after saying why) when compiled kernels cannot run here: no CUDA GPU, or kernels interpreted."""
    import torch

    from .ops import backend

    if not torch.cuda.is_available():
        err(f"no CUDA GPU: {reason}")
        return True
    if backend.KERNELS_INTERPRETED:
        err(f"kernels are interpreted (TRITON_INTERPRET=1): {reason}")
        return True
    return False


# ----------------------------------------------------------------------------------------------------------------
# Subcommands
# ----------------------------------------------------------------------------------------------------------------

def validate_command(args, argv: Sequence[str]) -> int:
    from . import validate

    return validate.run_command(args.device, args.full, args.report, args.inject_fault, argv)


def env_command(args) -> int:
    from . import env

    info = env.collect_environment()
    out(json.dumps(env.environment_dict(info), indent=2) if args.json else env.format_environment(info))
    return EXIT_OK


def add_bench_arguments(parser: argparse.ArgumentParser, default_out: str = "bench-results") -> None:
    """The options of `flashtriton bench`, shared with benchmarks/bench_attention.py."""
    from . import bench, bench_features

    parser.add_argument("--dtype", choices=sorted(bench.DTYPES) + ["both"], default="bf16",
                        help="both: bf16, then fp16")
    parser.add_argument("--modes", type=comma_list(bench.MODES),
                        help="comma-separated: fwd, bwd (backward only), fwd+bwd (also measures peak memory), "
                             "fwd+bwd-graph (the fwd+bwd step replayed from a CUDA graph: no host cost); default: "
                             "all of them, or fwd,bwd with --features (which takes only those two)")
    parser.add_argument("--shapes", choices=sorted(bench.SHAPE_SETS), default="baseline",
                        help="baseline: the baseline shapes (16k tokens, hidden 2048); quick: two small ones")
    parser.add_argument("--providers", type=comma_list(bench.PROVIDERS + bench_features.PROVIDERS[1:2]),
                        help=f"comma-separated subset of {', '.join(bench.PROVIDERS)} (default: all but fa4, "
                        "FlashAttention-4, which needs the flash-attn-4 package); with --features a subset of "
                        f"{', '.join(bench_features.PROVIDERS)} (default: all, fa4 where it imports)")
    parser.add_argument("--features", action="store_true",
                        help="the feature matrix instead of the shapes (bench_features.py): every feature row "
                             "x causal x dtype x mode, written as features.json / .md / .png")
    parser.add_argument("--rows", type=comma_list([f.name for f in bench_features.FEATURES]),
                        help="with --features: a comma-separated subset of the rows "
                             f"({', '.join(f.name for f in bench_features.FEATURES)})")
    parser.add_argument("--causal", choices=("both", "on", "off"), default="both")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup in ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time in ms")
    parser.add_argument("--timing", choices=sorted(bench.TIMINGS), default="wall",
                        help="; ".join(f"{name}: {text}" for name, text in bench.TIMINGS.items()))
    parser.add_argument("--out", type=Path, default=Path(default_out),
                        help="directory for bench.json, bench.md and (with matplotlib) bench.png")


def chosen_providers(args) -> list:
    """--providers, or its default: bench.DEFAULT_PROVIDERS, or with --features every feature-matrix provider."""
    from . import bench, bench_features

    if args.providers:
        return list(args.providers)
    return list(bench_features.PROVIDERS if args.features else bench.DEFAULT_PROVIDERS)


CAUSAL_VALUES = {"both": (False, True), "on": (True,), "off": (False,)}


def bench_command(args) -> int:
    if cuda_unavailable("bench times the kernels on a CUDA GPU"):
        return EXIT_CANNOT_RUN
    from . import bench
    from .validate import Progress

    dtypes = [bench.DTYPES["bf16"], bench.DTYPES["fp16"]] if args.dtype == "both" else [bench.DTYPES[args.dtype]]
    if args.features:
        return features_command(args, dtypes)
    providers = chosen_providers(args)
    if "flashtriton-triton" in providers:
        err("the flashtriton-triton provider is a column of --features only")
        return EXIT_CANNOT_RUN
    causal_values = CAUSAL_VALUES[args.causal]
    progress = Progress(0)
    rows, metadata = [], {}
    for dtype in dtypes:
        result = bench.run_benchmarks(bench.SHAPE_SETS[args.shapes], providers, args.modes or list(bench.MODES),
                                      dtype, causal_values, args.warmup, args.rep,
                                      progress=lambda done, total, label: progress.update(done, label, total),
                                      timing=args.timing)
        rows += result.rows
        metadata = result.metadata
    progress.finish()
    result = bench.BenchResult(rows, metadata)
    out(bench.results_markdown(result.rows, result.metadata))
    for path in bench.write_results(result, args.out):
        out(f"wrote {path}")
    return EXIT_OK


def features_command(args, dtypes) -> int:
    """`flashtriton bench --features`: the feature matrix (bench_features.py)."""
    from . import bench_features
    from .validate import Progress

    modes = args.modes or list(bench_features.MODES)
    if not set(modes) <= set(bench_features.MODES):
        err(f"--features takes the modes {', '.join(bench_features.MODES)}, got {', '.join(modes)}")
        return EXIT_CANNOT_RUN
    providers = chosen_providers(args)
    unknown = [p for p in providers if p not in bench_features.PROVIDERS]
    if unknown:
        err(f"--features takes the providers {', '.join(bench_features.PROVIDERS)}, got {', '.join(unknown)}")
        return EXIT_CANNOT_RUN
    progress = Progress(0)
    result = bench_features.run_features(bench_features.select_features(args.rows), providers, modes, dtypes,
                                         args.timing, args.warmup, args.rep,
                                         progress=lambda done, total, label: progress.update(done, label, total),
                                         causal_values=CAUSAL_VALUES[args.causal])
    progress.finish()
    out(bench_features.features_markdown(result.rows, result.metadata))
    for path in bench_features.write_results(result, args.out):
        out(f"wrote {path}")
    return EXIT_OK


def warmup_command(args) -> int:
    if cuda_unavailable("warmup compiles the kernels for a CUDA GPU"):
        return EXIT_CANNOT_RUN
    from . import env, warmup
    from .bench import DTYPES
    from .validate import Progress

    progress = Progress(0)
    results = warmup.warm_up(args.head_dims, [DTYPES[name] for name in args.dtypes],
                             progress=lambda done, total, label: progress.update(done, label, total))
    progress.finish()
    out(warmup.results_table(results))
    out(f"Triton cache: {env.triton_cache_dir()}")
    return EXIT_OK if all(r.status == "ok" for r in results) else EXIT_GATE_FAILED


def inspect_command(args) -> int:
    if cuda_unavailable("inspect needs compiled kernels"):
        return EXIT_CANNOT_RUN
    import torch

    from . import kernel_inspect
    from .bench import DTYPES

    kernel_inspect.run_config(args.head_dim, args.causal, DTYPES[args.dtype], args.seqlen, args.batch, args.heads)
    reports = kernel_inspect.inspect_compiled()
    capability = torch.cuda.get_device_capability()
    out(f"{torch.cuda.get_device_name()} (sm_{capability[0]}{capability[1]}): head dim {args.head_dim}, "
        f"causal={args.causal}, {args.dtype}, seqlen {args.seqlen}")
    out(kernel_inspect.reports_table(reports))
    if reports and not any(r.sass_counts for r in reports):
        out("SASS: no cuobjdump/nvdisasm found (PATH or triton/backends/nvidia/bin); SASS counts omitted")
    failures = kernel_inspect.gate_failures(reports, capability)
    for failure in failures:
        out(f"FAIL {failure}")
    if capability[0] == 9 and not failures:
        out("gates (sm_90 forward: wgmma/HGMMA present, no local memory (spills) in the key-block loops): pass")
    return EXIT_GATE_FAILED if failures else EXIT_OK


# ----------------------------------------------------------------------------------------------------------------
# Parser
# ----------------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashtriton", description="flashtriton: the flash_attn 2.x API on Triton.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    validate = commands.add_parser(
        "validate", help="check the kernels on this machine against the float64 reference",
        description="Run every API path, an accuracy sweep, backward checks and edge probes against the float64 "
                    "reference (plus a latency table on CUDA). On CPU the Triton kernels run in Triton's "
                    "interpreter: the command re-runs itself with TRITON_INTERPRET=1 when needed. "
                    "Exit status 1 when any gate fails.")
    validate.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                          help="auto: cuda when available, else cpu (default)")
    size = validate.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="full", action="store_false", help="small sizes (default)")
    size.add_argument("--full", dest="full", action="store_true", help="more sizes, head dims and dtypes")
    validate.add_argument("--report", type=Path, metavar="DIR",
                          help="write DIR/validate.md and DIR/validate.json (DIR is created if missing)")
    validate.add_argument("--inject-fault", action="store_true", help=argparse.SUPPRESS)
    validate.set_defaults(full=False)

    env = commands.add_parser("env", help="versions, devices, supported features, Triton cache dir")
    env.add_argument("--json", action="store_true", help="print JSON instead of text")

    bench = commands.add_parser("bench", help="time flashtriton against PyTorch SDPA backends (CUDA)")
    add_bench_arguments(bench)

    warmup = commands.add_parser("warmup", help="compile the common configurations into Triton's cache (CUDA)")
    warmup.add_argument("--head-dims", type=int_list, default=[64, 128, 256])
    warmup.add_argument("--dtypes", type=comma_list(("fp16", "bf16")), default=["fp16", "bf16"])

    inspect = commands.add_parser("inspect", help="registers, spills, shared memory and SASS/PTX counts of the "
                                                  "compiled kernels for one configuration (CUDA)")
    inspect.add_argument("--head-dim", type=int, default=128)
    inspect.add_argument("--causal", action="store_true")
    inspect.add_argument("--dtype", choices=("fp16", "bf16"), default="bf16")
    inspect.add_argument("--seqlen", type=int, default=4096)
    inspect.add_argument("--batch", type=int, default=2)
    inspect.add_argument("--heads", type=int, default=16)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    handlers = {"env": env_command, "bench": bench_command, "warmup": warmup_command, "inspect": inspect_command}
    if args.command == "validate":
        return validate_command(args, argv)
    return handlers[args.command](args)

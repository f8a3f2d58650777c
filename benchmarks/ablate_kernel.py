"""Time copies of a kernel module with source edits against the module as it is, in one process (ablations and A/B
tests of kernel changes before building them).

    python benchmarks/ablate_kernel.py --variants FILE [--shapes 4] [--mode bwd] [--out DIR] [--sources A.py,B.py]

FILE is a Python file defining
    MODULE = "flashtriton/kernels/fwd_hopper.py"                    # the kernel module to copy
    TARGET = "flashtriton.ops.hopper_fwd:attn_fwd_hopper_kernel"    # the name the launcher calls it by
    KERNEL = "attn_fwd_hopper_kernel"                               # that kernel's name in MODULE
    VARIANTS = {"no LSE store": [("gl.store(Lse + ...)", "pass")], ...}
    CALL = dict(deterministic=True)                                 # optional: flash_attn_func keyword arguments
    CONFIGS = {"wide keys": {"HOPPER_FWD": {(256, False): dict(block_n=128)}}}  # optional: config fields a variant
                                                                                # changes
    OFFLINE = dict(kind="fwd-hopper", head_dim=128)                 # optional: what --offline compiles
(benchmarks/ablations/ holds the checked-in ones.) --sources adds whole copies of MODULE as variants, one per file,
named by the file's stem: an A/B test of a rewrite against an earlier commit's module (`git show REV:MODULE >
prev.py`; the device copy of the repository may not hold the history, so the file travels instead).
Each variant is MODULE's source with every (old, new) replacement applied (each `old` must occur; results may be
wrong, which is the point of an ablation: the error column says how far). A variant's module is loaded as a
sibling of MODULE, so its relative imports resolve, and its kernel is swapped into TARGET while it is timed.
Timing: the forward (mode fwd) or the backward on a graph built once (mode bwd) of flash_attn_func, bf16, causal
and not, on BASELINES.md shapes (bench.select_shapes indices); the max abs difference of each variant's output
(fwd) or gradients (bwd) from the unmodified module's. --timing wall (default): median time per call
(triton.testing.do_bench), which includes host time where a call's GPU time is shorter than it (the device
machine's host is slow and noisy: 16x1024 rows read up to 30% apart between processes); --timing kernels: the GPU
time of the call's kernels (torch.profiler, mean of 20 calls), which leaves host time out. --rounds N times
every variant N times, each round in another order (the first slot of a shape sometimes reads low), and reports
the median with +- half the spread between rounds: an A/A pair (the module itself again by --sources) shows the
noise floor of a comparison. Writes
DIR/ablate.json. --offline needs no GPU: it compiles every variant for sm_90 as OFFLINE says (tools/
offline_compile.py: kind fwd-hopper or bwd-hopper, head_dim, ordered), causal and not, and prints its resource
usage (registers, stack: spills show there), so that a variant that does not compile or spills is known before
device time is spent on it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import runpy
import statistics
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

from flashtriton.bench import TIMINGS, attention_flops, select_shapes, time_ms

ROOT = Path(__file__).resolve().parents[1]


def variant_module(module_path: str, edits, name: str, directory: str, source=None) -> ModuleType:
    """A copy of the module at module_path (relative to the repository), or of `source` (the text of another version
    of it), with every (old, new) edit applied, written to directory (Triton reads a kernel's source from its file)
    and loaded as a sibling module named `name`, so that its relative imports resolve."""
    source = (ROOT / module_path).read_text() if source is None else source
    for old, new in edits:
        if old not in source:
            raise ValueError(f"{name}: {old!r} does not occur in {module_path}")
        source = source.replace(old, new)
    path = Path(directory) / f"{name}.py"
    path.write_text(source)
    package = ".".join(Path(module_path).with_suffix("").parts[:-1])
    importlib.import_module(package)
    spec = importlib.util.spec_from_file_location(f"{package}.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def config_overrides(spec: dict, name: str):
    """flashtriton.configs' tables with the fields CONFIGS[name] changes ({table: {key: {field: value}}}) while the
    variant runs or compiles (its kernel may need another tile or stage count); restored after."""
    from flashtriton import configs

    saved = []
    try:
        for table_name, entries in spec.get("CONFIGS", {}).get(name, {}).items():
            table = getattr(configs, table_name)
            for key, fields in entries.items():
                saved.append((table, key, table[key]))
                table[key] = dataclasses.replace(table[key], **fields)
        yield
    finally:
        for table, key, entry in reversed(saved):
            table[key] = entry


def load_variants(spec_file: str, directory: str, only=(), sources=()) -> tuple:
    """(spec, {name: module}) of a variants file (its variables), the unmodified module first as 'as is'; `only`:
    the names of the variants to load (default all); `sources`: files holding other versions of MODULE, each loaded
    as a variant named by its stem."""
    spec = runpy.run_path(spec_file)
    unknown = set(only) - set(spec["VARIANTS"])
    if unknown:
        raise ValueError(f"--only: no variant {sorted(unknown)} in {spec_file}; it has {list(spec['VARIANTS'])}")
    modules = {"as is": variant_module(spec["MODULE"], [], "ablate_as_is", directory)}
    for index, (name, edits) in enumerate(spec["VARIANTS"].items()):
        if not only or name in only:
            modules[name] = variant_module(spec["MODULE"], edits, f"ablate_variant_{index}", directory)
    for index, path in enumerate(sources):
        name = Path(path).stem
        if name in modules:
            raise ValueError(f"--sources: {path} would replace the variant {name!r}; rename the file")
        modules[name] = variant_module(spec["MODULE"], [], f"ablate_source_{index}", directory,
                                       source=Path(path).read_text())
    return spec, modules


def compile_offline(spec: dict, modules: dict, head_dim=None) -> None:
    """Compile each variant's kernel for sm_90 without a GPU (tools/offline_compile.py) and print its resources
    (and for the Gluon forward how much of each consumer loop's softmax runs under its P V product); head_dim
    overrides OFFLINE's."""
    sys.path.insert(0, str(ROOT / "tools"))
    import offline_compile

    options = dict(spec["OFFLINE"])
    kind, spec_head_dim = options.pop("kind"), options.pop("head_dim")
    compile_kernel = {"fwd-hopper": offline_compile.compile_hopper_fwd,
                      "bwd-hopper": offline_compile.compile_hopper_bwd}[kind]
    for name, module in modules.items():
        for causal in (False, True):
            with config_overrides(spec, name):
                compiled = compile_kernel(head_dim or spec_head_dim, causal, kernel=getattr(module, spec["KERNEL"]),
                                          **options)
            overlap = (f" exp2_before_pv_wait {offline_compile.exp2_before_pv_wait(compiled.asm['cubin'])}"
                       if kind == "fwd-hopper" else "")
            print(f"{name} causal={causal}: {offline_compile.resource_usage(compiled)}{overlap}", flush=True)


def rotated_rounds(names: list, rounds: int, measure) -> dict:
    """{name: [measure(name) per round]}, round r measuring the names from the r-th on, wrapping around: no variant
    always takes the first slot of a shape, which sometimes reads low (docs/perf-notes.md)."""
    times = {name: [] for name in names}
    for round_index in range(rounds):
        start = round_index % len(names)
        for name in names[start:] + names[:start]:
            times[name].append(measure(name))
    return times


def _shown(result: dict, rounds: int) -> str:
    spread = f" +-{result['spread'] * 50:.1f}%" if rounds > 1 else ""
    return f"{result['tflops']:.1f}{spread} (diff {result['max_abs_difference']:.1e})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", required=True, help="Python file with MODULE, TARGET, KERNEL and VARIANTS")
    parser.add_argument("--shapes", default="4", help="indices into bench.BASELINE_SHAPES, e.g. 1,4")
    parser.add_argument("--mode", choices=("fwd", "bwd"), default="bwd")
    parser.add_argument("--timing", choices=sorted(TIMINGS), default="wall")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--offline", action="store_true", help="compile the variants for sm_90, no GPU (see above)")
    parser.add_argument("--offline-head-dim", type=int, help="--offline: this head dim instead of OFFLINE's")
    parser.add_argument("--only", default="", help="comma list of the variants to run (default all; 'as is' always)")
    parser.add_argument("--rounds", type=int, default=1, help="time every variant this many times, each round in "
                        "another order (round r starts at the r-th variant); the median is reported, +- half the "
                        "spread between rounds")
    parser.add_argument("--sources", default="", help="comma list of files holding other versions of MODULE, each "
                        "timed as a variant named by its stem")
    args = parser.parse_args()

    spec, modules = load_variants(args.variants, tempfile.mkdtemp(prefix="ablate-"),
                                  [name for name in args.only.split(",") if name],
                                  [path for path in args.sources.split(",") if path])
    if args.offline:
        compile_offline(spec, modules, args.offline_head_dim)
        return

    import flashtriton

    target, kernel_name, call_options = spec["TARGET"], spec["KERNEL"], spec.get("CALL", {})
    owner_name, attribute = target.split(":")
    owner = importlib.import_module(owner_name)
    original = getattr(owner, attribute)
    rows = []
    for batch, seqlen, heads, dim in select_shapes(args.shapes):
        for causal in (False, True):
            q, k, v = (torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=args.mode == "bwd") for _ in range(3))
            dout = torch.randn_like(q)
            flops = attention_flops(batch, heads, seqlen, seqlen, dim, causal, args.mode)

            def with_variant(name, action):
                """action(run) with variant `name`'s kernel swapped in, run() computing its output or gradients."""
                setattr(owner, attribute, getattr(modules[name], kernel_name))
                try:
                    with config_overrides(spec, name):
                        if args.mode == "fwd":
                            def run():
                                with torch.no_grad():
                                    return (flashtriton.flash_attn_func(q, k, v, causal=causal, **call_options), )
                        else:
                            out = flashtriton.flash_attn_func(q, k, v, causal=causal, **call_options)

                            def run():
                                return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                        return action(run)
                finally:
                    setattr(owner, attribute, original)

            reference, errors = None, {}
            for name in modules:
                values = with_variant(name, lambda run: run())
                reference = reference if reference is not None else values
                errors[name] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(values, reference))
            times = rotated_rounds(list(modules), args.rounds,
                                   lambda name: with_variant(name, lambda run: time_ms(run, args.timing)))
            results = {}
            for name in modules:
                tflops = flops / statistics.median(times[name]) * 1e-9
                spread = (max(times[name]) - min(times[name])) / statistics.median(times[name])
                results[name] = dict(tflops=tflops, max_abs_difference=errors[name], spread=spread)
                rows.append(dict(batch=batch, seqlen=seqlen, heads=heads, dim=dim, causal=causal, variant=name,
                                 tflops=tflops, max_abs_difference=errors[name], times_ms=times[name]))
            print(f"{batch}x{seqlen}x{heads}x{dim} causal={causal} {args.mode} TF/s: "
                  + ", ".join(f"{name} {_shown(result, args.rounds)}" for name, result in results.items()), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ablate.json"), "w") as handle:
        json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()

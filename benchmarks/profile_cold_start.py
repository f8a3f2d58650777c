"""Where a fresh process's first forward call spends its time (issue #5's cold start, GPU).

    python benchmarks/profile_cold_start.py [--head-dim 128] [--causal] [--other-head-dim 160] [--top 25]

Runs in this process with a new, empty TRITON_CACHE_DIR (set before triton is imported): imports, CUDA context and
Triton's driver first (outside the profile, as bench_cold_start.py's (a) excludes them), then cProfile around
(a) the first flash_attn_func call and (e) the first call at another head dim. For each it prints the wall time,
the cumulative time of Triton's stages (its own cache key, the front end, each make_* stage, gcc for the launcher,
ptxas) and the top functions by cumulative time, so the one-time part of (a) reads as (a) minus (e) by stage.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# (label, function name, file suffix): the stages of a Triton compile and its per-process work
STAGES = (("triton cache key", "triton_key", "runtime/cache.py"),
          ("front end (AST -> TTIR)", "ast_to_ttir", "compiler/code_generator.py"),
          ("make_ttir (Triton kernels)", "make_ttir", "backends/nvidia/compiler.py"),
          ("make_ttgir (Triton kernels)", "make_ttgir", "backends/nvidia/compiler.py"),
          ("gluon_to_ttgir (Gluon kernels)", "gluon_to_ttgir", "backends/nvidia/compiler.py"),
          ("make_llir", "make_llir", "backends/nvidia/compiler.py"),
          ("make_ptx", "make_ptx", "backends/nvidia/compiler.py"),
          ("make_cubin (ptxas)", "make_cubin", "backends/nvidia/compiler.py"),
          ("gcc (launcher / driver stubs)", "_build", "runtime/build.py"),
          ("module load (cubin -> device)", "_init_handles", "compiler/compiler.py"))


def stage_times(stats: pstats.Stats) -> list:
    rows = []
    for label, name, suffix in STAGES:
        total = sum(entry[3] for (path, _, func), entry in stats.stats.items()
                    if func == name and path.replace(os.sep, "/").endswith(suffix))
        rows.append((label, total))
    return rows


def profiled_call(label: str, fn, top: int) -> None:
    import torch
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    fn()
    torch.cuda.synchronize()
    profile.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profile)
    print(f"\n## {label}: {wall:.3f} s")
    for stage, seconds in stage_times(stats):
        print(f"  {stage:32s} {seconds:7.3f} s")
    print()
    stats.sort_stats("cumulative").print_stats(top)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--other-head-dim", type=int, default=160)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    cache_dir = tempfile.mkdtemp(prefix="flashtriton-cold-")
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    sys.path.insert(0, str(REPO_ROOT))
    try:
        start = time.perf_counter()
        import torch
        import triton

        import flashtriton
        print(f"imports {time.perf_counter() - start:.3f} s")
        if not torch.cuda.is_available():
            print("no CUDA GPU: nothing compiles on CPU")
            return 2
        start = time.perf_counter()
        torch.zeros(1, device="cuda")
        triton.runtime.driver.active.get_current_device()
        print(f"CUDA context + Triton driver {time.perf_counter() - start:.3f} s")

        def call(head_dim: int):
            shape = (2, 512, max(1, 1024 // head_dim), head_dim)
            q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            torch.cuda.synchronize()
            return lambda: flashtriton.flash_attn_func(q, k, v, causal=args.causal)

        profiled_call(f"(a) first call, head dim {args.head_dim}", call(args.head_dim), args.top)
        profiled_call(f"(e) first call, head dim {args.other_head_dim}", call(args.other_head_dim), args.top)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

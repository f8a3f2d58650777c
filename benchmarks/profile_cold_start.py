"""Where a fresh process's first forward call spends its time (issue #5's cold start, GPU).

    python benchmarks/profile_cold_start.py [--head-dim 128] [--causal] [--other-head-dim 160]

Runs in this process with a new, empty TRITON_CACHE_DIR (set before triton is imported): imports, CUDA context and
Triton's driver first (outside the timings, as bench_cold_start.py's (a) leaves them out), then (a) the first
flash_attn_func call and (e) the first call at another head dim. Triton's stages are timed by wrapping them for the
two calls: its own cache key (hashing its sources and libtriton once per process), the front end (AST -> IR), each
make_* stage, ptxas (inside make_cubin), gcc (the launcher: one per kernel signature and specialization); "rest" is
the call's wall time less those (imports inside Triton, binding, the launch itself). The one-time part of (a) reads
as (a) minus (e) by stage. (cProfile was tried first: under Python 3.12 on the GPU machine it lost the front end and
make_llir frames of the compile.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def stage_targets() -> list:
    """(label, owner, attribute) of each Triton function timed: module or class attributes looked up at call time."""
    import triton.runtime.build as build
    import triton.runtime.cache as cache
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    targets = [("Triton's cache key (per process)", cache, "triton_key"),
               ("front end, Triton kernels", ASTSource, "make_ir"),
               ("front end, Gluon kernels", GluonASTSource, "make_ir"),
               ("gcc (launchers)", build, "_build")]
    targets += [(name, CUDABackend, name) for name in ("make_ttir", "make_ttgir", "gluon_to_ttgir", "make_llir",
                                                       "make_ptx")]
    return targets + [("make_cubin (ptxas)", CUDABackend, "make_cubin")]


def stage_function(owner, attribute):
    """The stage as stored on its owner: a class's own entry (a staticmethod object stays one), or a module's."""
    return owner.__dict__[attribute] if isinstance(owner, type) else getattr(owner, attribute)


@contextlib.contextmanager
def timed_stages(totals: dict):
    """Wrap every stage_targets() function so that its wall time adds to totals[label], restoring them afterwards
    (none of them calls another, so no time counts twice; static methods stay static)."""
    originals = []
    for label, owner, attribute in stage_targets():
        original = stage_function(owner, attribute)
        originals.append((owner, attribute, original))

        def wrapper(*args, _original=original, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_label] += time.perf_counter() - start

        setattr(owner, attribute, staticmethod(wrapper) if isinstance(original, staticmethod) else wrapper)
    try:
        yield
    finally:
        for owner, attribute, original in originals:
            setattr(owner, attribute, original)


def timed_call(label: str, fn) -> None:
    import torch

    totals = defaultdict(float)
    with timed_stages(totals):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    print(f"\n## {label}: {wall:.3f} s")
    for stage, _, _ in stage_targets():
        print(f"  {stage:34s} {totals[stage]:7.3f} s")
    print(f"  {'rest':34s} {wall - sum(totals.values()):7.3f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--other-head-dim", type=int, default=160)
    parser.add_argument("--causal", action="store_true")
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

        timed_call(f"(a) first call, head dim {args.head_dim}", call(args.head_dim))
        timed_call(f"(e) first call, head dim {args.other_head_dim}", call(args.other_head_dim))
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

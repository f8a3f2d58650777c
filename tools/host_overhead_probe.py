"""Host time of flashtriton's own Python per call (checks, configs, allocation, launch arguments), without a GPU.

    python tools/host_overhead_probe.py [--calls 2000] [--profile]

The attention kernels are replaced by no-op launchers and CPU tensors are used (TRITON_INTERPRET=1 is set so
they take the kernel path, not the PyTorch reference), so what is timed is the work before Triton's own launch.
On a GPU, tools/profile_first_call.py --steady times the whole eager call instead. Compare numbers only within
one run on one machine (before / after a change).
"""

import argparse
import cProfile
import os
import pstats
import time

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import flashtriton  # noqa: E402
from flashtriton.ops import backend, kvcache  # noqa: E402


class NoLaunch:
    """Stands in for a @triton.jit kernel: kernel[grid](...) does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of each call kind")
    args = parser.parse_args()
    for module in (backend, kvcache):
        for name in dir(module):
            if name.endswith("_kernel"):
                setattr(module, name, NoLaunch())
    q = torch.randn(2, 512, 8, 128, dtype=torch.float16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    calls = {"forward (causal)": lambda: flashtriton.flash_attn_func(q, k, v, causal=True),
             "decode (kv cache)": lambda: flashtriton.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=400)}
    for label, call in calls.items():
        for _ in range(50):
            call()
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        print(f"{label}: {(time.perf_counter() - start) / args.calls * 1e6:.1f} us per call (kernels not launched)")
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.calls // 4):
                call()
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()

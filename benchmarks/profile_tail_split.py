"""Where the cut last wave's time goes (configs.HopperFwdConfig.split_tail): per-kernel GPU time of the Gluon forward
and of its tail merge (attn_tail_merge_kernel), with the cut and without it, on BASELINES.md shapes.

    python benchmarks/profile_tail_split.py [--shapes 0,1,2,3,4] [--min-blocks 8]

Each shape and causality runs the table's config with split_tail on (tail_min_blocks as given) and off, 20 calls
under torch.profiler, and prints each kernel's mean time in microseconds (the forward's main kernel, the merge, the
rest) and the total, so the cut's cost shows apart from the merge's.
"""

from __future__ import annotations

import argparse
import dataclasses
import torch

import flashtriton
from flashtriton import configs
from flashtriton.bench import profiled_kernels, select_shapes

CALLS = 20


def kernel_times_us(fn) -> dict:
    """Mean GPU time per call (us) of each kernel fn launches, by kernel name."""
    return {event.key: event.device_time_total / CALLS for event in profiled_kernels(fn, CALLS)
            if event.device_time_total > 0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="0,1,2,3,4")
    parser.add_argument("--min-blocks", type=int, default=8)
    args = parser.parse_args()
    for batch, seqlen, heads, dim in select_shapes(args.shapes):
        for causal in (False, True):
            q, k, v = (torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            table = configs.HOPPER_FWD[dim, causal]
            for split in (True, False):
                configs.HOPPER_FWD[dim, causal] = dataclasses.replace(table, split_tail=split,
                                                                      tail_min_blocks=args.min_blocks)
                try:
                    times = kernel_times_us(lambda: flashtriton.flash_attn_func(q, k, v, causal=causal))
                finally:
                    configs.HOPPER_FWD[dim, causal] = table
                parts = ", ".join(f"{name[:40]} {us:.1f}" for name, us in sorted(times.items(), key=lambda x: -x[1]))
                print(f"{batch}x{seqlen}x{heads}x{dim} causal={causal} split={split}: "
                      f"total {sum(times.values()):.1f} us ({parts})")


if __name__ == "__main__":
    main()

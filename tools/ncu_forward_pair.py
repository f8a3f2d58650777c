"""Run flashtriton's forward and its peers' (SDPA-cuDNN's by default; FA4's with --peers sdpa-cudnn,fa4 where
flash_attn.cute imports: tools/fa4_wheels.sh) on the baseline shapes (flashtriton.bench's shape list), each a few
times, for Nsight Compute to profile side by side (tools/ncu_sass_summary.py reads the result). --backward runs
forward + backward steps instead (torch.autograd.grad of each call's output), for the backward kernels.

    python tools/ncu_forward_pair.py [--shapes all|0,1,...] [--causal] [--calls 2] [--peers sdpa-cudnn,fa4]
                                     [--backward]

Run it once without ncu first so that Triton's cache holds the kernels (ncu then profiles kernels, not the compiler),
then, on the GPU machine, for example the speed-of-light and memory sections of both kernels:

    ncu --clock-control none -k regex:"attn_fwd_hopper_kernel|cudnn_generated" --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section LaunchStats -o $OUT/sol python tools/ncu_forward_pair.py
    ncu -i $OUT/sol.ncu-rep --page raw --csv --metrics gpu__time_duration.sum,lts__t_sector_hit_rate.pct,\\
        lts__throughput.avg.pct_of_peak_sustained_elapsed > $OUT/raw.csv

The backward's kernels, e.g. their warp stalls per SASS instruction (flashtriton's main kernel is
attn_bwd_hopper_kernel):

    ncu --clock-control none -k regex:"attn_bwd_hopper_kernel|cudnn_generated" --section SourceCounters \\
        --section WarpStateStats -o $OUT/bwd python tools/ncu_forward_pair.py --shapes 1 --backward

(FA4's kernels: widen -k; their names come from the CuTe DSL, and -k regex:. profiles every kernel.) bf16
(B, S, H, D) inputs drawn from N(0, 1); each shape's calls alternate flashtriton and the peers
(bench.attention_callable, in their bench layouts). Needs a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("flashtriton") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flashtriton.bench import attention_callable, provider_inputs, select_shapes  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="all", help="indices into bench.BASELINE_SHAPES, or all")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--calls", type=int, default=2, help="calls of each provider per shape")
    parser.add_argument("--peers", default="sdpa-cudnn", help="comma list of bench providers run beside flashtriton")
    parser.add_argument("--backward", action="store_true", help="forward + backward steps (the backward kernels)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    providers = ["flashtriton"] + [name for name in args.peers.split(",") if name]
    calls = {name: attention_callable(name, args.causal) for name in providers}
    for shape in select_shapes(args.shapes):
        q, k, v = (torch.randn(shape.batch, shape.seqlen, shape.heads, shape.head_dim, device="cuda",
                               dtype=torch.bfloat16) for _ in range(3))
        inputs = {name: provider_inputs(name, q, k, v, requires_grad=args.backward) for name in providers}
        with torch.set_grad_enabled(args.backward):
            for _ in range(args.calls):
                for name in providers:
                    out = calls[name](*inputs[name])
                    if args.backward:
                        torch.autograd.grad(out, inputs[name], torch.randn_like(out))
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())

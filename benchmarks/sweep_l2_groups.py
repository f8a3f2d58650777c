"""Sweep configs.L2_GROUP_BYTES (launch order in groups of heads) on the GPU: TF/s per budget.

    python benchmarks/sweep_l2_groups.py [--budgets-mib 0,4,8,16,32,1048576] [--graph] [--out DIR]

Times flashtriton's forward and backward on the bench's baseline shapes (causal on and off, bf16) and on
bench_varlen's causal length mix (16k tokens, lengths 128..4096), each budget in turn for every
configuration so that drift between budgets stays small. Budget 0 is one head per group (each head's
tiles in turn); a huge budget puts every (batch, head) pair in one group. --graph times the forward
replayed from a CUDA graph (captured per budget), so short calls are not host-bound. Writes DIR/l2_groups.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import flashtriton
from flashtriton import bench, configs
from flashtriton.testing import cu_seqlens


def varlen_case(tokens: int = 16384, heads: int = 16, head_dim: int = 128):
    """bench_varlen.py's length mix (seed 0): (lengths, cu_seqlens, q, k, v)."""
    lengths = bench.mixed_lengths(tokens)
    cu = cu_seqlens(lengths, "cuda")
    q, k, v = (torch.randn(tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    return lengths, cu, q, k, v


def varlen_callables(causal: bool):
    lengths, cu, q, k, v = varlen_case()
    longest = max(lengths)

    def forward():
        return flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)

    def forward_no_grad():
        with torch.no_grad():
            return forward()

    out = forward()
    dout = torch.randn_like(out)
    def flops(mode):
        return sum(bench.attention_flops(1, q.shape[1], n, n, q.shape[2], causal, mode) for n in lengths)

    return {"fwd": forward_no_grad,
            "bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)}, flops


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets-mib", default="0,4,8,16,32,1048576")
    parser.add_argument("--modes", default="fwd,bwd")
    parser.add_argument("--graph", action="store_true", help="time the forward from CUDA graphs")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    budgets = [int(b) << 20 for b in args.budgets_mib.split(",")]
    original = configs.L2_GROUP_BYTES
    rows = []
    cases = []
    for shape in bench.BASELINE_SHAPES:
        for causal in (False, True):
            q, k, v = bench.random_inputs(shape, torch.bfloat16)
            def flops(mode, shape=shape, causal=causal):
                return bench.attention_flops(shape.batch, shape.heads, shape.seqlen, shape.seqlen, shape.head_dim,
                                             causal, mode)
            fns = {mode: bench.timed_callable("flashtriton", mode, causal, q, k, v) for mode in ("fwd", "bwd")}
            cases.append((shape.label(), causal, fns, flops))
    for causal in (False, True):
        fns, flops = varlen_callables(causal)
        cases.append(("varlen 16k mix x16x128", causal, fns, flops))
    print("| shape | causal | mode | " + " | ".join(f"{b >> 20} MiB" for b in budgets) + " |")
    print("|---|---|---|" + "---:|" * len(budgets))
    for name, causal, fns, flops in cases:
        for mode, fn in fns.items():
            if mode not in args.modes.split(","):
                continue
            rates = []
            for budget in budgets:
                configs.L2_GROUP_BYTES = {False: budget, True: budget}
                ms = bench.median_ms(bench.graphed(fn) if args.graph and mode == "fwd" else fn)
                rate = bench.tflops_per_second(flops(mode), ms)
                rates.append(rate)
                rows.append(dict(shape=name, causal=causal, mode=mode, budget_bytes=budget, ms=ms, tflops=rate,
                                 graph=args.graph and mode == "fwd"))
            print(f"| {name} | {'yes' if causal else 'no'} | {mode} | " + " | ".join(f"{r:.0f}" for r in rates) + " |",
                  flush=True)
    configs.L2_GROUP_BYTES = original
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "l2_groups.json"), "w") as handle:
        json.dump(dict(bench.run_metadata(), rows=rows), handle, indent=1)


if __name__ == "__main__":
    main()

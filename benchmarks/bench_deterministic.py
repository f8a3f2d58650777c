"""The backward's cost of deterministic=True (GPU): flashtriton's backward with and without it, same process.

    python benchmarks/bench_deterministic.py [--shapes 0,1,2] [--timing kernels] [--dtype bf16] [--out DIR]

Times the backward only (torch.autograd.grad on a graph built once) on the baseline shapes (bench.BASELINE_SHAPES),
causal and not, and checks that deterministic=True gives bitwise-equal gradients on two calls. Writes
DIR/deterministic.json (metadata + rows) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import flashtriton
from flashtriton.bench import DTYPES, TIMINGS, attention_flops, markdown_table, run_metadata, select_shapes, time_ms


def backward_call(q, k, v, causal: bool, deterministic: bool):
    """A function that runs the backward of one forward call (graph built once), returning the gradients."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = flashtriton.flash_attn_func(*leaves, causal=causal, deterministic=deterministic)
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="all", help="'all' or indices into bench.BASELINE_SHAPES, e.g. 0,1,2")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--timing", choices=sorted(TIMINGS), default="wall",
                        help="; ".join(f"{name}: {text}" for name, text in TIMINGS.items()))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_deterministic: no CUDA GPU; nothing measured", file=sys.stderr)
        return 2
    rows = []
    for shape in select_shapes(args.shapes):
        batch, seqlen, heads, head_dim = shape
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=DTYPES[args.dtype])
                   for _ in range(3))
        for causal in (False, True):
            flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal, "bwd")
            row = dict(shape=shape.label(), causal=causal, dtype=args.dtype)
            for deterministic in (False, True):
                call = backward_call(q, k, v, causal, deterministic)
                ms = time_ms(call, args.timing)
                row["deterministic_ms" if deterministic else "default_ms"] = ms
                row["deterministic_tflops" if deterministic else "default_tflops"] = flops / ms * 1e-9
                if deterministic:
                    row["repeats_bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(call(), call()))
            row["cost"] = row["deterministic_ms"] / row["default_ms"] - 1.0
            rows.append(row)
            print(f"{row['shape']} causal={causal}: default {row['default_tflops']:.1f} TF/s, deterministic "
                  f"{row['deterministic_tflops']:.1f} TF/s ({row['cost']:+.1%})", file=sys.stderr, flush=True)
    metadata = dict(run_metadata(), timing=args.timing)
    table = [[r["shape"], "yes" if r["causal"] else "no", f"{r['default_tflops']:.1f}",
              f"{r['deterministic_tflops']:.1f}", f"{r['cost']:+.1%}", "yes" if r["repeats_bitwise_equal"] else "NO"]
             for r in rows]
    print(", ".join(f"{key}: {value}" for key, value in metadata.items() if value is not None) + "\n")
    print(markdown_table(["B x S x H x D", "causal", "default TF/s", "deterministic TF/s", "cost", "bitwise repeats"],
                         table, [False, False, True, True, True, False]))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "deterministic.json"), "w") as handle:
        json.dump(dict(metadata=metadata, rows=rows), handle, indent=1)
    return 0 if all(r["repeats_bitwise_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

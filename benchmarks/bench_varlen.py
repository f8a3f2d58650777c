"""Varlen vs dense at the same token count (GPU): TF/s on the real per-sequence FLOPs.

    python benchmarks/bench_varlen.py [--tokens 16384] [--heads 16] [--head-dim 128] [--causal]

Sequence lengths are drawn uniformly from [128, 4096] (fixed seed) until the token budget is filled;
the dense row uses (tokens / 4096) sequences of 4096. Correctness of the varlen output is checked
against the dense kernel run per sequence.
"""

from __future__ import annotations

import argparse
import random

import torch
import triton

import flashtriton


def attention_flops(lengths, heads, dim, causal, mode):
    per_seq = sum(4 * heads * n * n * dim * (0.5 if causal else 1.0) for n in lengths)
    return per_seq * (2.5 if mode == "bwd" else 1.0)


def timed(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    rng = random.Random(0)
    lengths = []
    while sum(lengths) < args.tokens:
        lengths.append(min(rng.randint(128, 4096), args.tokens - sum(lengths)))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    shape = (args.tokens, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=args.causal)
    dout = torch.randn_like(out)
    worst = 0.0
    for b, n in enumerate(lengths[:4]):
        s = slice(int(cu[b]), int(cu[b]) + n)
        single = flashtriton.flash_attn_func(q[None, s], k[None, s], v[None, s], causal=args.causal)[0]
        worst = max(worst, float((single - out[s]).abs().max().detach()))
    rows = []
    ms = timed(lambda: flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths),
                                                          causal=args.causal))
    rows.append(("varlen", "fwd", ms, attention_flops(lengths, args.heads, args.head_dim, args.causal, "fwd")))
    ms = timed(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    rows.append(("varlen", "bwd", ms, attention_flops(lengths, args.heads, args.head_dim, args.causal, "bwd")))

    batch = args.tokens // 4096
    qd, kd, vd = (x.detach().view(batch, 4096, args.heads, args.head_dim).requires_grad_() for x in (q, k, v))
    out_dense = flashtriton.flash_attn_func(qd, kd, vd, causal=args.causal)
    dout_dense = dout.view_as(out_dense)
    dense_lengths = [4096] * batch
    ms = timed(lambda: flashtriton.flash_attn_func(qd, kd, vd, causal=args.causal))
    rows.append(("dense", "fwd", ms, attention_flops(dense_lengths, args.heads, args.head_dim, args.causal, "fwd")))
    ms = timed(lambda: torch.autograd.grad(out_dense, (qd, kd, vd), dout_dense, retain_graph=True))
    rows.append(("dense", "bwd", ms, attention_flops(dense_lengths, args.heads, args.head_dim, args.causal, "bwd")))

    # The dense kernel on the same lengths: each length timed as a full batch of ~tokens / n sequences of
    # that length, its time scaled to one sequence. Short causal sequences run at lower TF/s on any kernel;
    # this row is the dense path's rate on the varlen workload, with no varlen overhead.
    for mode in ("fwd", "bwd"):
        ms = 0.0
        for n in lengths:
            copies = max(1, args.tokens // n)
            qn, kn, vn = (torch.randn(copies, n, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16,
                                      requires_grad=True) for _ in range(3))
            if mode == "fwd":
                batch_ms = timed(lambda: flashtriton.flash_attn_func(qn, kn, vn, causal=args.causal))
            else:
                on = flashtriton.flash_attn_func(qn, kn, vn, causal=args.causal)
                don = torch.randn_like(on)
                batch_ms = timed(lambda: torch.autograd.grad(on, (qn, kn, vn), don, retain_graph=True))
            ms += batch_ms / copies
        rows.append(("dense, same lengths", mode, ms,
                     attention_flops(lengths, args.heads, args.head_dim, args.causal, mode)))

    print(f"{len(lengths)} sequences, lengths {min(lengths)}..{max(lengths)}, {args.tokens} tokens, "
          f"H={args.heads} D={args.head_dim} causal={args.causal}; varlen vs per-sequence max err {worst:.2e}")
    print("| layout | mode | ms | TF/s |")
    print("|---|---|---|---|")
    for layout, mode, ms, flop in rows:
        print(f"| {layout} | {mode} | {ms:.3f} | {flop / ms * 1e-9:.0f} |")


if __name__ == "__main__":
    main()

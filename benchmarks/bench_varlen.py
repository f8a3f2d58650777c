"""Varlen vs dense at the same token count (GPU): TF/s on the real per-sequence FLOPs.

    python benchmarks/bench_varlen.py [--tokens 16384] [--heads 16] [--head-dim 128] [--causal]
                                      [--providers flashtriton,sdpa-flash,sdpa-cudnn]

Sequence lengths are drawn uniformly from [128, 4096] (fixed seed) until the token budget is filled;
the dense rows use (tokens / 4096) sequences of 4096, and each length as a full batch ("same lengths"),
for flashtriton and the SDPA peers. Correctness of the varlen output is checked against the dense kernel
run per sequence.
"""

from __future__ import annotations

import argparse

import torch
import triton

import flashtriton
from flashtriton.bench import graphed, host_us_per_call, mixed_lengths, timed_callable
from flashtriton.testing import cu_seqlens


def attention_flops(lengths, heads, dim, causal, mode):
    per_seq = sum(4 * heads * n * n * dim * (0.5 if causal else 1.0) for n in lengths)
    return per_seq * (2.5 if mode == "bwd" else 1.0)


SAME_LENGTH_TOKENS = 131072  # tokens per timed dense batch of the "same lengths" rows


def timed(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def dense_ms(provider: str, mode: str, batch: int, seqlen: int, args) -> float:
    """Median ms of one dense (batch, seqlen) call of a provider."""
    shape = (batch, seqlen, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return timed(timed_callable(provider, mode, args.causal, q, k, v))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--providers", default="flashtriton,sdpa-flash,sdpa-cudnn",
                        help="dense rows for these providers (flashtriton.bench names)")
    args = parser.parse_args()
    lengths = mixed_lengths(args.tokens)
    cu = cu_seqlens(lengths, "cuda")
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

    def forward():  # timed without autograd, as the dense rows' forward (flashtriton.bench.timed_callable)
        with torch.no_grad():
            return flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=args.causal)

    fwd_flops = attention_flops(lengths, args.heads, args.head_dim, args.causal, "fwd")
    rows.append(("varlen", "fwd", timed(forward), fwd_flops))
    # the same call replayed from a CUDA graph: GPU time only, whatever the host costs
    rows.append(("varlen, CUDA graph", "fwd", timed(graphed(forward)), fwd_flops))
    ms = timed(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    rows.append(("varlen", "bwd", ms, attention_flops(lengths, args.heads, args.head_dim, args.causal, "bwd")))

    # Dense rows for flashtriton and the SDPA peers: `dense` is tokens / 4096 sequences of 4096; `dense, same
    # lengths` times each varlen length as a full batch of ~SAME_LENGTH_TOKENS / n sequences and adds the
    # per-sequence times: a provider's own rate on this workload, without any varlen machinery. The batches are
    # larger than the varlen call so that even the shortest length keeps the GPU busier than the host (an eager
    # call costs 0.15-0.35 ms of host time; a 16k-token batch of 293-token sequences is host-bound). Short causal
    # sequences run at a lower rate on every kernel; the peers' rows show how much.
    dense_lengths = [4096] * (args.tokens // 4096)
    for provider in args.providers.split(","):
        for mode in ("fwd", "bwd"):
            rows.append((f"{provider} dense", mode, dense_ms(provider, mode, len(dense_lengths), 4096, args),
                         attention_flops(dense_lengths, args.heads, args.head_dim, args.causal, mode)))
            copies = [max(1, max(args.tokens, SAME_LENGTH_TOKENS) // n) for n in lengths]
            ms = sum(dense_ms(provider, mode, c, n, args) / c for n, c in zip(lengths, copies))
            rows.append((f"{provider} dense, same lengths", mode, ms,
                         attention_flops(lengths, args.heads, args.head_dim, args.causal, mode)))

    host_us = host_us_per_call(forward), host_us_per_call(
        lambda: flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=args.causal))
    print(f"{len(lengths)} sequences, lengths {min(lengths)}..{max(lengths)}, {args.tokens} tokens, "
          f"H={args.heads} D={args.head_dim} causal={args.causal}; varlen vs per-sequence max err {worst:.2e}; "
          f"host time per varlen forward call {host_us[0]:.0f} us (no_grad), {host_us[1]:.0f} us (grad)")
    print("| layout | mode | ms | TF/s |")
    print("|---|---|---|---|")
    for layout, mode, ms, flop in rows:
        print(f"| {layout} | {mode} | {ms:.3f} | {flop / ms * 1e-9:.0f} |")


if __name__ == "__main__":
    main()

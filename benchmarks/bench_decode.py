"""Decode benchmark (GPU): one query token, GQA 32/8 heads, hdim 128, bf16; TB/s of K+V bytes read.

    python benchmarks/bench_decode.py [--paged 0,64,256] [--sweep] [--fp8]

Rows: (batch, seqlen_k) in (64, 4096), (16, 16384), (4, 65536), (1, 131072), contiguous and
paged. The device-copy bandwidth and SDPA (FLASH / CUDNN, GQA through enable_gqa) are measured in the
same run. Every flashtriton row is checked against SDPA's output. --sweep times every candidate decode
tile config of DECODE_CANDIDATES too (the table in flashtriton/configs.py cites the run that chose it). --fp8:
q and the cache in e4m3 with per-(batch, kv head) descales (benchmarks/bench_fp8.py's quantization), TB/s of the
e4m3 bytes, SDPA run on the dequantized values.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtriton
from bench_fp8 import fp8_inputs
from flashtriton import bench, configs
from flashtriton.ops.backend import splits_for

ROWS = [(64, 4096), (16, 16384), (4, 65536), (1, 131072)]
HEADS, HEADS_K, DIM = 32, 8, 128
# (block_m, block_n, warps, stages, tensor descriptors) of the decode tile; block_m 16 holds the 4 packed
# query heads of a KV head. Paged caches never use descriptors.
# Paged loops need two more stages than contiguous ones for the same K/V double buffering (offline sm_90
# compile: 16x128 w4 paged s3/s4 74 KB of shared memory = one K/V buffer, s5 139 KB = two, as contiguous s3),
# hence the s5/s6 candidates (configs.PAGED_DECODE_STAGES holds the chosen one).
DECODE_CANDIDATES = [(16, 128, 4, 3, False), (16, 128, 4, 2, False), (16, 64, 4, 3, False), (16, 64, 4, 4, False),
                     (16, 64, 2, 4, False), (16, 128, 8, 3, False), (16, 256, 8, 2, False), (16, 32, 2, 6, False),
                     (16, 128, 4, 5, False), (16, 64, 4, 5, False), (16, 64, 4, 6, False),
                     (16, 128, 4, 3, True), (16, 128, 4, 4, True), (16, 64, 4, 4, True), (16, 256, 8, 2, True)]


def dequantized(tensor, descale):
    """An e4m3 (B, S, H, D) tensor times its (B, kv heads) descale, in bf16 (each kv head's descale on its group)."""
    group = tensor.shape[2] // descale.shape[1]
    return (tensor.float() * descale.repeat_interleave(group, 1)[:, None, :, None]).to(torch.bfloat16)


def timed(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paged", default="0,64,256", help="page sizes; 0 = contiguous cache")
    parser.add_argument("--sweep", action="store_true", help="also time every DECODE_CANDIDATES config")
    parser.add_argument("--splits", default="0", help="num_splits values to time (0 = the heuristic)")
    parser.add_argument("--graph", action="store_true",
                        help="time the calls replayed from a CUDA graph (no Python launch overhead), as servers run them")
    parser.add_argument("--fp8", action="store_true", help="q and the cache in e4m3 with descales")
    parser.add_argument("--repeat", type=int, default=1,
                        help="time each row this many times; print the median and the range of the TB/s")
    args = parser.parse_args()
    default_config = configs.fwd_config
    base = default_config(configs.arch_class(torch.device("cuda")), DIM, False, 1)
    candidates = [None] + ([replace(base, block_m=m, block_n=n, num_warps=w, num_stages=s, use_tma=tma)
                            for m, n, w, s, tma in DECODE_CANDIDATES] if args.sweep else [])
    split_counts = [int(s) for s in args.splits.split(",")]
    print(f"device copy: {bench.copy_bandwidth():.2f} TB/s (bytes read + written)")
    print("| batch, seqlen_k | layout | flashtriton TB/s | splits | sdpa-flash TB/s | sdpa-cudnn TB/s | max err |")
    print("|---|---|---|---|---|---|---|")
    for batch, seqlen in ROWS:
        q = torch.randn(batch, 1, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, seqlen, HEADS_K, DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lengths = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
        descales = {}
        if args.fp8:  # the call gets e4m3 q, k, v; SDPA the values they stand for
            q, k, v, descales = fp8_inputs(q.float(), k.float(), v.float())
            qt, kt, vt = (dequantized(t, descales[name]).transpose(1, 2)
                          for t, name in ((q, "q_descale"), (k, "k_descale"), (v, "v_descale")))
        else:
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        kv_bytes = 2 * k.numel() * k.element_size()
        peers = {}
        expected = None
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)  # noqa: E731
                    expected = fn().transpose(1, 2)
                    peers[name] = kv_bytes / timed(fn) * 1e-9
            except RuntimeError:
                peers[name] = float("nan")
        for page in (int(p) for p in args.paged.split(",")):
            if page:
                pages = seqlen // page
                table = torch.arange(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
                k_cache = k.reshape(batch * pages, page, HEADS_K, DIM)
                v_cache = v.reshape(batch * pages, page, HEADS_K, DIM)
                calls = {s: lambda s=s: flashtriton.flash_attn_with_kvcache(
                    q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, num_splits=s, **descales)
                    for s in split_counts}
            else:
                calls = {s: lambda s=s: flashtriton.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths,
                                                                          num_splits=s, **descales)
                         for s in split_counts}
            layout = f"paged {page}" if page else "contiguous"
            for candidate, (num_splits, call) in ((c, sc) for c in candidates for sc in calls.items()):
                configs.fwd_config = default_config if candidate is None else (lambda *_, c=candidate: c)
                label = "" if candidate is None else (f" [{candidate.block_m}x{candidate.block_n} "
                                                      f"w{candidate.num_warps} s{candidate.num_stages}"
                                                      f"{' tma' if candidate.use_tma else ''}]")
                try:
                    if args.graph:
                        call = bench.graphed(call)
                    err = float((call().float() - expected.float()).abs().max()) if expected is not None else float("nan")
                    times = sorted(timed(call) for _ in range(args.repeat))
                    ms = times[len(times) // 2]
                except Exception as exc:  # a candidate that does not compile is reported, not fatal
                    print(f"| {batch}, {seqlen} | {layout}{label} | failed: {type(exc).__name__} |", flush=True)
                    continue
                splits = splits_for(q, HEADS_K, 1, seqlen, num_splits, page_size=page)
                spread = (f" ({kv_bytes / times[-1] * 1e-9:.2f}-{kv_bytes / times[0] * 1e-9:.2f})"
                          if len(times) > 1 else "")
                print(f"| {batch}, {seqlen} | {layout}{label} | {kv_bytes / ms * 1e-9:.2f}{spread} | {splits} | "
                      f"{peers['flash']:.2f} | {peers['cudnn']:.2f} | {err:.1e} |", flush=True)
            configs.fwd_config = default_config


if __name__ == "__main__":
    main()

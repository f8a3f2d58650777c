"""Host time per eager call (GPU): flashtriton against SDPA's FLASH and cuDNN backends and FA4 (where importable).

    python benchmarks/bench_host.py [--calls 300] [--repeat 3] [--providers flashtriton,sdpa-flash,sdpa-cudnn,fa4]
                                    [--no-decode-bandwidth] [--out DIR]

Calls at shapes whose GPU work takes a few microseconds (B=1, S=128, 16 heads, d128, bf16, causal), so that the
wall time of `calls` calls enqueued back to back is the host's cost (flashtriton.bench.host_us_per_call; best of
--repeat loops, the machine's noise being one-sided):
  forward (no grad); forward + backward (a training step through autograd); backward alone (one graph, kept);
  a decode step: flash_attn_with_kvcache with one new token into a 1k-token cache, GQA 32/8 (SDPA: attention of the
  token over the cache, enable_gqa); a model's decode: flash_attn_func with one token over a cache that grows by one
  token every 16 calls (a generate() step's layers: every step is a new call signature).
Then eager decode bandwidth: flash_attn_with_kvcache's TB/s of K and V bytes at batch 4 x 64k and 64 x 4k keys
(cache_seqlens full), against the device-copy bandwidth measured in the same run. FLASHTRITON_LAUNCH_PLANS=0 gives
the same run with every launch through Triton's binder (before / after the launch plans, ops/launching.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import flashtriton
from flashtriton import bench

SHAPE = (1, 128, 16, 128)  # batch, seqlen, heads, head dim
DECODE_HEADS, DECODE_HEADS_K, DECODE_CACHE = 32, 8, 1024
BANDWIDTH_ROWS = [(4, 65536), (64, 4096)]
PROVIDERS = ("flashtriton", "sdpa-flash", "sdpa-cudnn", "fa4")
CALLS = ("forward (no grad)", "forward + backward", "backward", "decode step, 1 token, 1k cache, GQA 32/8",
         "model decode: flash_attn_func, 1 token, cache one longer every 16 calls")
LAYERS = 16  # calls per cache length in the model-decode row: a model's layers in one generate() step


def _inputs(requires_grad: bool):
    generator = torch.Generator(device="cuda").manual_seed(0)
    return tuple(torch.randn(SHAPE, generator=generator, device="cuda", dtype=torch.bfloat16)
                 .requires_grad_(requires_grad) for _ in range(3))


def attention_calls(provider: str) -> dict:
    """{call name: fn} for a provider; a call the provider does not have is left out."""
    attention = bench.attention_callable(provider, causal=True)
    calls = {}
    q, k, v = bench.provider_inputs(provider, *_inputs(False), requires_grad=False)
    calls[CALLS[0]] = lambda: attention(q, k, v)
    qg, kg, vg = bench.provider_inputs(provider, *_inputs(False), requires_grad=True)
    dout = torch.randn_like(attention(qg, kg, vg))
    calls[CALLS[1]] = lambda: torch.autograd.grad(attention(qg, kg, vg), (qg, kg, vg), dout)
    graph = attention(qg, kg, vg)
    calls[CALLS[2]] = lambda: torch.autograd.grad(graph, (qg, kg, vg), dout, retain_graph=True)
    decode = decode_call(provider)
    if decode is not None:
        calls[CALLS[3]] = decode
    growing = growing_decode_call(provider)
    if growing is not None:
        calls[CALLS[4]] = growing
    return calls


def decode_call(provider: str, batch: int = 1, cache: int = DECODE_CACHE):
    """One new token attending a full cache of `cache` keys (GQA 32/8, d128): flash_attn_with_kvcache for
    flashtriton, SDPA over the cache for its backends; None for FA4 (its kvcache API is not the same call)."""
    q = torch.randn(batch, 1, DECODE_HEADS, 128, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(batch, cache, DECODE_HEADS_K, 128, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    if provider == "flashtriton":
        seqlens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
        return lambda: flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
    if provider.startswith("sdpa"):
        from torch.nn.attention import sdpa_kernel

        backend = bench._sdpa_backend(provider)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k_cache, v_cache))

        def sdpa_decode():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        return sdpa_decode
    return None


def growing_decode_call(provider: str, layers: int = LAYERS):
    """What a transformers generate() step asks of each layer: one new token over a cache that grows by one token
    every `layers` calls (a new shape, so a new call signature, each step; GQA 32/8, d128, from 1k keys):
    flash_attn_func (causal) for flashtriton, SDPA over the cache for its backends; None for FA4."""
    q = torch.randn(1, 1, DECODE_HEADS, 128, device="cuda", dtype=torch.bfloat16)
    # [1, 2k, 8, 128]: a step's keys are the first `length` rows
    k_cache, v_cache = (torch.randn(1, 2 * DECODE_CACHE, DECODE_HEADS_K, 128, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    calls = itertools.count()

    def length() -> int:
        return DECODE_CACHE + (next(calls) // layers) % DECODE_CACHE

    if provider == "flashtriton":
        def flashtriton_decode():
            keys = length()
            return flashtriton.flash_attn_func(q, k_cache[:, :keys], v_cache[:, :keys], causal=True)
        return flashtriton_decode
    if provider.startswith("sdpa"):
        from torch.nn.attention import sdpa_kernel

        backend = bench._sdpa_backend(provider)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k_cache, v_cache))

        def sdpa_decode():
            keys = length()
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, kt[:, :, :keys], vt[:, :, :keys], enable_gqa=True)
        return sdpa_decode
    return None


def host_table(providers, calls: int, repeat: int) -> dict:
    """{call name: {provider: µs or error text}}."""
    table = {name: {} for name in CALLS}
    for provider in providers:
        try:
            provider_calls = attention_calls(provider)
            for fn in provider_calls.values():
                fn()
        except Exception as error:  # noqa: BLE001 - a peer missing here (FA4 not installed, a backend refusing)
            for name in table:
                table[name][provider] = bench._unavailable(error)
            continue
        for name, fn in provider_calls.items():
            table[name][provider] = min(bench.host_us_per_call(fn, calls) for _ in range(repeat))
    return table


def decode_bandwidth() -> list:
    """[(batch, keys, TB/s eager, TB/s copy)] of flash_attn_with_kvcache over full caches."""
    copy = bench.copy_bandwidth()
    rows = []
    for batch, keys in BANDWIDTH_ROWS:
        call = decode_call("flashtriton", batch, keys)
        kv_bytes = 2 * batch * keys * DECODE_HEADS_K * 128 * 2
        # an eager decode loop's time per call (no CUDA graph, no L2 flush: each row's K and V are 1 GB, far past L2)
        ms = bench.host_us_per_call(call, 200, drained=True) * 1e-3
        rows.append((batch, keys, kv_bytes / ms * 1e-9, copy))
        del call
        torch.cuda.empty_cache()
    return rows


def markdown(table: dict, providers, bandwidth: list) -> str:
    lines = ["| call | " + " | ".join(providers) + " | flashtriton / sdpa-flash |",
             "|---|" + "---|" * (len(providers) + 1)]
    for name, row in table.items():
        cells = [f"{row[p]:.1f} µs" if isinstance(row.get(p), float) else str(row.get(p, "—")) for p in providers]
        ratio = (f"{row['flashtriton'] / row['sdpa-flash']:.2f}" if isinstance(row.get("flashtriton"), float)
                 and isinstance(row.get("sdpa-flash"), float) else "—")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio} |")
    if bandwidth:
        lines += ["", "| eager decode, batch × keys | TB/s | copy TB/s | of copy |", "|---|---|---|---|"]
        lines += [f"| {b} × {n} | {tb:.2f} | {copy:.2f} | {tb / copy:.0%} |" for b, n, tb, copy in bandwidth]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--no-decode-bandwidth", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="also write host.json and host.md here")
    args = parser.parse_args()
    providers = [p for p in args.providers.split(",") if p]
    table = host_table(providers, args.calls, args.repeat)
    bandwidth = [] if args.no_decode_bandwidth else decode_bandwidth()
    text = markdown(table, providers, bandwidth)
    metadata = bench.run_metadata()
    print(json.dumps(metadata))
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host.md").write_text(text + "\n")
        (args.out / "host.json").write_text(json.dumps({"metadata": metadata, "host_us": table,
                                                        "decode_bandwidth": bandwidth}, indent=1))


if __name__ == "__main__":
    main()

"""Sweep tile configurations on the GPU and print the best per (head dim, causal, mode).

    python benchmarks/sweep_configs.py --modes fwd,bwd --out DIR

Each candidate is checked against SDPA (max abs error printed) before it is timed; SDPA FLASH and
CUDNN are timed in the same run so the numbers can be read as ratios. Results go to DIR/sweep.json.
The tables in flashtriton/configs.py cite the run that chose them.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtriton
from flashtriton import configs
from flashtriton.bench import select_shapes
from flashtriton.configs import FwdConfig, TileConfig

_TILES = {
    "small": [(128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 4), (128, 64, 4, 4)],
    # head dim 256: offline sm_90 compiles (tools/offline_compile.py) show 128x32 w8 s3 without spills
    "large": [(128, 64, 8, 2), (128, 32, 8, 3), (128, 32, 8, 2), (64, 64, 8, 3), (64, 64, 4, 2)],
}
FWD_CANDIDATES = {size: [FwdConfig(*tile, 0.0, tma) for tma in (True, False) for tile in tiles]
                  for size, tiles in _TILES.items()}
DKDV_CANDIDATES = {
    # offline sm_90 compiles with descriptors: 32x64 w8 s3 is the one candidate without spills
    "small": [TileConfig(32, 128, 4, 3), TileConfig(64, 128, 8, 2), TileConfig(64, 64, 4, 3), TileConfig(32, 64, 4, 3),
              TileConfig(64, 128, 8, 3), TileConfig(32, 64, 8, 3), TileConfig(64, 64, 8, 3), TileConfig(32, 128, 8, 2)],
    # head dim 256: 16x64 w8 compiles without spills and keeps wgmma; 32x64 w8 (the current entry) spills 208 B
    "large": [TileConfig(32, 64, 8, 2), TileConfig(16, 64, 8, 2), TileConfig(16, 64, 8, 3), TileConfig(32, 32, 8, 2)],
}
DQ_CANDIDATES = {
    "small": [TileConfig(128, 32, 4, 3), TileConfig(128, 64, 8, 2), TileConfig(64, 64, 4, 3), TileConfig(64, 128, 8, 2),
              TileConfig(128, 64, 8, 3), TileConfig(128, 128, 8, 2)],
    "large": [TileConfig(64, 32, 4, 2), TileConfig(64, 32, 8, 2), TileConfig(128, 32, 8, 2), TileConfig(64, 64, 8, 2)],
}


# Backward candidates are swept with these tensor-descriptor settings (the current table entry runs with both).
BWD_TMA = (True,)


def flops(batch, seqlen, heads, dim, causal, mode):
    fwd = 4 * batch * heads * seqlen * seqlen * dim * (0.5 if causal else 1.0)
    return fwd * (2.5 if mode == "bwd" else 1.0)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def sdpa_times(q, k, v, dout, causal):
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    times, outputs = {}, {}
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            times[name, "fwd"] = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
            do_t = dout.transpose(1, 2)
            times[name, "bwd"] = bench(lambda: torch.autograd.grad(out, (qt, kt, vt), do_t, retain_graph=True))
            outputs[name] = out.transpose(1, 2)
    return times, outputs["sdpa_flash"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="fwd,bwd")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shapes", default="all", help="'all' or indices into bench.BASELINE_SHAPES, e.g. 1,3")
    parser.add_argument("--bwd-candidates", default="all", choices=("all", "base", "dq"),
                        help="base: only the current backward entry, with and without tensor descriptors; "
                             "dq: the current entry, then DQ_CANDIDATES (the dQ kernel alone changes: at head "
                             "dim 256 what runs after the Gluon dK / dV kernel)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    shapes = select_shapes(args.shapes)
    arch = configs.arch_class(torch.device("cuda"))
    rows = []
    original_fwd, original_bwd = configs.fwd_config, configs.bwd_config
    for batch, seqlen, heads, dim in shapes:
        size = "large" if dim > 128 else "small"
        for causal in (False, True):
            q, k, v = (torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            dout = torch.randn_like(q)
            times, expected = sdpa_times(q, k, v, dout, causal)
            tag = dict(batch=batch, seqlen=seqlen, heads=heads, dim=dim, causal=causal)
            for (name, mode), ms in times.items():
                rows.append(dict(tag, provider=name, mode=mode, ms=ms, tflops=flops(batch, seqlen, heads, dim, causal, mode) / ms * 1e-9))
            if "fwd" in modes:
                for cand in FWD_CANDIDATES[size]:
                    configs.fwd_config = lambda *_, cand=cand: cand
                    try:
                        with torch.no_grad():  # as flashtriton.bench times the forward: no autograd host work
                            out = flashtriton.flash_attn_func(q, k, v, causal=causal)
                            err = float((out.float() - expected.float()).abs().max())
                            ms = bench(lambda: flashtriton.flash_attn_func(q, k, v, causal=causal))
                    except Exception as exc:  # a candidate that does not compile is recorded, not fatal
                        err, ms = float("nan"), float("nan")
                        print("fwd candidate failed", cand, type(exc).__name__, str(exc)[:200])
                    rows.append(dict(tag, provider="flashtriton", mode="fwd", config=asdict(cand), ms=ms, max_err=err,
                                     tflops=flops(batch, seqlen, heads, dim, causal, "fwd") / ms * 1e-9))
                    print(f"  fwd {rows[-1]['tflops']:.0f} TF/s {asdict(cand)}", flush=True)
                configs.fwd_config = original_fwd
            if "bwd" in modes:
                out = flashtriton.flash_attn_func(q, k, v, causal=causal)
                base = original_bwd(arch, dim)
                candidates = [replace(base, use_tma=tma) for tma in (False, True)]
                if args.bwd_candidates == "dq":
                    candidates = [base] + [replace(base, dq=c) for c in DQ_CANDIDATES[size] if c != base.dq]
                for tma in BWD_TMA if args.bwd_candidates == "all" else ():
                    candidates += [replace(base, dkdv=c, use_tma=tma) for c in DKDV_CANDIDATES[size]]
                    candidates += [replace(base, dq=c, use_tma=tma) for c in DQ_CANDIDATES[size]]
                for cand in candidates:
                    configs.bwd_config = lambda *_, cand=cand: cand
                    try:
                        ms = bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
                    except Exception as exc:
                        ms = float("nan")
                        print("bwd candidate failed", cand, type(exc).__name__, str(exc)[:200])
                    rows.append(dict(tag, provider="flashtriton", mode="bwd", config=asdict(cand), ms=ms,
                                     tflops=flops(batch, seqlen, heads, dim, causal, "bwd") / ms * 1e-9))
                    print(f"  bwd {rows[-1]['tflops']:.0f} TF/s {asdict(cand)}", flush=True)
                configs.bwd_config = original_bwd
            summary = [r for r in rows if all(r[key] == tag[key] for key in tag)]
            for mode in modes:
                ours = [r for r in summary if r["provider"] == "flashtriton" and r["mode"] == mode and r["ms"] == r["ms"]]
                best = min(ours, key=lambda r: r["ms"]) if ours else None
                peers = {r["provider"]: r["tflops"] for r in summary if r["provider"] != "flashtriton" and r["mode"] == mode}
                print(f"{tag} {mode}: best {best['tflops'] if best else float('nan'):.0f} TF/s {best['config'] if best else ''} "
                      f"| flash {peers.get('sdpa_flash', 0):.0f} cudnn {peers.get('sdpa_cudnn', 0):.0f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep.json"), "w") as handle:
        json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()

"""Sweep the Gluon Hopper forward's configurations (configs.HopperFwdConfig: key tile, stages, consumer registers,
persistent grid, ping-pong) on the baseline shapes (bench.BASELINE_SHAPES), with SDPA FLASH and CUDNN timed in the
same process.

    python benchmarks/sweep_hopper_fwd.py [--shapes 0,1] [--out DIR]
    python benchmarks/sweep_hopper_fwd.py --head-dims 80,96,192   # B=4, S=4096, 2048 // D heads (the feature rows)
    python benchmarks/sweep_hopper_fwd.py --fp8 [--shapes ...]     # e4m3 q, k, v: configs.HOPPER_FWD_FP8's candidates

Every candidate's output is compared with SDPA FLASH's before it is timed (max abs error printed); a candidate
that fails to compile is recorded with NaN, and each row records whether the Gluon kernel ran (torch.profiler's kernel
names). Results go to DIR/hopper-sweep.json; configs.HOPPER_FWD cites the run that chose its entries. --fp8: q, k, v
quantized to e4m3 per (batch, head) with descales, each table candidate and the same with three stages (half-size
Q / K tiles leave room) set in configs.HOPPER_FWD_FP8, outputs compared with SDPA's on the dequantized inputs.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtriton
from flashtriton import configs
from flashtriton.bench import attention_flops, median_ms, profiled_kernels, select_shapes
from flashtriton.configs import HopperFwdConfig
from flashtriton.testing import quantize_e4m3

_CHUNKED_NARROW = [HopperFwdConfig(128, stages, 240, persistent=True, pingpong=pingpong, hold_schedule=hold,
                                   rescale_threshold=8.0)
                   for stages, pingpong, hold in ((2, True, True), (3, True, True), (2, False, True), (2, True, False))]
_CHUNKED_NARROW.append(HopperFwdConfig(128, 2, 160, persistent=True, rescale_threshold=8.0, consumers=3))
# shared memory: Q and O 2 x 64 rows each (O staged in Q at d256), K and V `stages` x block_n rows (227 KiB per
# program on sm_90)
CANDIDATES = {
    64: [HopperFwdConfig(128, 2, 232, persistent=True), HopperFwdConfig(128, 2, 232, persistent=True, pingpong=True),
         HopperFwdConfig(128, 2, 160, persistent=True, consumers=3)],
    128: [HopperFwdConfig(128, 2, 240, persistent=True), HopperFwdConfig(128, 2, 240, persistent=True, pingpong=True),
          HopperFwdConfig(128, 2, 232, persistent=True, pingpong=True)],
    256: [HopperFwdConfig(64, 2, 232), HopperFwdConfig(64, 2, 232, pingpong=True),
          HopperFwdConfig(64, 2, 232, persistent=True, pingpong=True)],
    # tiles of two chunks (configs.HOPPER_FWD_CHUNKS)
    80: [*_CHUNKED_NARROW],
    96: [*_CHUNKED_NARROW],
    192: [HopperFwdConfig(64, stages, 232, persistent=True, pingpong=pingpong, hold_schedule=True,
                          rescale_threshold=8.0) for stages in (2, 3) for pingpong in (False, True)]
         + [HopperFwdConfig(64, 2, 232, hold_schedule=True, rescale_threshold=8.0),
            HopperFwdConfig(64, 2, 240, persistent=True, pingpong=True, rescale_threshold=8.0)],
}

GLUON_FORWARD_KERNEL = "attn_fwd_hopper_kernel"


def quantized(x: torch.Tensor):
    """(e4m3 x, (B, H) fp32 descale, the dequantized bf16 x): x (B, S, H, D) quantized per (batch, head)."""
    x8, descale = quantize_e4m3(x)
    return x8, descale, (x8.float() * descale[:, None, :, None]).to(torch.bfloat16)


def runs_gluon_forward(fn) -> bool:
    """Whether a call of fn launches the Gluon Hopper forward kernel."""
    return any(GLUON_FORWARD_KERNEL in event.key for event in profiled_kernels(fn, calls=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="all", help="'all' or indices into bench.BASELINE_SHAPES, e.g. 1,3")
    parser.add_argument("--head-dims", help="instead of --shapes: comma-separated head dims, each at B=4, S=4096 and "
                                              "2048 // D heads")
    parser.add_argument("--fp8", action="store_true", help="e4m3 q, k, v with descales (configs.HOPPER_FWD_FP8)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    table = configs.HOPPER_FWD_FP8 if args.fp8 else configs.HOPPER_FWD
    shapes = select_shapes(args.shapes)
    if args.head_dims:
        shapes = [(4, 4096, 2048 // dim, dim) for dim in (int(value) for value in args.head_dims.split(","))]
    original = dict(configs.HOPPER_FWD)
    rows = []
    for batch, seqlen, heads, dim in shapes:
        for causal in (False, True):
            q, k, v = (torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            fp8_kwargs = {}
            if args.fp8:
                (q8, qd, q), (k8, kd, k), (v8, vd, v) = (quantized(x) for x in (q, k, v))
                fp8_kwargs = dict(q_descale=qd, k_descale=kd, v_descale=vd)
            inputs = (q8, k8, v8) if args.fp8 else (q, k, v)
            flops = attention_flops(batch, heads, seqlen, seqlen, dim, causal, "fwd")
            tag = dict(batch=batch, seqlen=seqlen, heads=heads, dim=dim, causal=causal)
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            peers = {}
            with torch.no_grad():
                for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                                      ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
                    with sdpa_kernel(backend):
                        expected = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
                        ms = median_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
                    peers[name] = flops / ms * 1e-9
                    rows.append(dict(tag, provider=name, ms=ms, tflops=peers[name]))
                candidates = CANDIDATES[dim]
                if args.fp8:
                    candidates = [*candidates, *(replace(candidate, stages=3) for candidate in candidates
                                                 if candidate.stages == 2)]
                for candidate in candidates:
                    # the table's choice of causal mask code (configs.HopperFwdConfig.mask_by_residues) stays
                    candidate = replace(candidate, mask_by_residues=original[dim, causal].mask_by_residues)
                    table[dim, causal] = candidate

                    def forward():
                        return flashtriton.flash_attn_func(*inputs, causal=causal, **fp8_kwargs)

                    try:
                        error = float((forward().float() - expected.float()).abs().max())
                        ms = median_ms(forward)
                        ran_gluon = runs_gluon_forward(forward)
                    except Exception as exc:  # a candidate that does not compile is recorded, not fatal
                        error, ms, ran_gluon = float("nan"), float("nan"), False
                        print("candidate failed", candidate, type(exc).__name__, str(exc)[:300], flush=True)
                    rows.append(dict(tag, provider="flashtriton", config=asdict(candidate), ms=ms, max_err=error,
                                     ran_gluon=ran_gluon, tflops=flops / ms * 1e-9))
                    print(f"{tag} {asdict(candidate)}: {rows[-1]['tflops']:.1f} TF/s err {error:.1e} "
                          f"gluon {ran_gluon} | flash {peers['sdpa-flash']:.1f} cudnn {peers['sdpa-cudnn']:.1f}"
                          f" | x cudnn {rows[-1]['tflops'] / peers['sdpa-cudnn']:.3f}", flush=True)
                if args.fp8:
                    del table[dim, causal]
                else:
                    table[dim, causal] = original[dim, causal]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hopper-sweep.json"), "w") as handle:
        json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()

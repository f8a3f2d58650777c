"""Sweep the Gluon Hopper backward's configurations (configs.HopperBwdConfig: Q / dO stages, consumer registers,
key-major scores) on the feature rows' shapes (B=4, S=4096, 2048 // D heads), causal and not, with SDPA FLASH and
CUDNN's backward timed in the same process.

    python benchmarks/sweep_hopper_bwd.py [--head-dims 64,80,96,128] [--deterministic] [--out DIR]

Each candidate's gradients are compared with the table config's (max abs difference printed: key-major and
row-major tiles add in other orders, so a few units in the last place; a broken candidate shows as a large one); a
candidate that fails to compile (too much shared memory) is recorded with NaN, and each row records whether the
Gluon backward ran (torch.profiler's kernel names). The backward is timed alone: torch.autograd.grad of a finished
forward. --deterministic times deterministic=True calls too (dQ in a fixed order: head dim 128). Results go to
DIR/hopper-bwd-sweep.json; configs.HOPPER_BWD cites the run that chose its entries.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtriton
from flashtriton import configs
from flashtriton.bench import attention_flops, median_ms, profiled_kernels
from flashtriton.configs import HopperBwdConfig

# per row: Q / dO stages x consumer registers x key-major scores or not (for the row's causal value); shared
# memory: K and V of the 128-key block, `stages` x (Q, dO) of 64 rows, dS (and P without key-major) tiles, the fp32
# dQ tiles (227 KiB per program: three stages do not fit at head dim 128)
STAGES = (2, 3)
CONSUMER_REGS = (240, 248)


def candidates(causal: bool) -> list:
    """The configs swept on a row (the key-major ones name the row's causal value)."""
    return [HopperBwdConfig(64, stages, regs, (causal, ) if key_major else ())
            for stages in STAGES for regs in CONSUMER_REGS for key_major in (False, True)]

GLUON_BACKWARD_KERNEL = "attn_bwd_hopper_kernel"


def runs_gluon_backward(fn) -> bool:
    """Whether a call of fn launches the Gluon Hopper backward kernel."""
    return any(GLUON_BACKWARD_KERNEL in event.key for event in profiled_kernels(fn, calls=1))


def _sdpa_backward_ms(q, k, v, dout, causal: bool, backend) -> float:
    """SDPA's backward alone, (B, S, H, D) inputs."""
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        grad = dout.transpose(1, 2)
        return median_ms(lambda: torch.autograd.grad(out, (qt, kt, vt), grad, retain_graph=True))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="64,80,96,128", help="comma-separated head dims (configs.HOPPER_BWD)")
    parser.add_argument("--deterministic", action="store_true", help="time deterministic=True calls too")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    dims = [int(value) for value in args.head_dims.split(",")]
    original = dict(configs.HOPPER_BWD)
    rows = []
    for dim in dims:
        batch, seqlen, heads = 4, 4096, 2048 // dim
        q, k, v, dout = (torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=torch.bfloat16)
                         for _ in range(4))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        for causal in (False, True):
            flops = attention_flops(batch, heads, seqlen, seqlen, dim, causal, "bwd")
            peers = {name: flops / _sdpa_backward_ms(q, k, v, dout, causal, backend) * 1e-9
                     for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                                           ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION))}
            for deterministic in ((False, True) if args.deterministic else (False, )):
                tag = dict(batch=batch, seqlen=seqlen, heads=heads, dim=dim, causal=causal,
                           deterministic=deterministic)
                out = flashtriton.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)

                def backward():
                    return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

                configs.HOPPER_BWD[dim] = original[dim]
                reference = backward()
                for candidate in candidates(causal):
                    configs.HOPPER_BWD[dim] = candidate
                    try:
                        error = max(float((got.float() - want.float()).abs().max())
                                    for got, want in zip(backward(), reference))
                        ms = median_ms(backward)
                        ran_gluon = runs_gluon_backward(backward)
                    except Exception as exc:  # a candidate that does not compile is recorded, not fatal
                        error, ms, ran_gluon = math.nan, math.nan, False
                        print("candidate failed", candidate, type(exc).__name__, str(exc)[:300], flush=True)
                    rows.append(dict(tag, provider="flashtriton", config=asdict(candidate), ms=ms, max_diff=error,
                                     ran_gluon=ran_gluon, tflops=flops / ms * 1e-9,
                                     **{f"{name}_tflops": value for name, value in peers.items()}))
                    print(f"{tag} {asdict(candidate)}: {ms:.3f} ms {rows[-1]['tflops']:.1f} TF/s diff {error:.1e} "
                          f"gluon {ran_gluon} | flash {peers['sdpa-flash']:.1f} cudnn {peers['sdpa-cudnn']:.1f}",
                          flush=True)
                configs.HOPPER_BWD[dim] = original[dim]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hopper-bwd-sweep.json"), "w") as handle:
        json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()

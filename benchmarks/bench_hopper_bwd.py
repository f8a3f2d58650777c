"""The Gluon Hopper backward (kernels/bwd_hopper.py, bwd_hopper_d256.py) against the Triton backward and SDPA FLASH /
CUDNN, same process.

    python benchmarks/bench_hopper_bwd.py [--shapes 1,3] [--timing kernels] [--out DIR]

Times the backward only (torch.autograd.grad on a graph built once), bf16, causal and not; at head dim 256 (dK / dV
by the Gluon kernel, dQ by the Triton kernel or the Gluon dQ kernel) and 128 (dQ reductions in a fixed order)
deterministic=True too. Every result is compared with the Triton backward's gradients (max abs difference printed).
Results go to DIR/hopper-bwd.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtriton
from flashtriton import configs
from flashtriton.bench import TIMINGS, attention_flops, select_shapes, time_ms
from flashtriton.ops import hopper_bwd
from flashtriton.testing import forced_gluon_backward, forced_gluon_dq


def _variants(head_dim: int):
    """(name, Gluon backward allowed, deterministic, Gluon dQ kernel allowed)."""
    variants = [("triton", False, False, False), ("gluon", True, False, False)]
    if not hopper_bwd.computes_dq(head_dim):  # dK / dV by Gluon, dQ by Triton or Gluon; deterministic=True too
        variants += [("gluon+gluon-dq", True, False, True), ("triton-deterministic", False, True, False),
                     ("gluon-deterministic", True, True, False), ("gluon+gluon-dq-deterministic", True, True, True)]
    elif hopper_bwd.can_order_dq(head_dim):  # deterministic=True: the same kernel with its dQ reductions ordered
        variants += [("triton-deterministic", False, True, False), ("gluon-deterministic", True, True, False)]
    return variants


def _difference(grads, reference) -> float:
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads, reference))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="all",
                        help="'all' or indices into bench.BASELINE_SHAPES, e.g. 1,3 (head dims the kernel takes)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--timing", choices=sorted(TIMINGS), default="wall",
                        help="wall: median wall clock (do_bench); kernels: the GPU time of the call's kernels "
                             "(torch.profiler), which leaves host time out (16x1024 rows are host-bound eagerly)")
    args = parser.parse_args()
    shapes = [shape for shape in select_shapes(args.shapes) if shape.head_dim in configs.HOPPER_BWD]
    rows = []
    for batch, seqlen, heads, dim in shapes:
        for causal in (False, True):
            q, k, v = (torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            dout = torch.randn_like(q)
            flops = attention_flops(batch, heads, seqlen, seqlen, dim, causal, "bwd")
            tag = dict(batch=batch, seqlen=seqlen, heads=heads, dim=dim, causal=causal)
            times, grads, ran_gluon = {}, {}, {}
            for name, gluon, deterministic, gluon_dq in _variants(dim):
                with forced_gluon_backward(gluon), forced_gluon_dq(gluon_dq):
                    out = flashtriton.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
                    launches = hopper_bwd.launch_count
                    grads[name] = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                    ran_gluon[name] = hopper_bwd.launch_count > launches
                    times[name] = time_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                                          args.timing)
                rows.append(dict(tag, provider=f"flashtriton-{name}", ran_gluon=ran_gluon[name], ms=times[name],
                                 tflops=flops / times[name] * 1e-9))
            qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
            for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
                with sdpa_kernel(backend):
                    out_t = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    times[name] = time_ms(lambda: torch.autograd.grad(out_t, (qt, kt, vt), dout.transpose(1, 2),
                                                                      retain_graph=True), args.timing)
                rows.append(dict(tag, provider=name, ms=times[name], tflops=flops / times[name] * 1e-9))
            tf = {name: flops / ms * 1e-9 for name, ms in times.items()}
            print(f"{tag} bwd TF/s: " + ", ".join(
                f"{name} {tf[name]:.1f}" + (f" (ran gluon {ran_gluon[name]}, x flash {tf[name] / tf['sdpa-flash']:.2f}, "
                                            f"max |diff from triton| {_difference(grads[name], grads['triton']):.2e})"
                                            if name in grads else "") for name in tf), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hopper-bwd.json"), "w") as handle:
        json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()

"""Quick GPU timing probe: flashtriton vs SDPA backends on the BASELINES shapes (used before bench.py existed)."""
import sys
import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F
import flashtriton

SHAPES = [(16, 1024, 16, 128), (4, 4096, 16, 128), (1, 16384, 16, 128), (4, 4096, 32, 64), (4, 4096, 8, 256)]


def tflops(b, s, h, d, causal, ms, mult):
    f = 4 * b * h * s * s * d * (0.5 if causal else 1.0) * mult
    return f / ms * 1e-9


def main():
    dtype = torch.bfloat16
    print(f"{'shape':<22} {'causal':<6} {'mode':<4} {'ft':>7} {'flash':>7} {'cudnn':>7}")
    for (b, s, h, d) in SHAPES:
        for causal in (False, True):
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
            dout = torch.randn_like(q)
            qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
            res = {}
            out = flashtriton.flash_attn_func(q, k, v, causal=causal)
            res["ft", "fwd"] = triton.testing.do_bench(lambda: flashtriton.flash_attn_func(q, k, v, causal=causal), return_mode="median")
            res["ft", "bwd"] = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), return_mode="median")
            for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    with sdpa_kernel(be):
                        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                        res[name, "fwd"] = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), return_mode="median")
                        do_t = dout.transpose(1, 2)
                        res[name, "bwd"] = triton.testing.do_bench(lambda: torch.autograd.grad(o, (qt, kt, vt), do_t, retain_graph=True), return_mode="median")
                except Exception as e:  # noqa
                    print("skip", name, e, file=sys.stderr)
            for mode, mult in (("fwd", 1.0), ("bwd", 2.5)):
                row = [tflops(b, s, h, d, causal, res.get((p, mode), float("nan")), mult) for p in ("ft", "flash", "cudnn")]
                print(f"{str((b, s, h, d)):<22} {str(causal):<6} {mode:<4} " + " ".join(f"{x:7.1f}" for x in row))


if __name__ == "__main__":
    main()

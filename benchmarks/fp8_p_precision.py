"""How precise P must be in an FP8 forward's P.V product (CPU, float64 emulation): the RMSE of the output against
float64 attention of the dequantized e4m3 inputs, with each row's probabilities relative to its max rounded to one
format before the product with V, next to the bf16 path's RMSE (P rounded to bf16, bf16 inputs against their own
float64 attention). Rounding is the only error emulated: scores, sums and the product are float64, the output is
rounded to bf16 as the kernels store it.

    python benchmarks/fp8_p_precision.py [--batch 2 --seqlen 1024 --heads 8 --head-dim 128] [--not-causal] [--seed 0]

Formats: fp16 (what the FP8 kernels multiply by V, widened exactly from e4m3), bf16, e4m3 (Hopper's FP8 tensor-core
operand: twice fp16's rate), e4m3 scaled per row so that its max is 448 (per-block scaling: e4m3's relative precision
is its 3 mantissa bits wherever the scale puts the values), e4m3 in two pieces (P = hi + lo, two e4m3 products: the
cost of one fp16 product) and e5m2. Issue bar: FP8 RMSE <= 3x the bf16 path's.
"""

from __future__ import annotations

import argparse

import torch

from flashtriton.testing import quantize_e4m3

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def relative_probabilities(q: torch.Tensor, k: torch.Tensor, causal: bool):
    """(B, H, Sq, Sk) float64 probabilities relative to each row's max (in [0, 1]), and (B, H, Sq, 1) their sums, of
    q, k (B, S, H, D) float64 at the default scale; causal: bottom-right aligned (Sq == Sk here: the diagonal)."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    if causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    relative = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return relative, relative.sum(dim=-1, keepdim=True)


def rounded(relative: torch.Tensor, fmt: str) -> torch.Tensor:
    """relative as the P.V operand of format fmt holds it, back in float64."""
    if fmt == "e4m3 x 448":
        return (relative * E4M3_MAX).to(E4M3).double() / E4M3_MAX
    if fmt == "e4m3 hi + lo":
        hi = rounded(relative, "e4m3 x 448")
        # the remainder is below hi's rounding step (2^-4 of it): scaled by 16 so its own e4m3 keeps 3 bits of it
        return hi + ((relative - hi) * (E4M3_MAX * 16)).to(E4M3).double() / (E4M3_MAX * 16)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "e4m3": E4M3, "e5m2": torch.float8_e5m2}[fmt]
    return relative.to(dtype).double()


def output(relative, sums, v, fmt: str) -> torch.Tensor:
    """(B, S, H, D) bf16 output: P rounded to fmt times v (float64), normalized by the unrounded sums."""
    return (torch.einsum("bhqk,bkhd->bqhd", rounded(relative, fmt), v) / sums.transpose(1, 2)).to(torch.bfloat16)


def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.double() - b.double()) ** 2).mean().sqrt())


FORMATS = ("fp16", "bf16", "e4m3", "e4m3 x 448", "e4m3 hi + lo", "e5m2")


def measure(shape: tuple, causal: bool, seed: int):
    """(the bf16 path's RMSE, {format: the FP8 path's RMSE with P.V in it}) on N(0, 1) q, k, v of shape (B, S, H, D)."""
    torch.manual_seed(seed)
    q, k, v = (torch.randn(shape) for _ in range(3))
    # (B, S, H, D) float64: the e4m3 inputs dequantized (the FP8 call's exact operands), and the bf16 path's inputs
    fp8 = [(x8.double() * descale.double()[:, None, :, None]) for x8, descale in map(quantize_e4m3, (q, k, v))]
    bf16 = [x.to(torch.bfloat16).double() for x in (q, k, v)]
    relative, sums = relative_probabilities(fp8[0], fp8[1], causal)
    exact = torch.einsum("bhqk,bkhd->bqhd", relative, fp8[2]) / sums.transpose(1, 2)
    relative_bf16, sums_bf16 = relative_probabilities(bf16[0], bf16[1], causal)
    exact_bf16 = torch.einsum("bhqk,bkhd->bqhd", relative_bf16, bf16[2]) / sums_bf16.transpose(1, 2)
    bf16_rmse = rmse(output(relative_bf16, sums_bf16, bf16[2], "bf16"), exact_bf16)
    return bf16_rmse, {fmt: rmse(output(relative, sums, fp8[2], fmt), exact) for fmt in FORMATS}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--not-causal", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    bf16_rmse, errors = measure(shape, not args.not_causal, args.seed)
    print(f"{' x '.join(map(str, shape))}, {'not causal' if args.not_causal else 'causal'}, N(0, 1), seed {args.seed}")
    print(f"bf16 path (P in bf16, bf16 inputs): RMSE {bf16_rmse:.3e}\n")
    print("| P.V operand of the FP8 path | RMSE | / bf16 path's |\n|---|---|---|")
    for fmt, error in errors.items():
        print(f"| {fmt} | {error:.3e} | {error / bf16_rmse:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

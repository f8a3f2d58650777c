"""FP8 (e4m3) against bf16 (GPU): the forward on the baseline shapes at head dims 128 and 256, an FP8-cache decode,
and the accuracy of both against float64 attention.

    python benchmarks/bench_fp8.py [--timing wall|kernels] [--decode 4x65536,64x4096] [--out DIR]

Forward rows: flashtriton with e4m3 q, k, v (per (batch, kv head) descales, bf16 out) and with bf16 q, k, v, same
run, causal and not; TF/s and the FP8 / bf16 speedup (bar: >= 1.5x). Decode rows: one query token, GQA 32/8, d128,
flash_attn_with_kvcache over an e4m3 cache and a bf16 one: TB/s of the cache bytes read, next to a device copy of
as many bytes. Accuracy: RMSE of each path's output against float64 attention of the dequantized e4m3 inputs (the
bf16 path: of its own bf16 inputs) on N(0, 1) data (bar: FP8 <= 3x bf16's).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import flashtriton
from flashtriton.bench import BASELINE_SHAPES, attention_flops, run_metadata, time_ms
from flashtriton.reference import attention_reference
from flashtriton.testing import quantize_e4m3

FP8 = torch.float8_e4m3fn


def fp8_inputs(q, k, v):
    group = q.shape[2] // k.shape[2]
    (q8, qd), (k8, kd), (v8, vd) = quantize_e4m3(q, group), quantize_e4m3(k), quantize_e4m3(v)
    return q8, k8, v8, dict(q_descale=qd, k_descale=kd, v_descale=vd)


def forward_rows(timing: str) -> list:
    rows = []
    for shape in BASELINE_SHAPES:
        if shape.head_dim not in (128, 256):
            continue
        for causal in (False, True):
            q, k, v = (torch.randn(shape.batch, shape.seqlen, shape.heads, shape.head_dim, device="cuda")
                       for _ in range(3))
            q8, k8, v8, descales = fp8_inputs(q, k, v)
            qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
            with torch.no_grad():
                fp8_ms = time_ms(lambda: flashtriton.flash_attn_func(q8, k8, v8, causal=causal, **descales), timing)
                bf16_ms = time_ms(lambda: flashtriton.flash_attn_func(qb, kb, vb, causal=causal), timing)
            flops = attention_flops(shape.batch, shape.heads, shape.seqlen, shape.seqlen, shape.head_dim, causal)
            rows.append(dict(shape=shape.label(), causal=causal, fp8_ms=fp8_ms, bf16_ms=bf16_ms,
                             fp8_tflops=flops / fp8_ms / 1e9, bf16_tflops=flops / bf16_ms / 1e9,
                             speedup=bf16_ms / fp8_ms))
            torch.cuda.empty_cache()
    return rows


def decode_rows(specs, timing: str) -> list:
    rows = []
    for batch, keys in specs:
        q = torch.randn(batch, 1, 32, 128, device="cuda")
        k, v = (torch.randn(batch, keys, 8, 128, device="cuda") for _ in range(2))
        q8, k8, v8, descales = fp8_inputs(q, k, v)
        qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
        lengths = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
        fp8_ms = time_ms(lambda: flashtriton.flash_attn_with_kvcache(q8, k8, v8, cache_seqlens=lengths, **descales),
                         timing)
        bf16_ms = time_ms(lambda: flashtriton.flash_attn_with_kvcache(qb, kb, vb, cache_seqlens=lengths), timing)
        source = torch.empty(2 * k8.numel(), dtype=torch.uint8, device="cuda")
        target = torch.empty_like(source)
        copy_ms = time_ms(lambda: target.copy_(source), timing)
        fp8_bytes, bf16_bytes = 2 * k8.numel(), 2 * kb.numel() * 2
        rows.append(dict(shape=f"{batch}x{keys}", fp8_tbps=fp8_bytes / fp8_ms / 1e9,
                         bf16_tbps=bf16_bytes / bf16_ms / 1e9, copy_tbps=2 * fp8_bytes / copy_ms / 1e9,
                         fp8_ms=fp8_ms, bf16_ms=bf16_ms))
        torch.cuda.empty_cache()
    return rows


def accuracy_row() -> dict:
    """RMSE against float64 on a (2, 1024, 8, 128) causal case."""
    q, k, v = (torch.randn(2, 1024, 8, 128, device="cuda") for _ in range(3))
    q8, k8, v8, descales = fp8_inputs(q, k, v)
    group = 1
    dequant = [t.double() * d.repeat_interleave(group, 1)[:, None, :, None].double()
               for t, d in ((q8, descales["q_descale"]), (k8, descales["k_descale"]), (v8, descales["v_descale"]))]
    with torch.no_grad():
        fp8_out = flashtriton.flash_attn_func(q8, k8, v8, causal=True, **descales)
        exact_fp8 = attention_reference(*dequant, causal=True, compute_dtype=torch.float64)[0]
        qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
        bf16_out = flashtriton.flash_attn_func(qb, kb, vb, causal=True)
        exact_bf16 = attention_reference(qb.double(), kb.double(), vb.double(), causal=True,
                                         compute_dtype=torch.float64)[0]

    def rms(a, b):
        return float(((a.double() - b.double()) ** 2).mean().sqrt())

    fp8_rmse, bf16_rmse = rms(fp8_out, exact_fp8), rms(bf16_out, exact_bf16)
    return dict(fp8_rmse=fp8_rmse, bf16_rmse=bf16_rmse, ratio=fp8_rmse / bf16_rmse)


def markdown(result: dict) -> str:
    lines = [", ".join(f"{key}: {value}" for key, value in result["metadata"].items() if value is not None), "",
             "| B x S x H x D | causal | FP8 TF/s | bf16 TF/s | FP8 / bf16 |", "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {'yes' if r['causal'] else 'no'} | {r['fp8_tflops']:.1f} | {r['bf16_tflops']:.1f} | "
              f"{r['speedup']:.2f}x |" for r in result["forward"]]
    lines += ["", "| decode B x keys | FP8 cache TB/s | bf16 cache TB/s | copy TB/s | FP8 / copy |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['fp8_tbps']:.2f} | {r['bf16_tbps']:.2f} | {r['copy_tbps']:.2f} | "
              f"{r['fp8_tbps'] / r['copy_tbps']:.2f} |" for r in result["decode"]]
    accuracy = result["accuracy"]
    lines += ["", f"RMSE against float64 (2 x 1024 x 8 x 128, causal, N(0, 1)): FP8 {accuracy['fp8_rmse']:.2e}, bf16 "
              f"{accuracy['bf16_rmse']:.2e}, ratio {accuracy['ratio']:.2f}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timing", choices=("wall", "kernels"), default="wall")
    parser.add_argument("--decode", default="4x65536,64x4096")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write("bench_fp8 needs a CUDA GPU\n")
        return 2
    specs = [tuple(int(x) for x in spec.split("x")) for spec in args.decode.split(",") if spec]
    result = dict(metadata={**run_metadata(), "timing": args.timing}, forward=forward_rows(args.timing),
                  decode=decode_rows(specs, args.timing), accuracy=accuracy_row())
    text = markdown(result)
    sys.stdout.write(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "fp8.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

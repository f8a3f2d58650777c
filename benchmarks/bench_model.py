"""End to end through transformers: a Llama-style causal LM built from a config (about 1B parameters, random init,
bf16), a training step and a generate() loop, tokens/s per attention implementation, all in one process.

    python benchmarks/bench_model.py [--impls flashtriton,sdpa-flash,sdpa-cudnn,fa4] [--layers 16] [--hidden 2048]
                                     [--heads 32] [--kv-heads 8] [--intermediate 5632] [--vocab 32000]
                                     [--batch 4] [--seqlen 2048] [--steps 10]
                                     [--gen-batch 8] [--prompt 512] [--new-tokens 128] [--out DIR]

Implementations: flashtriton (flashtriton.integrations.transformers.register's name), sdpa-flash and sdpa-cudnn
(attn_implementation="sdpa" inside torch.nn.attention.sdpa_kernel with that backend: FA2's kernels, cuDNN's), fa4
(transformers' "flash_attention_4", where flash_attn.cute imports: tools/fa4_wheels.sh). Each builds the same model
(same seed); an implementation that cannot run is reported with its error.

Training: tokens/s of a step (forward with labels, backward, fused AdamW step) over --steps steps after 3 warm-up
steps, batch x seqlen tokens each. Generation: tokens/s of greedy generate() of --new-tokens tokens (exactly) for
--gen-batch prompts of --prompt tokens, after one warm-up call, with transformers' default dynamic cache.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

IMPLEMENTATIONS = ("flashtriton", "sdpa-flash", "sdpa-cudnn", "fa4")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", default=",".join(IMPLEMENTATIONS))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--gen-batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, help="directory for model.json and model.md")
    args = parser.parse_args(argv)
    args.impls = [name for name in args.impls.split(",") if name]
    unknown = [name for name in args.impls if name not in IMPLEMENTATIONS]
    if unknown:
        parser.error(f"unknown implementations {unknown}; expected some of {list(IMPLEMENTATIONS)}")
    return args


def attention_setup(impl: str):
    """(attn_implementation name, context manager factory around every call) of an implementation."""
    if impl == "flashtriton":
        from flashtriton.integrations import transformers as ft_transformers

        return ft_transformers.register(), contextlib.nullcontext
    if impl == "fa4":
        import flash_attn.cute  # noqa: F401 - fails early where FA4 is not installed

        return "flash_attention_4", contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[impl]
    return "sdpa", lambda: sdpa_kernel([backend])


def build_model(args, attn_implementation: str):
    """The Llama-style model in bf16 on args.device, seeded so every implementation gets the same weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max(
                             args.seqlen, args.prompt + args.new_tokens),
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.bfloat16)
    return model.to(args.device)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def training_tokens_per_second(model, args, context) -> float:
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=args.device.startswith("cuda"))
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, args.vocab, (args.batch, args.seqlen), generator=generator).to(args.device)

    def step():
        with context():
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    synchronize(args.device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    synchronize(args.device)
    del optimizer
    return args.steps * args.batch * args.seqlen / (time.perf_counter() - start)


def generate_tokens_per_second(model, args, context) -> float:
    model.eval()
    generator = torch.Generator().manual_seed(2)
    prompts = torch.randint(3, args.vocab, (args.gen_batch, args.prompt), generator=generator).to(args.device)
    options = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                   attention_mask=torch.ones_like(prompts), pad_token_id=0)
    with torch.no_grad(), context():
        model.generate(prompts, **{**options, "max_new_tokens": 4, "min_new_tokens": 4})
        synchronize(args.device)
        start = time.perf_counter()
        tokens = model.generate(prompts, **options)
        synchronize(args.device)
    assert tokens.shape == (args.gen_batch, args.prompt + args.new_tokens)
    return args.gen_batch * args.new_tokens / (time.perf_counter() - start)


def measure(impl: str, args) -> dict:
    """One implementation's row: tokens/s of training and generation, or the error that stopped it."""
    row = {"impl": impl, "train_tokens_per_s": None, "generate_tokens_per_s": None, "status": "ok"}
    model = None
    try:
        name, context = attention_setup(impl)
        model = build_model(args, name)
        row["parameters"] = sum(p.numel() for p in model.parameters())
        row["train_tokens_per_s"] = training_tokens_per_second(model, args, context)
        row["generate_tokens_per_s"] = generate_tokens_per_second(model, args, context)
    except Exception as error:  # noqa: BLE001 - an implementation that cannot run is a row, not a crash
        first_line = (str(error).strip().splitlines() or [""])[0]
        row["status"] = f"unavailable: {type(error).__name__}: {first_line[:160]}"
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def markdown(rows, metadata: dict) -> str:
    """A table of tokens/s per implementation, with ratios to sdpa-flash where it ran."""
    reference = next((r for r in rows if r["impl"] == "sdpa-flash" and r["status"] == "ok"), None)

    def cell(row, key):
        value = row[key]
        if value is None:
            return "-"
        ratio = f" ({value / reference[key]:.3f}x)" if reference and reference[key] else ""
        return f"{value:,.0f}{ratio}"

    lines = [", ".join(f"{key}: {value}" for key, value in metadata.items()), "",
             "| implementation | training tokens/s (vs sdpa-flash) | generate tokens/s (vs sdpa-flash) | status |",
             "|---|---|---|---|"]
    lines += [f"| {r['impl']} | {cell(r, 'train_tokens_per_s')} | {cell(r, 'generate_tokens_per_s')} | {r['status']} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from flashtriton.bench import run_metadata

    rows = [measure(impl, args) for impl in args.impls]
    shape = {key: getattr(args, key) for key in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab",
                                                 "batch", "seqlen", "steps", "gen_batch", "prompt", "new_tokens")}
    parameters = next((r["parameters"] for r in rows if "parameters" in r), None)
    metadata = {**run_metadata(), "parameters": parameters, **shape}
    text = markdown(rows, metadata)
    sys.stdout.write(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "model.json").write_text(json.dumps({"metadata": metadata, "rows": rows}, indent=2) + "\n")
        (args.out / "model.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

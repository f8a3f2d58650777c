"""Context parallelism across GPUs through existing engines, with flashtriton as the local kernel: zigzag ring and
llama3 varlen attention of ring-flash-attn (through flashtriton.install_as_flash_attn()), and PyTorch's
context_parallel with flashtriton activated as SDPA's flash provider.

    python benchmarks/bench_context_parallel.py [--world 2] [--tokens 131072,262144,1048576] [--heads 32]
                                                [--heads-k 8] [--head-dim 128] [--methods zigzag,llama3,torch-cp]
                                                [--check-tokens 16384] [--reps 5] [--device cuda|cpu] [--out DIR]

It spawns --world processes (NCCL on GPUs, one each; gloo on CPU, for testing). Every method first runs a sequence
of --check-tokens tokens whose output and gradients, gathered, are compared with flashtriton's single-process
result; then, per token count, one causal sequence split across the ranks (zigzag: chunks r and 2W - 1 - r of 2W;
llama3 and torch-cp: contiguous chunks) is timed forward and forward + backward (median of --reps after a warm-up),
and rank 0 times the whole sequence alone (where it fits) for the scaling. bf16 (fp16 on CPU), GQA --heads /
--heads-k, causal.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

METHODS = ("zigzag", "llama3", "torch-cp")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", default="131072,262144,1048576")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--heads-k", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--check-tokens", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.tokens = [int(x) for x in args.tokens.split(",") if x]
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; expected some of {list(METHODS)}")
    for tokens in args.tokens + [args.check_tokens]:
        if tokens % (2 * args.world):
            parser.error(f"token counts must be multiples of 2 x world = {2 * args.world}, got {tokens}")
    return args


def _ring_modules():
    """ring_flash_attn's zigzag and llama3 modules, imported without the package's __init__ (which imports its
    Hugging Face adapter, and through it transformers); flash_attn must already resolve to flashtriton."""
    if "ring_flash_attn" not in sys.modules:
        spec = importlib.util.find_spec("ring_flash_attn")
        if spec is None:
            raise ImportError("ring-flash-attn is not installed (pip install --no-deps ring-flash-attn)")
        package = types.ModuleType("ring_flash_attn")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["ring_flash_attn"] = package
    return (importlib.import_module("ring_flash_attn.zigzag_ring_flash_attn"),
            importlib.import_module("ring_flash_attn.llama3_flash_attn_varlen"))


def _rows(tokens: int, rank: int, world: int, method: str):
    """This rank's rows of a sequence of `tokens`: zigzag chunks rank and 2 world - 1 - rank of 2 world, else chunk
    rank of world, as a LongTensor of row indices."""
    if method == "zigzag":
        chunk = tokens // (2 * world)
        return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                          torch.arange((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk)])
    chunk = tokens // world
    return torch.arange(rank * chunk, (rank + 1) * chunk)


class Attention:
    """One method's distributed causal attention on this rank's rows: q (1, n, H, D), k / v (1, n, Hk, D) ->
    out (1, n, H, D)."""

    def __init__(self, method: str, tokens: int, rank: int, world: int, device):
        self.method, self.tokens, self.rank, self.world = method, tokens, rank, world
        if method in ("zigzag", "llama3"):
            zigzag, llama3 = _ring_modules()
            self.zigzag, self.llama3 = zigzag, llama3
        if method == "llama3":
            cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32, device=device)
            (self.cu_q, self.cu_k, self.max_q, self.max_k,
             self.local_k_slice) = llama3.llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, True, rank, world)
        if method == "torch-cp":
            from torch.distributed.device_mesh import init_device_mesh

            if device.type != "cuda":
                # its ring attention dispatches the CUDA SDPA ops; on CPU each rank would attend to its shard alone
                raise NotImplementedError("PyTorch's context_parallel runs on CUDA devices only")

            importlib.import_module("flashtriton")  # importing it registers the SDPA provider
            torch.nn.attention.activate_flash_attention_impl("flashtriton")
            self.mesh = init_device_mesh(device.type, (world,))

    @property
    def takes_local_rows(self) -> bool:
        """ring-flash-attn takes this rank's rows; context_parallel takes whole tensors and shards them itself."""
        return self.method != "torch-cp"

    def __call__(self, q, k, v):
        """ring-flash-attn's attention on this rank's rows (differentiable)."""
        if self.method == "zigzag":
            return self.zigzag.zigzag_ring_flash_attn_func(q, k, v, causal=True)
        out = self.llama3.llama3_flash_attn_varlen_func(
            q[0], k[0], v[0], self.cu_q, self.cu_k, self.max_q, self.max_k, heads_k_stride=1,
            local_k_slice=self.local_k_slice, causal=True)
        return out[None]

    def context_parallel_step(self, q, k, v, dout, backward: bool):
        """PyTorch's context_parallel around SDPA (FLASH backend = flashtriton) on whole (1, S, H, D) tensors: it
        shards them along the sequence in place (load-balanced for causal) and runs ring attention; the output (and
        with backward, the gradients of q, k, v) are gathered whole again on every rank."""
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        group = q.shape[2] // k.shape[2]
        # (1, S, H, D) -> (1, H, S, D), SDPA's layout; K / V heads repeated to q's (GQA)
        buffers = [t.detach().transpose(1, 2).contiguous() for t in (q, k.repeat_interleave(group, 2),
                                                                    v.repeat_interleave(group, 2), dout)]
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), context_parallel(
                self.mesh, buffers=buffers, buffer_seq_dims=[2] * 4, no_restore_buffers=set(buffers)):
            leaves = [b.requires_grad_(backward) for b in buffers[:3]]  # this rank's shards now
            out = scaled_dot_product_attention(*leaves, is_causal=True)
            pieces = [out.detach()]
            if backward:
                out.backward(buffers[3])
                pieces += [leaf.grad for leaf in leaves]
            whole = context_parallel_unshard(self.mesh, pieces, [2] * len(pieces))
        whole = [t.transpose(1, 2) for t in whole]  # (1, S, H, D)
        if backward:  # K / V gradients summed over the query heads that shared each KV head
            whole[2:] = [g.unflatten(2, (k.shape[2], group)).sum(3) for g in whole[2:]]
        return whole


def _inputs(tokens: int, args, device, dtype, seed: int):
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def randn(heads):
        return torch.randn(1, tokens, heads, args.head_dim, generator=generator).to(device=device, dtype=dtype)

    return randn(args.heads), randn(args.heads_k), randn(args.heads_k), randn(args.heads)


def _timed(fn, device, reps: int, in_step: bool = True) -> float:
    """Median milliseconds of fn over reps calls after one warm-up; in_step: every rank in step (barriers around
    each call), else one process alone."""
    fn()
    times = []
    for _ in range(reps):
        if in_step:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if in_step:
            dist.barrier()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _step_fns(attention, q, k, v, dout):
    """(forward only, forward + backward) of one method on local leaves (or, for context_parallel, whole
    tensors)."""
    if isinstance(attention, Attention) and not attention.takes_local_rows:
        return (lambda: attention.context_parallel_step(q, k, v, dout, backward=False),
                lambda: attention.context_parallel_step(q, k, v, dout, backward=True))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def forward():
        with torch.no_grad():
            return attention(q, k, v)

    def forward_backward():
        out = attention(*leaves)
        out.backward(dout)

    return forward, forward_backward


def _check(method: str, args, rank: int, device, dtype) -> float:
    """Max relative error of the gathered output and gradients against flashtriton on one process."""
    import flashtriton

    tokens, world = args.check_tokens, args.world
    q, k, v, dout = _inputs(tokens, args, device, dtype, seed=0)
    attention = Attention(method, tokens, rank, world, device)
    if attention.takes_local_rows:
        rows = _rows(tokens, rank, world, method).to(device)
        local = [t[:, rows].detach().clone().requires_grad_() for t in (q, k, v)]
        out = attention(*local)
        out.backward(dout[:, rows])
        pieces = [out.detach(), *(t.grad for t in local)]
        gathered = []
        for piece in pieces:
            parts = [torch.empty_like(piece) for _ in range(world)]
            dist.all_gather(parts, piece.contiguous())
            full = torch.empty(1, tokens, *piece.shape[2:], dtype=piece.dtype, device=device)
            for r, part in enumerate(parts):
                full[:, _rows(tokens, r, world, method).to(device)] = part
            gathered.append(full)
    else:
        gathered = attention.context_parallel_step(q, k, v, dout, backward=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    single = flashtriton.flash_attn_func(*leaves, causal=True)
    single.backward(dout)
    error = 0.0
    for ours, theirs in zip((single.detach(), *(t.grad for t in leaves)), gathered):
        scale = float(ours.float().abs().max()) or 1.0
        error = max(error, float((ours.float() - theirs.float()).abs().max()) / scale)
    return error


def _worker(rank: int, args, directory: str) -> None:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float16
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{directory}/rendezvous", rank=rank, world_size=args.world)
    rows = []
    try:
        import flashtriton

        flashtriton.install_as_flash_attn()
        single = {}
        for tokens in args.tokens:  # rank 0 alone on the whole sequence, where it fits
            if rank == 0:
                try:
                    q, k, v, dout = _inputs(tokens, args, device, dtype, seed=1)
                    forward, forward_backward = _step_fns(lambda *t: flashtriton.flash_attn_func(*t, causal=True),
                                                          q, k, v, dout)
                    single[tokens] = (_timed(forward, device, args.reps, in_step=False),
                                      _timed(forward_backward, device, args.reps, in_step=False))
                    del q, k, v, dout
                except torch.OutOfMemoryError:
                    single[tokens] = (None, None)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            dist.barrier()
        for method in args.methods:
            row = dict(method=method, world=args.world, status="ok", check_error=None, timings=[])
            try:
                row["check_error"] = _check(method, args, rank, device, dtype)
                for tokens in args.tokens:
                    q, k, v, dout = _inputs(tokens, args, device, dtype, seed=1)
                    attention = Attention(method, tokens, rank, args.world, device)
                    if attention.takes_local_rows:
                        mine = _rows(tokens, rank, args.world, method).to(device)
                        q, k, v, dout = (t[:, mine].contiguous() for t in (q, k, v, dout))
                    forward, forward_backward = _step_fns(attention, q, k, v, dout)
                    fwd_ms = _timed(forward, device, args.reps)
                    step_ms = _timed(forward_backward, device, args.reps)
                    alone = single.get(tokens, (None, None))
                    row["timings"].append(dict(tokens=tokens, fwd_ms=fwd_ms, bwd_ms=step_ms - fwd_ms,
                                               single_fwd_ms=alone[0],
                                               single_bwd_ms=None if alone[1] is None else alone[1] - alone[0]))
                    del q, k, v, dout
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            except Exception as error:  # noqa: BLE001 - a method that cannot run is a row
                first_line = (str(error).strip().splitlines() or [""])[0]
                row["status"] = f"unavailable: {type(error).__name__}: {first_line[:200]}"
            rows.append(row)
            dist.barrier()
        if rank == 0:
            Path(directory, "rows.json").write_text(json.dumps(rows))
        dist.barrier()  # every rank past its last collective, rows.json written
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave without tearing the process group down: gloo's teardown has aborted a process (std::terminate, "terminate
    # called without an active exception") after all of its work was done, failing the run; the OS closes the rest
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def markdown(rows, metadata: dict) -> str:
    lines = [", ".join(f"{key}: {value}" for key, value in metadata.items()), "",
             "| method | GPUs | tokens | fwd ms | bwd ms | one GPU fwd / bwd ms | speedup fwd+bwd | check (rel err) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"| {row['method']} | {row['world']} | - | - | - | - | - | {row['status']} |")
            continue
        for t in row["timings"]:
            alone = "-" if t["single_fwd_ms"] is None else f"{t['single_fwd_ms']:.1f} / {t['single_bwd_ms']:.1f}"
            speedup = "-" if t["single_fwd_ms"] is None else \
                f"{(t['single_fwd_ms'] + t['single_bwd_ms']) / (t['fwd_ms'] + t['bwd_ms']):.2f}x"
            lines.append(f"| {row['method']} | {row['world']} | {t['tokens']} | {t['fwd_ms']:.1f} | "
                         f"{t['bwd_ms']:.1f} | {alone} | {speedup} | {row['check_error']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from flashtriton.bench import run_metadata

    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        sys.stderr.write(f"--world {args.world} needs as many GPUs; this machine has {torch.cuda.device_count()}\n")
        return 2
    with tempfile.TemporaryDirectory() as directory:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        mp.spawn(_worker, args=(args, directory), nprocs=args.world, join=True)
        rows = json.loads(Path(directory, "rows.json").read_text())
    metadata = {**run_metadata(), "heads": args.heads, "heads_k": args.heads_k, "head_dim": args.head_dim,
                "check_tokens": args.check_tokens, "reps": args.reps}
    text = markdown(rows, metadata)
    sys.stdout.write(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "context_parallel.json").write_text(json.dumps({"metadata": metadata, "rows": rows}, indent=2))
        (args.out / "context_parallel.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`flashtriton warmup`: compile the common kernel configurations once so Triton's cache holds them.

Each configuration (head dim x causal x dtype) runs forward + backward on small CUDA inputs, at one sequence
length divisible by 16 and one that is not: Triton specializes integer arguments on divisibility by 16, so the
two compile different kernel variants. The first call's time is the cold-compile (or cache-load) time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)
SEQLENS = (128, 113)


@dataclass
class WarmupResult:
    head_dim: int
    causal: bool
    dtype: str
    seqlen: int
    first_call_ms: Optional[float] = None
    second_call_ms: Optional[float] = None
    status: str = "ok"


def _timed_ms(fn: Callable) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def warm_up_config(head_dim: int, causal: bool, dtype: torch.dtype, seqlen: int, batch: int = 1,
                   heads: int = 2) -> WarmupResult:
    """Forward + backward twice on CUDA; the first time includes compiling (or loading from the cache)."""
    from .interface import flash_attn_func

    result = WarmupResult(head_dim, causal, str(dtype).replace("torch.", ""), seqlen)
    shape = (batch, seqlen, heads, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=dtype)

    def step():
        torch.autograd.grad(flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)

    try:
        result.first_call_ms = _timed_ms(step)
        result.second_call_ms = _timed_ms(step)
    except Exception as error:  # noqa: BLE001 - a configuration that fails to compile is reported, not fatal
        result.status = f"{type(error).__name__}: {str(error).strip()[:160]}"
    return result


TAIL_SEQLEN = 2048  # the sequence length of the calls that warm up the Gluon forward's tail merge


def tail_cut_heads(head_dim: int, causal: bool, device, seqlen: int = TAIL_SEQLEN) -> Optional[int]:
    """The fewest heads (batch 1, seqlen x seqlen) for which the Gluon Hopper forward cuts its grid's last wave
    (ops/hopper.tail_split), so that the call compiles the tail merge (attn_tail_merge_kernel); None where
    the config does not cut tails, the device is no Hopper GPU or no head count up to 256 gives a cut."""
    from . import configs
    from .ops import hopper

    config = configs.HOPPER_FWD.get((head_dim, causal))
    if config is None or not hopper.cuts_tail(config) or not hopper.is_hopper(device):
        return None
    tile_rows = config.consumers * 64
    num_tiles = -(-seqlen // tile_rows)
    for heads in range(1, 257):
        programs, paired = hopper.forward_grid(num_tiles, heads, config, causal, device)
        items = ((num_tiles + 1) // 2 if paired else num_tiles) * heads
        if hopper.tail_split(items, programs, paired, num_tiles, tile_rows, config.block_n, seqlen, seqlen, causal,
                             config.tail_min_blocks):
            return heads
    return None


def warm_up(head_dims: Sequence[int] = HEAD_DIMS, dtypes: Sequence[torch.dtype] = DTYPES,
            causal_values: Sequence[bool] = (False, True), seqlens: Sequence[int] = SEQLENS,
            progress: Optional[Callable[[int, int, str], None]] = None) -> list[WarmupResult]:
    """warm_up_config for every (head dim, causal, dtype, seqlen), then, where the Gluon forward cuts its last wave
    (tail_cut_heads), one call that does so per (head dim, causal, dtype): the tail merge compiles only then."""
    configs = [(d, c, t, s, 2) for d in head_dims for c in causal_values for t in dtypes for s in seqlens]
    for head_dim in head_dims:
        for causal in causal_values:
            heads = tail_cut_heads(head_dim, causal, torch.device("cuda"))
            configs += [(head_dim, causal, dtype, TAIL_SEQLEN, heads) for dtype in dtypes if heads]
    results = []
    for index, (head_dim, causal, dtype, seqlen, heads) in enumerate(configs):
        if progress:
            progress(index + 1, len(configs), f"d{head_dim} causal={causal} {dtype} seqlen {seqlen} heads {heads}")
        results.append(warm_up_config(head_dim, causal, dtype, seqlen, heads=heads))
    return results


def results_table(results: Sequence[WarmupResult]) -> str:
    from .bench import markdown_table

    def ms(value):
        return "-" if value is None else f"{value:.1f}"

    rows = [[r.head_dim, "yes" if r.causal else "no", r.dtype, r.seqlen, ms(r.first_call_ms), ms(r.second_call_ms),
             r.status] for r in results]
    return markdown_table(["head dim", "causal", "dtype", "seqlen", "first call ms", "second call ms", "status"], rows,
                          [True, False, False, True, True, True, False])

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


def warm_up(head_dims: Sequence[int] = HEAD_DIMS, dtypes: Sequence[torch.dtype] = DTYPES,
            causal_values: Sequence[bool] = (False, True), seqlens: Sequence[int] = SEQLENS,
            progress: Optional[Callable[[int, int, str], None]] = None) -> list[WarmupResult]:
    configs = [(d, c, t, s) for d in head_dims for c in causal_values for t in dtypes for s in seqlens]
    results = []
    for index, (head_dim, causal, dtype, seqlen) in enumerate(configs):
        if progress:
            progress(index + 1, len(configs), f"d{head_dim} causal={causal} {dtype} seqlen {seqlen}")
        results.append(warm_up_config(head_dim, causal, dtype, seqlen))
    return results


def results_table(results: Sequence[WarmupResult]) -> str:
    from .bench import markdown_table

    def ms(value):
        return "-" if value is None else f"{value:.1f}"

    rows = [[r.head_dim, "yes" if r.causal else "no", r.dtype, r.seqlen, ms(r.first_call_ms), ms(r.second_call_ms),
             r.status] for r in results]
    return markdown_table(["head dim", "causal", "dtype", "seqlen", "first call ms", "second call ms", "status"], rows,
                          [True, False, False, True, True, True, False])

"""Launcher of the warp-specialized Hopper backward (dK, dV and dQ in one kernel: kernels/bwd_hopper.py at head dims
64 and 128, kernels/bwd_hopper_d256.py at 256) and the rule for when it runs.

backend.launch_bwd asks `runs_on` before the preprocess (delta, and zeros into the dQ accumulator) and falls back to
the Triton kernels (kernels/bwd.py) for everything else. configs.HOPPER_BWD_ALLOWED (FLASHTRITON_GLUON_BWD=0 turns it
off; testing.forced_gluon_backward in tests) switches it. At head dims 64 and 128 it adds dQ with TMA reductions;
at 128 they can come in a fixed order (`orders_dq`: deterministic=True, or FLASHTRITON_ORDERED_DQ=1 for every call),
at 64 never, so deterministic=True does not take it there; at 256 it computes dK and dV only and backend.launch_bwd
runs the Triton dQ kernel after it (no reductions, no accumulator: deterministic).
"""

from __future__ import annotations

from typing import Tuple

import torch

from .. import configs
from .hopper_fwd import _multiprocessors, covers as forward_covers, is_hopper, shared_layout, tile_descriptor
from .launching import compiled_without_line_info, tma_compatible, triton_cdiv

try:
    from ..kernels.bwd_hopper import KEYS_PER_CONSUMER, attn_bwd_hopper_kernel
    from ..kernels.bwd_hopper_d256 import KEYS_PER_PROGRAM, attn_bwd_hopper_d256_kernel
    from ..kernels.bwd_hopper_dq import ROWS_PER_CONSUMER, attn_bwd_hopper_dq_kernel
    from .hopper_fwd import checked_descriptor  # exists where the Gluon forward imported
    KEY_BLOCK = 2 * KEYS_PER_CONSUMER.value
    KEY_BLOCK_D256 = KEYS_PER_PROGRAM.value
    DQ_ROWS = ROWS_PER_CONSUMER.value
    compiled_without_line_info(attn_bwd_hopper_kernel, attn_bwd_hopper_d256_kernel, attn_bwd_hopper_dq_kernel)
except Exception:  # Triton without Gluon's Hopper API, or its interpreter: the Triton kernels run everything
    attn_bwd_hopper_kernel = attn_bwd_hopper_d256_kernel = attn_bwd_hopper_dq_kernel = None
    KEY_BLOCK, KEY_BLOCK_D256, DQ_ROWS = 128, 64, 64

# Launches of the dK / dV (and dQ) kernel and of the dQ kernel since import; tests read them to know that the path
# they check ran.
launch_count = 0
dq_launch_count = 0


def covers(head_dim: int, dtype: torch.dtype, seqlen_q: int, seqlen_k: int, params, plain: bool,
           deterministic: bool) -> bool:
    """Whether the Gluon backward computes this call (device and layouts aside): the forward's rule (dense, no
    window but the causal one, no softcap, ALiBi or dropout), a head dim with a configs.HOPPER_BWD entry, and with
    deterministic=True a head dim where dQ is not added in an arbitrary order (`orders_dq`)."""
    return (head_dim in configs.HOPPER_BWD
            and not (deterministic and computes_dq(head_dim) and not can_order_dq(head_dim))
            and forward_covers(head_dim, dtype, seqlen_q, seqlen_k, params, plain))


def computes_dq(head_dim: int) -> bool:
    """Whether the Gluon backward adds dQ itself (into the fp32 accumulator: head dims 64 and 128), or computes dK
    and dV only and leaves dQ to the Triton dQ kernel (head dim 256: there the reductions cost the kernel a fifth of
    its speed, configs.HOPPER_BWD). head_dim must have a configs.HOPPER_BWD entry."""
    return division(head_dim)[3] is not None


def can_order_dq(head_dim: int) -> bool:
    """Whether the kernel can add dQ in a fixed order at this head dim: where it splits dQ by features (128), each
    consumer adds its own features, one reduction per (query block, feature half) and key block; at 64 both
    consumers add into the same features and are not ordered."""
    return computes_dq(head_dim) and division(head_dim)[3][1] < head_dim


def orders_dq(head_dim: int, deterministic: bool) -> bool:
    """Whether this backward adds dQ in the fixed order (kernels/bwd_hopper.py, ORDERED): deterministic=True, or
    configs.HOPPER_BWD_ORDERED for every call, where the head dim allows it."""
    return can_order_dq(head_dim) and (deterministic or configs.HOPPER_BWD_ORDERED)


def order_fits(seqlen_k: int, device: torch.device) -> bool:
    """Whether ordered dQ can run: its waits resolve only if every key block of a (batch, kv head) is resident at
    once (launch-order groups of one head, one program per SM), so at most one key block per multiprocessor."""
    return triton_cdiv(seqlen_k, KEY_BLOCK) <= _multiprocessors(device)


# dQ columns per consumer warpgroup and TMA reduction: half of head dim 128, all of head dim 64 (kernels/bwd_hopper)
DQ_FEATURES = 64
# Head dim 256 (kernels/bwd_hopper_d256): Q / dO move in feature halves
D256_QDO_FEATURES = 128


def division(head_dim: int):
    """(kernel, keys per program, features per Q / dO box, (rows, features) per dQ reduction or None) of a head
    dim."""
    if head_dim == 256:
        return attn_bwd_hopper_d256_kernel, KEY_BLOCK_D256, D256_QDO_FEATURES, None
    return attn_bwd_hopper_kernel, KEY_BLOCK, head_dim, (configs.HOPPER_BWD[head_dim].query_rows, DQ_FEATURES)


def runs_on(q, params, seqlen_q: int, seqlen_k: int, plain: bool, deterministic: bool, descriptors_ok: bool) -> bool:
    """`covers`, the kernel switched on and present, sm_90, (descriptors_ok, the caller's check of q, k, v and
    dout with launching.tma_compatible) layouts tensor descriptors can address, and where dQ is ordered, room for
    the order (`order_fits`)."""
    return (attn_bwd_hopper_kernel is not None and configs.HOPPER_BWD_ALLOWED and configs.TMA_ALLOWED and q.is_cuda
            and descriptors_ok and covers(q.shape[-1], q.dtype, seqlen_q, seqlen_k, params, plain, deterministic)
            and is_hopper(q.device)
            and not (orders_dq(q.shape[-1], deterministic) and not order_fits(seqlen_k, q.device)))


def _row_statistic_descriptor(stat: torch.Tensor, strides: Tuple[int, int], batch: int, num_heads: int,
                              seqlen_q: int, rows: int):
    """Descriptor of a per-row fp32 statistic (lse or delta: (batch, head) strides, rows contiguous) as a
    (B * H, Sq) matrix loading [1, rows] blocks (rows past seqlen_q read 0); copied into a matrix with 16-byte
    aligned rows where its own layout is not one."""
    matrix = stat.as_strided((batch * num_heads, seqlen_q), (strides[1], 1))
    if strides[0] != num_heads * strides[1] or not tma_compatible(matrix):
        padded = torch.empty(batch * num_heads, triton_cdiv(seqlen_q, 4) * 4, dtype=torch.float32, device=stat.device)
        matrix = padded[:, :seqlen_q]
        matrix.view(batch, num_heads, seqlen_q).copy_(stat.as_strided((batch, num_heads, seqlen_q), (*strides, 1)))
    return checked_descriptor(matrix, list(matrix.shape), list(matrix.stride()), [1, rows],
                              shared_layout((1, rows), torch.float32))


def launch(q, k, v, dout, lse, delta, dq, dk, dv, dq_accum, lse_strides: Tuple[int, int],
           delta_strides: Tuple[int, int], params, seqlen_q: int, seqlen_k: int, batch: int,
           heads_per_group: int, deterministic: bool) -> None:
    """dK, dV into dk, dv and dQ into dq (B, S, H, D each) from lse and delta (fp32, rows contiguous, (batch,
    head) strides lse_strides / delta_strides), which the kernel loads by TMA with each Q / dO block. The kernel
    adds its scaled dQ products into dq_accum (fp32, q's shape, contiguous, zeroed) by TMA reductions (which clip
    rows past seqlen_q), copied into dq at the end; where it does not compute dQ (`computes_dq`) dq_accum is None
    and dq is left to the caller. With ordered dQ (`orders_dq`) the reductions take turns on zeroed counters, and
    each (batch, kv head)'s key blocks launch together."""
    global launch_count
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_heads_k = k.shape[-2]
    config = configs.HOPPER_BWD[head_dim]
    kernel, keys, qdo_features, dq_box = division(head_dim)
    grid = (triton_cdiv(seqlen_k, keys) * batch * num_heads_k,)
    ordered = orders_dq(head_dim, deterministic)
    # per (batch, query head, query block of the kernel, feature half): reductions completed so far
    dq_counters = (torch.zeros(batch * num_heads * triton_cdiv(seqlen_q, config.query_rows) * 2, dtype=torch.int32,
                               device=q.device) if ordered else None)
    kernel_args = {} if dq_box is None else dict(ORDERED=ordered)
    kernel[grid](
        tile_descriptor(k, keys), tile_descriptor(v, keys), tile_descriptor(q, config.query_rows, qdo_features),
        tile_descriptor(dout, config.query_rows, qdo_features),
        *(() if dq_box is None else (tile_descriptor(dq_accum, *dq_box), )),
        *(_row_statistic_descriptor(stat, strides, batch, num_heads, seqlen_q, config.query_rows)
          for stat, strides in ((lse, lse_strides), (delta, delta_strides))),
        dk, dv, *(() if dq_box is None else (dq_counters, )), dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2), num_heads_k, num_heads // num_heads_k, seqlen_q, seqlen_k,
        1 if ordered else heads_per_group, params.softmax_scale, params.kernel_args()[0],
        CAUSAL=params.causal_like, STAGES=config.stages, CONSUMER_REGS=config.consumer_regs, num_warps=4,
        **kernel_args)
    if dq_accum is not None:
        dq.copy_(dq_accum)
    launch_count += 1


def dq_kernel_runs(dq) -> bool:
    """Whether the Gluon dQ kernel (kernels/bwd_hopper_dq.py) computes dq after a Gluon dK / dV kernel that leaves it
    (`computes_dq` false): a configs.HOPPER_DQ entry, the switch on, and dq addressable by a tensor descriptor; else
    the Triton dQ kernel does."""
    return (attn_bwd_hopper_dq_kernel is not None and configs.HOPPER_DQ_ALLOWED and dq.shape[-1] in configs.HOPPER_DQ
            and tma_compatible(dq))


def launch_dq(q, k, v, dout, lse, delta, dq, lse_strides: Tuple[int, int], delta_strides: Tuple[int, int], params,
              seqlen_q: int, seqlen_k: int, batch: int) -> None:
    """dQ into dq (B, S, H, D) from lse and delta (fp32, rows contiguous, (batch, head) strides), by the Gluon dQ
    kernel: one program per 128 query rows of a (batch, head), no atomics."""
    global dq_launch_count
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    config = configs.HOPPER_DQ[head_dim]
    grid = (triton_cdiv(seqlen_q, 2 * DQ_ROWS) * batch * num_heads,)
    attn_bwd_hopper_dq_kernel[grid](
        tile_descriptor(q, DQ_ROWS), tile_descriptor(dout, DQ_ROWS), tile_descriptor(k, config.block_n),
        tile_descriptor(v, config.block_n), tile_descriptor(dq, DQ_ROWS), lse, delta, *lse_strides, *delta_strides,
        num_heads, num_heads // k.shape[-2], seqlen_q, seqlen_k, params.softmax_scale, params.kernel_args()[0],
        CAUSAL=params.causal_like, STAGES=config.stages, CONSUMER_REGS=config.consumer_regs, num_warps=4)
    dq_launch_count += 1

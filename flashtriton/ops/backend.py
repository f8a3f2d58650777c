"""The backend seam: allocate, pick a config, launch. Same entry points as flash_attn's C extension.

Where kernels run:
  * CUDA tensors run the compiled Triton kernels on the tensors' device (or the Gluon kernels of ops/hopper.py
    on sm_90, where they cover the call).
  * CPU tensors run the same kernels through Triton's interpreter when the kernels were decorated
    with TRITON_INTERPRET=1 set (it must be set before flashtriton is imported), and otherwise the
    exact PyTorch reference in float32 (ops/reference_path.py).
Argument checks live in ops/checks.py; the scalar semantics of a call (ScoreParams) in flashtriton/scores.py.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import configs
from ..kernels.bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel
from ..kernels.combine import attn_combine_kernel
from ..kernels.fill import fill_uncovered_rows_kernel
from ..kernels import fwd as fwd_kernel_module
from ..kernels.fwd import attn_fwd_kernel
from ..scores import ScoreParams, score_params
from . import call_plans, checks, dropout, hopper, interpreter_compat, reference_path, sink
from .launching import (alibi_batch_stride, compiled_without_line_info, compiler_key_ahead, device_guard, launch,
                        tma_compatible, triton_cdiv)

compiled_without_line_info(attn_fwd_kernel, attn_combine_kernel, fill_uncovered_rows_kernel, attn_bwd_preprocess_kernel,
                           attn_bwd_dkdv_kernel, attn_bwd_dq_kernel)

TMA_OFF, TMA_HOST, TMA_DEVICE, TMA_PACKED = (mode.value for mode in (
    fwd_kernel_module.TMA_OFF, fwd_kernel_module.TMA_HOST, fwd_kernel_module.TMA_DEVICE, fwd_kernel_module.TMA_PACKED))

# TRITON_INTERPRET is read when @triton.jit runs, so the kernel objects themselves say how they run.
KERNELS_INTERPRETED = type(attn_fwd_kernel).__name__ == "InterpretedFunction"
compiler_key_ahead(KERNELS_INTERPRETED)
if KERNELS_INTERPRETED:
    interpreter_compat.install()


# Tests set this (flashtriton.testing.poisoned_outputs) so every output buffer starts as NaN/garbage
# and an element a kernel forgot to write fails the comparison.
POISON_OUTPUTS = False
COMBINE_BLOCK = 16  # query rows per combine program


def new_empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Allocate an output buffer; NaN-filled (or 0x7f.. for integers) while POISON_OUTPUTS is set."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if POISON_OUTPUTS:
        tensor.fill_(float("nan") if tensor.is_floating_point() else 0x7F)
    return tensor


def empty_like(tensor: torch.Tensor) -> torch.Tensor:
    return new_empty(tensor.shape, tensor.dtype, tensor.device)


def runs_triton(tensor: torch.Tensor) -> bool:
    """True when this tensor's attention runs the Triton kernels (compiled, or interpreted on CPU)."""
    return tensor.is_cuda or KERNELS_INTERPRETED


def round_multiple(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _bsh_strides(tensor: torch.Tensor) -> Tuple[int, int, int]:
    """(batch, sequence, head) strides of a (B, S, H, D) tensor."""
    return tensor.stride()[:3]


def _varlen_strides(tensor: torch.Tensor) -> Tuple[int, int, int]:
    """(batch, token, head) strides of a (T, H, D) tensor: sequences are found through cu_seqlens."""
    return (0, *tensor.stride()[:2])


def _paged_strides(tensor: torch.Tensor) -> Tuple[int, int, int]:
    """(batch, row-in-page, head) strides of a paged (num_pages, page_size, H, D) cache."""
    return (0, *tensor.stride()[1:3])


def _scratch_buffer(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_scratch_allocator() -> None:
    """In-kernel tensor descriptors live in a per-launch global scratch buffer that Triton asks an allocator
    for; install one backed by PyTorch's caching allocator unless the user set their own."""
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch_buffer)


def _row_descriptor(tensor: torch.Tensor, rows: int, block_dim: int):
    """Descriptor of a (B, S, H, D) tensor loading [1, rows, 1, block_dim] tiles; out-of-bounds reads are 0."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), [1, rows, 1, block_dim])


def fwd_tile_grid(seqlen_q: int, batch: int, num_heads: int, num_heads_k: int, block_m: int) -> Tuple[int, int]:
    """(query tiles, batch x heads) of the forward grid; packed GQA tiles hold group_size heads' rows."""
    group_size = num_heads // num_heads_k
    if configs.pack_gqa(seqlen_q, group_size):
        return triton_cdiv(seqlen_q * group_size, block_m), batch * num_heads_k
    return triton_cdiv(seqlen_q, block_m), batch * num_heads


def _operand_bytes(operand: torch.Tensor, rows: int, operands_per_head: float) -> int:
    """Bytes one grid head reads from `operands_per_head` operands of `rows` rows like `operand` (a fraction when
    query heads share a KV head): what a launch-order group keeps in L2 per (batch, head) pair."""
    return int(rows * operand.shape[-1] * operand.element_size() * operands_per_head)


def splits_for(q: torch.Tensor, num_heads_k: int, seqlen_q: int, capacity: int, num_splits: int,
               causal_like: bool = False, page_size: int = 0, head_dim_v: int = 0) -> int:
    """The caller's num_splits, or the heuristic's choice for <= 0 (from shapes only: no host sync).

    causal_like must be what launch_fwd keys its tile config on (ScoreParams.causal_like), page_size the
    paged cache's page (0: contiguous) and head_dim_v V's head dim (0: q's), so the key-block count matches the
    launch (configs.forward_launch_config serves both).
    """
    if num_splits > 0:
        return min(num_splits, 128)
    config = configs.forward_launch_config(configs.arch_class(q.device), max(q.shape[-1], head_dim_v),
                                           causal_like, seqlen_q, page_size=page_size)
    slots = configs.multiprocessor_count(q.device)
    if page_size:
        slots *= configs.PAGED_PROGRAMS_PER_SM
    query_tiles, batch_heads = fwd_tile_grid(seqlen_q, q.shape[0], q.shape[2], num_heads_k, config.block_m)
    programs = query_tiles * batch_heads
    return configs.num_splits_heuristic(programs, triton_cdiv(capacity, config.block_n), slots)


def fwd_row_bounds(q, k, is_varlen: bool, block_table, seqused_k, leftpad_k, cache_batch_idx) -> tuple:
    """attn_fwd_kernel's (q_rows, k_rows, kv_rows): the rows that index values may name, None where no index tensor
    decides them (dense calls compile as before). The kernel clamps sequences into them and masks cache rows and pages
    outside them, so malformed index values never make it touch memory outside its tensors (docs/api.md §6)."""
    is_paged = block_table is not None
    k_rows = None
    if is_paged:
        k_rows = block_table.shape[1] * k.shape[1]
    elif is_varlen:
        k_rows = k.shape[0]
    elif seqused_k is not None or leftpad_k is not None:
        k_rows = k.shape[1]
    kv_rows = k.shape[0] if is_paged or cache_batch_idx is not None else None
    return q.shape[0] if is_varlen else None, k_rows, kv_rows


def launch_fwd(q, k, v, out, lse, params: ScoreParams, alibi_slopes, lse_strides: Tuple[int, int],
               seqlen_q: int, seqlen_k: int, batch: int, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
               leftpad_k=None, block_table=None, cache_batch_idx=None, num_splits: int = 1, dropout_p: float = 0.0,
               rng_state=None, descales=None, learnable_sink=None) -> None:
    """Run the forward kernel into preallocated out (q's layout) and lse (fp32, rows contiguous).

    Dense: q/k/v (B, S, H, D) (v and out: V's head dim Dv, any of 1..MAX_HEAD_DIM). Varlen (cu_seqlens given):
    (T, H, D), seqlen_q/k are the max lengths.
    Paged (block_table given): k/v are (num_pages, page_size, Hk, D). cache_batch_idx maps q's batch rows
    to K/V rows; seqused_k / leftpad_k bound each row's keys. num_splits > 1 (dense layout only) splits
    each row's keys, writes fp32 partials and merges them with the combine kernel. dropout_p > 0 drops
    attention probabilities with the Philox stream seeded by rng_state ((2,) int64: seed, offset). descales: FP8
    q, k, v's (q_descale, k_descale, v_descale), (B, Hk) fp32 each (out is bf16 then). learnable_sink (H,), dense
    calls: folded into out and lse, by the Gluon forward itself or by sink.fold_sink after the Triton kernel.
    """
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_heads_k, head_dim_v = k.shape[-2], v.shape[-1]
    is_varlen = cu_seqlens_q is not None
    is_paged = block_table is not None
    config = configs.forward_launch_config(configs.arch_class(q.device), max(head_dim, head_dim_v),
                                           params.causal_like, seqlen_q, dropout_p > 0.0,
                                           k.shape[1] if is_paged else 0)
    if seqlen_q == 0 or batch == 0:
        return
    pack_gqa = configs.pack_gqa(seqlen_q, num_heads // num_heads_k)
    query_tiles, batch_heads = fwd_tile_grid(seqlen_q, batch, num_heads, num_heads_k, config.block_m)
    # launch-order groups (both kernels): K and V are what a group's programs share (a packed GQA tile: one KV head's)
    heads_per_group = configs.heads_per_l2_group(
        _operand_bytes(k, seqlen_k, 2 if pack_gqa else 2 * num_heads_k / num_heads), batch_heads, params.causal_like)
    # ALiBi: causal calls only (hopper.covers' rule does not see the slopes): non-causal, its distances spill the
    # Gluon forward's registers (sm_90 offline compiles). Varlen calls without a query or key row: no tensor
    # descriptor has zero rows
    # Head dims above 256 (hopper.wide_forward's tiles): dense calls without ALiBi, dropout or sinks. FP8: not with
    # ALiBi (the Gluon forward scales the scores, not ALiBi's logits, by the descales). Paged pools: varlen calls
    # without dropout or FP8, pools the Gluon forward reads (hopper.takes_pages), a block table of unit entry stride
    gluon_pages = (is_paged and is_varlen and dropout_p == 0.0 and descales is None and block_table.stride(1) == 1
                   and hopper.takes_pages(k, v))
    plain = not ((is_paged and not gluon_pages) or num_splits > 1 or seqused_k is not None or leftpad_k is not None
                 or cache_batch_idx is not None or (alibi_slopes is not None and not params.causal_like)
                 or (is_varlen and (q.shape[0] == 0 or k.shape[0] == 0))
                 or (max(head_dim, head_dim_v) > 256 and (is_varlen or alibi_slopes is not None or dropout_p > 0.0
                                                          or learnable_sink is not None))
                 or (descales is not None and alibi_slopes is not None))
    if hopper.gluon_runs("fwd", q, params, seqlen_q, seqlen_k, plain, (q, k, v, out), head_dim_v=head_dim_v):
        if learnable_sink is not None:
            learnable_sink = learnable_sink.contiguous()  # the kernel reads sink[h] at h
        if descales is not None:
            # FP8: V enters the P V product in fp16 (exactly: every e4m3 value is an fp16 one; an allocation and a
            # copy, which call plans repeat); the descales are read at batch * Hk + kv head
            v_fp16 = torch.empty(v.shape, dtype=torch.float16, device=v.device)
            v = v_fp16.copy_(v)
            descales = tuple(d.contiguous() for d in descales)
        with device_guard(q):
            hopper.launch_fwd(q, k, v, out, lse, lse_strides, params, seqlen_q, seqlen_k, batch, heads_per_group,
                              cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_p, rng_state, learnable_sink,
                              descales, block_table)
        return
    q_strides = _varlen_strides if is_varlen else _bsh_strides
    kv_strides = _paged_strides if is_paged else q_strides
    page_size, page_strides = (k.shape[1], (k.stride(0), v.stride(0))) if is_paged else (1, (0, 0))
    block_dim, block_dim_v = configs.block_d(head_dim), configs.block_d(head_dim_v)
    is_split = num_splits > 1
    if is_split:
        assert not is_varlen, "split-KV is implemented for the dense layout only"
        target_out, target_lse = out, lse
        out = new_empty((num_splits, *out.shape), torch.float32, q.device)
        lse = new_empty((num_splits, *lse.shape), torch.float32, q.device)
    split_strides = (out.stride(0), lse.stride(0)) if is_split else (0, 0)
    lse_strides = (lse.stride(1), lse.stride(2)) if is_split else lse_strides
    tma_mode = TMA_OFF
    # a TMA box is at most 256 elements wide: wider head dims load by pointer
    if (config.use_tma and not is_paged and q.shape[-3] > 0 and k.shape[-3] > 0 and max(block_dim, block_dim_v) <= 256
            and all(tma_compatible(t) for t in (q, k, v, out))):
        per_sequence = (is_split or pack_gqa or seqused_k is not None or leftpad_k is not None
                        or cache_batch_idx is not None)
        if is_varlen:
            tma_mode = TMA_DEVICE if pack_gqa else TMA_PACKED
        else:
            tma_mode = TMA_DEVICE if per_sequence else TMA_HOST
    if tma_mode == TMA_DEVICE:
        _ensure_scratch_allocator()
    descriptors = (None,) * 4
    if tma_mode == TMA_HOST:
        descriptors = tuple(_row_descriptor(t, rows, width)
                            for t, rows, width in ((q, config.block_m, block_dim), (k, config.block_n, block_dim),
                                                   (v, config.block_n, block_dim_v),
                                                   (out, config.block_m, block_dim_v)))
    elif tma_mode == TMA_PACKED:  # (total, H, D) viewed as one (1, total, H, D) sequence; O is stored by pointer
        descriptors = (*(_row_descriptor(t.unsqueeze(0), rows, width)
                         for t, rows, width in ((q, config.block_m, block_dim), (k, config.block_n, block_dim),
                                                (v, config.block_n, block_dim_v))), None)
    grid = (query_tiles * batch_heads, num_splits)
    row_bounds = fwd_row_bounds(q, k, is_varlen, block_table, seqused_k, leftpad_k, cache_batch_idx)
    with device_guard(q):
        launch(
            attn_fwd_kernel, grid,
            (q, k, v), (out, lse),
            (alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, cache_batch_idx, rng_state,
             None if descales is None else tuple(d.contiguous() for d in descales)),
            *descriptors, (q_strides(q), kv_strides(k), kv_strides(v), q_strides(out[0] if is_split else out)),
            *lse_strides, (alibi_batch_stride(alibi_slopes), block_table.stride(0) if is_paged else 0), page_size,
            page_strides, split_strides, (num_heads, num_heads // num_heads_k), seqlen_q, seqlen_k, heads_per_group,
            params.kernel_scores(), params.window_left, params.window_right, int(params.alibi_pure_causal),
            dropout.kernel_dropout(dropout_p), *row_bounds,
            HEAD_DIM=head_dim, BLOCK_D=block_dim, HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dim_v,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, IS_LOCAL=params.is_local, HAS_SOFTCAP=params.has_softcap,
            HAS_DROPOUT=dropout_p > 0.0, IS_SPLIT=is_split, TMA_MODE=tma_mode,
            FOLD_SCALE=not params.has_softcap and alibi_slopes is None and params.softmax_scale > 0.0,
            PACK_GQA=pack_gqa, TILE_IN_PAGE=is_paged and k.shape[1] % config.block_n == 0,
            RESCALE_THRESHOLD=config.rescale_threshold,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        if is_split:
            combine_grid = (triton_cdiv(seqlen_q, COMBINE_BLOCK) * batch * num_heads,)
            launch(
                attn_combine_kernel, combine_grid,
                out, lse, target_out, target_lse,
                out.stride(0), out.stride(1), out.stride(2), out.stride(3),
                lse.stride(0), lse.stride(1), lse.stride(2),
                target_out.stride(0), target_out.stride(1), target_out.stride(2),
                target_lse.stride(0), target_lse.stride(1),
                num_heads, seqlen_q, num_splits,
                HEAD_DIM=head_dim_v, BLOCK_D=block_dim_v, BLOCK_M=COMBINE_BLOCK,
            )
    if learnable_sink is not None:
        sink.fold_sink(target_out if is_split else out, target_lse if is_split else lse, learnable_sink,
                       runs_kernels=True)


def mha_fwd(q, k, v, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
            window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor], return_softmax: bool,
            learnable_sink: Optional[torch.Tensor] = None, q_descale=None, k_descale=None, v_descale=None):
    """Dense forward. Returns (out, softmax_lse (B, H, Sq), S_dmask, rng_state); see docs/api.md §7. With
    learnable_sink (H,) the LSE includes the sinks (§4.11); q/k/v_descale: FP8 inputs' (§4.12), out in bf16."""
    descales = (q_descale, k_descale, v_descale)
    # a repeated signature runs its call plan: its first call's operations and launches, without their derivation
    # (ops/call_plans; not with dropout, whose rng_state draws from the generator on the host)
    return call_plans.run_planned(
        "fwd", _mha_fwd, (q, k, v, alibi_slopes, learnable_sink, *descales) if dropout_p == 0.0 else None,
        (float(softmax_scale), bool(causal), int(window_size_left), int(window_size_right), float(softcap),
         bool(return_softmax)),
        q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
        return_softmax, learnable_sink, descales)


def _mha_fwd(q, k, v, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
             window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor], return_softmax: bool,
             learnable_sink: Optional[torch.Tensor], descales: tuple):
    """mha_fwd's whole forward: checks, allocations, the launcher."""
    checks.check_fwd(q, k, v, dropout_p, softcap, alibi_slopes, return_softmax)
    checks.check_learnable_sink(learnable_sink, q, q.shape[2])
    fp8 = checks.check_fp8(q, descales, q.shape[0], k.shape[2], dropout_p)
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    q, k, v = (t if checks.has_contiguous_last_dim(t) else t.contiguous() for t in (q, k, v))
    head_dim_v = v.shape[-1]
    window = (window_size_left, window_size_right)
    use_kernels = runs_triton(q)
    rng_state = dropout.new_rng_state(q.device) if dropout_p > 0.0 else torch.zeros(2, dtype=torch.int64,
                                                                                   device=q.device)
    keep = None
    if dropout_p > 0.0 and (return_softmax or not use_kernels):
        keep = dropout.keep_mask(rng_state, batch, num_heads, round_multiple(seqlen_q, 128),
                                 round_multiple(seqlen_k, 128), dropout_p, use_kernels)
    s_dmask = torch.empty(0, dtype=q.dtype, device=q.device)
    if return_softmax:
        mask_shape = (batch, num_heads, round_multiple(seqlen_q, 128), round_multiple(seqlen_k, 128))
        s_dmask = dropout.dense_s_dmask(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes, keep, mask_shape,
                                        learnable_sink)

    if not use_kernels:
        out, lse = reference_path.dense_forward(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes,
                                                dropout_p, keep, descales if fp8 else None)
        if learnable_sink is not None:
            sink.fold_sink(out, lse, learnable_sink, runs_kernels=False)
        return out, lse, s_dmask, rng_state

    params = score_params(softmax_scale, causal, window_size_left, window_size_right, softcap, seqlen_k)
    out = new_empty((batch, seqlen_q, num_heads, head_dim_v), torch.bfloat16 if fp8 else q.dtype, q.device)
    lse = new_empty((batch, num_heads, seqlen_q), torch.float32, q.device)
    # decode-shaped calls (a few query rows) split the keys as flash_attn_with_kvcache does
    num_splits = 1
    if seqlen_q <= configs.DECODE_MAX_ROWS and dropout_p == 0.0:
        num_splits = splits_for(q, k.shape[2], seqlen_q, seqlen_k, 0, params.causal_like, head_dim_v=head_dim_v)
    launch_fwd(q, k, v, out, lse, params, alibi_slopes, (lse.stride(0), lse.stride(1)), seqlen_q, seqlen_k, batch,
               num_splits=num_splits, dropout_p=dropout_p, rng_state=rng_state, descales=descales if fp8 else None,
               learnable_sink=learnable_sink)
    return out, lse, s_dmask, rng_state


# ----------------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------------

def launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, delta, params: ScoreParams, alibi_slopes,
               lse_strides: Tuple[int, int], delta_strides: Tuple[int, int], seqlen_q: int, seqlen_k: int, batch: int,
               cu_seqlens_q=None, cu_seqlens_k=None, dropout_p: float = 0.0, rng_state=None,
               deterministic: bool = False, delta_rows: int = 0) -> None:
    """Run preprocess, dK/dV and dQ into preallocated dq/dk/dv (any strides, last dim contiguous).

    delta (fp32, (batch, head) strides delta_strides, rows contiguous) receives rowsum(dout * out), and 0 in rows
    [seqlen_q, delta_rows) (a dense softmax_d's padding). dQ is added into an fp32 accumulator, which the
    preprocess zeroes, by the Gluon Hopper backward (TMA reductions; with deterministic=True in a fixed order,
    hopper.orders_dq) or, with configs that have dq_atomic and not deterministic=True, by atomics in the dK/dV
    kernel, then converted into dq. After a Gluon backward that computes dK and dV only (hopper.computes_dq), the
    Gluon dQ kernel computes dq where hopper.dq_kernel_runs; otherwise the Triton dQ kernel does.
    """
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_heads_k, head_dim_v = k.shape[-2], v.shape[-1]
    group_size = num_heads // num_heads_k
    config = configs.bwd_config(configs.arch_class(q.device), max(head_dim, head_dim_v))
    is_varlen = cu_seqlens_q is not None
    seq_strides = _varlen_strides if is_varlen else _bsh_strides
    block_dim, block_dim_v = configs.block_d(head_dim), configs.block_d(head_dim_v)
    head_dims = dict(HEAD_DIM=head_dim, BLOCK_D=block_dim, HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dim_v)
    # one check serves the Triton kernels' descriptors and the Gluon backward's rule (host time per backward)
    descriptors_ok = all(tma_compatible(t) for t in (q, k, v, dout))
    use_tma = config.use_tma and descriptors_ok and max(block_dim, block_dim_v) <= 256  # TMA boxes: <= 256 wide
    if use_tma:
        _ensure_scratch_allocator()
    flags = dict(IS_LOCAL=params.is_local, HAS_SOFTCAP=params.has_softcap, HAS_DROPOUT=dropout_p > 0.0,
                 USE_TMA=use_tma)
    # varlen: the Gluon backward's tiles up to 128 wide (those that take ALiBi and dropout; the d256 kernel takes
    # none), dQ not in a fixed order, no dropout or ALiBi, and a row in q and in k (no tensor descriptor has zero
    # rows)
    varlen_fits = not is_varlen or (hopper.backward_takes_logit_options(head_dim) and not deterministic
                                    and dropout_p == 0.0 and alibi_slopes is None and q.shape[0] > 0
                                    and k.shape[0] > 0)
    # ALiBi and dropout: on the Gluon backward's tiles up to 128 wide (hopper.backward_takes_logit_options); softcap
    # there too (hopper.covers), not with dropout
    logit_options = alibi_slopes is not None or dropout_p > 0.0
    plain = (varlen_fits and (not logit_options or hopper.backward_takes_logit_options(head_dim))
             and not (params.has_softcap and dropout_p > 0.0))
    gluon = hopper.gluon_runs("bwd", q, params, seqlen_q, seqlen_k, plain, descriptors_ok, deterministic,
                              head_dim_v=head_dim_v)
    if gluon and is_varlen:
        _ensure_scratch_allocator()  # the kernel makes each sequence's tensor descriptors in global scratch
    gluon_dq = gluon and hopper.computes_dq(head_dim)
    dq_atomic = not gluon and config.dq_atomic and not deterministic and seqlen_q > 0
    # fp32 dQ accumulator in q's (B, S, H, D) / (T, H, D) shape, contiguous, zeroed by the preprocess
    dq_accum = new_empty(q.shape, torch.float32, q.device) if gluon_dq or dq_atomic else None
    # arguments the dK/dV and dQ kernels share (kernels/bwd.py)
    inputs = (q, k, v, dout, lse, delta)
    optional = (alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng_state)
    input_strides = (seq_strides(q), seq_strides(k), seq_strides(v), seq_strides(dout))
    # varlen: the packed rows every sequence is clamped into (kernels/bwd.py), so malformed cu_seqlens stay inside
    row_bounds = (q.shape[0], k.shape[0]) if is_varlen else (None, None)
    score_args = (params.softmax_scale, params.kernel_scores(), params.window_left, params.window_right,
                  int(params.alibi_pure_causal), dropout.kernel_dropout(dropout_p), *row_bounds)
    alibi_stride = alibi_batch_stride(alibi_slopes)
    with device_guard(q):
        preprocess_rows = max(seqlen_q, delta_rows)
        if preprocess_rows > 0:
            preprocess_grid = (triton_cdiv(preprocess_rows, config.preprocess_block) * batch * num_heads,)
            launch(
                attn_bwd_preprocess_kernel, preprocess_grid,
                out, dout, delta, dq_accum, cu_seqlens_q, (seq_strides(out), seq_strides(dout)), *delta_strides,
                seq_strides(dq_accum) if dq_accum is not None else (0, 0, 0), num_heads, seqlen_q, delta_rows,
                row_bounds[0],
                **head_dims, BLOCK_M=config.preprocess_block,
            )
        dkdv_heads_per_group = configs.heads_per_l2_group(_operand_bytes(q, seqlen_q, 2 * group_size),
                                                          batch * num_heads_k, params.causal_like)
        if gluon:
            hopper.launch_bwd(q, k, v, dout, lse, delta, dq, dk, dv, dq_accum, lse_strides, delta_strides, params,
                              seqlen_q, seqlen_k, batch, dkdv_heads_per_group, deterministic, dropout_p, rng_state,
                              cu_seqlens_q, cu_seqlens_k, alibi_slopes)
            if gluon_dq:
                return
            if hopper.dq_kernel_runs(head_dim, head_dim_v):
                hopper.launch_bwd_dq(q, k, v, dout, lse, delta, dq, lse_strides, delta_strides, params, seqlen_q,
                                     seqlen_k, batch, _dq_heads_per_group(k, seqlen_k, group_size, batch * num_heads,
                                                                          params.causal_like))
                return
        elif seqlen_k > 0:
            dkdv_grid = (triton_cdiv(seqlen_k, config.dkdv.block_n) * batch * num_heads_k,)
            launch(
                attn_bwd_dkdv_kernel, dkdv_grid,
                inputs, (dk, dv, dq_accum), optional, input_strides, *lse_strides, *delta_strides,
                (seq_strides(dk), seq_strides(dv), seq_strides(dq_accum) if dq_atomic else (0, 0, 0)), alibi_stride,
                (num_heads_k, group_size), seqlen_q, seqlen_k, dkdv_heads_per_group, *score_args,
                **head_dims, BLOCK_M=config.dkdv.block_m, BLOCK_N=config.dkdv.block_n,
                **flags, DQ_ATOMIC=dq_atomic, num_warps=config.dkdv.num_warps, num_stages=config.dkdv.num_stages,
            )
        if dq_atomic:
            torch.mul(dq_accum, params.softmax_scale, out=dq)
        elif seqlen_q > 0:
            dq_grid = (triton_cdiv(seqlen_q, config.dq.block_m) * batch * num_heads,)
            dq_heads_per_group = _dq_heads_per_group(k, seqlen_k, group_size, batch * num_heads, params.causal_like)
            launch(
                attn_bwd_dq_kernel, dq_grid,
                inputs, dq, optional, input_strides, *lse_strides, *delta_strides, seq_strides(dq),
                alibi_stride, (num_heads, group_size), seqlen_q, seqlen_k, dq_heads_per_group, *score_args,
                **head_dims, BLOCK_M=config.dq.block_m, BLOCK_N=config.dq.block_n, **flags,
                num_warps=config.dq.num_warps, num_stages=config.dq.num_stages,
            )


def _dq_heads_per_group(k, seqlen_k: int, group_size: int, batch_heads: int, causal: bool) -> int:
    """(batch, head) pairs per launch-order group of a dQ pass: K and V are what its programs share (a query
    head's share of its KV head's)."""
    return configs.heads_per_l2_group(_operand_bytes(k, seqlen_k, 2 / group_size), batch_heads, causal)


def mha_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p: float, softmax_scale: float, causal: bool,
            window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
            deterministic: bool, rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dense backward into preallocated dq, dk, dv. Returns softmax_d (B, H, R(Sq)) = rowsum(dout * out).

    With deterministic=True nothing is added in an arbitrary order (no atomics in the Triton kernels, the Gluon
    backward's dQ reductions in a fixed order): the result is bitwise reproducible.
    """
    # a repeated signature runs its call plan (ops/call_plans; not with dropout)
    return call_plans.run_planned(
        "bwd", _mha_bwd,
        (dout, q, k, v, out, softmax_lse, dq, dk, dv, rng_state, alibi_slopes) if dropout_p == 0.0 else None,
        (float(softmax_scale), bool(causal), int(window_size_left), int(window_size_right), float(softcap),
         bool(deterministic)),
        dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
        window_size_right, softcap, alibi_slopes, deterministic, rng_state)


def _mha_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p: float, softmax_scale: float, causal: bool,
             window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
             deterministic: bool, rng_state: Optional[torch.Tensor]) -> torch.Tensor:
    """mha_bwd's whole backward: checks, allocations, the launcher."""
    checks.check_bwd(dout, q, k, v, out, dq, dk, dv, dropout_p, softcap, alibi_slopes)
    dropout.require_rng_state(rng_state, dropout_p)
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    softmax_d_shape = (batch, num_heads, round_multiple(seqlen_q, 128))

    if not runs_triton(q):
        mask_shape = (batch, num_heads, round_multiple(seqlen_q, 128), round_multiple(seqlen_k, 128))
        return reference_path.dense_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                                             causal, (window_size_left, window_size_right), softcap, alibi_slopes,
                                             rng_state, mask_shape, softmax_d_shape)

    params = score_params(softmax_scale, causal, window_size_left, window_size_right, softcap, seqlen_k)
    lse = softmax_lse.contiguous()
    # delta is written straight into softmax_d (its padding rows with 0)
    softmax_d = new_empty(softmax_d_shape, torch.float32, q.device)
    launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_d, params, alibi_slopes, (lse.stride(0), lse.stride(1)),
               (softmax_d.stride(0), softmax_d.stride(1)), seqlen_q, seqlen_k, batch, dropout_p=dropout_p,
               rng_state=rng_state, deterministic=deterministic, delta_rows=softmax_d.shape[-1])
    return softmax_d


# ----------------------------------------------------------------------------------------------------------------
# Variable length
# ----------------------------------------------------------------------------------------------------------------

FILL_ROWS_BLOCK = 32  # rows per program of fill_uncovered_rows_kernel


def _zero_uncovered_rows(tensor: torch.Tensor, cu_seqlens: torch.Tensor, fill: float = 0.0, dim: int = 0) -> None:
    """Fill rows t >= cu_seqlens[-1] along `dim` with `fill`, on the device, without a host sync and without
    reading them (they are uninitialized)."""
    if tensor.numel() == 0:
        return
    # [rows, A, B] view: (T, H, D) outputs and gradients with dim 0, (H, T) LSEs with dim 1
    view = tensor.movedim(dim, 0)
    if view.dim() == 2:
        view = view.unsqueeze(-1)
    rows, num_a, num_b = view.shape
    grid = (triton_cdiv(rows, FILL_ROWS_BLOCK), num_a)
    with device_guard(tensor):
        launch(
            fill_uncovered_rows_kernel, grid,
            view, cu_seqlens, cu_seqlens.shape[0] - 1, rows, num_b, *view.stride(), float(fill),
            BLOCK_R=FILL_ROWS_BLOCK, BLOCK_B=min(128, configs.block_d(num_b)),
        )


def mha_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                   softmax_scale: float, causal: bool, window_size_left: int = -1, window_size_right: int = -1,
                   softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
                   block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
                   seqused_k: Optional[torch.Tensor] = None, zero_tensors: bool = False, num_splits: int = 0,
                   learnable_sink: Optional[torch.Tensor] = None, q_descale=None, k_descale=None, v_descale=None):
    """Varlen forward. Returns (out (Tq, H, D), softmax_lse (H, Tq), S_dmask, rng_state); see docs/api.md §7.

    Rows not covered by any sequence get out 0 and lse +inf (-inf with zero_tensors=True, as FA2; with
    learnable_sink (H,), folded in last (§4.11), learnable_sink[h] like every row without a key). The index values
    (cu_seqlens, max_seqlen, block_table, leftpad_k, seqused_k) are checked on the host for CPU tensors, and on a
    GPU only in strict mode (checks.set_strict_checks; one host synchronization per call). A repeated signature runs
    its call plan (ops/call_plans; not with dropout, nor in strict mode, whose checks read the index values).
    """
    return call_plans.run_planned(
        "varlen_fwd", _mha_varlen_fwd,
        (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, block_table, leftpad_k, seqused_k, learnable_sink,
         q_descale, k_descale, v_descale) if dropout_p == 0.0 else None,
        (int(max_seqlen_q), int(max_seqlen_k), float(softmax_scale), bool(causal), int(window_size_left),
         int(window_size_right), float(softcap), bool(return_softmax), bool(zero_tensors), int(num_splits)),
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size_left, window_size_right, softcap, alibi_slopes, return_softmax, block_table, leftpad_k, seqused_k,
        zero_tensors, num_splits, learnable_sink, q_descale, k_descale, v_descale)


def _mha_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                    window_size_left, window_size_right, softcap, alibi_slopes, return_softmax, block_table, leftpad_k,
                    seqused_k, zero_tensors, num_splits, learnable_sink, q_descale, k_descale, v_descale):
    """mha_varlen_fwd's whole forward: checks, allocations, the launcher."""
    batch = checks.check_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softcap, alibi_slopes,
                                    return_softmax, block_table, leftpad_k, seqused_k, num_splits)
    checks.check_learnable_sink(learnable_sink, q, q.shape[1])
    descales = (q_descale, k_descale, v_descale)
    fp8 = checks.check_fp8(q, descales, batch, k.shape[-2], dropout_p)
    total_q, num_heads, head_dim = q.shape
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    checks.check_varlen_index_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                                     leftpad_k, seqused_k)
    q, k, v = (t if checks.has_contiguous_last_dim(t) else t.contiguous() for t in (q, k, v))
    window = (window_size_left, window_size_right)
    use_kernels = runs_triton(q)
    rng_state = dropout.new_rng_state(q.device) if dropout_p > 0.0 else torch.zeros(2, dtype=torch.int64,
                                                                                   device=q.device)
    mask_shape = (batch, num_heads, round_multiple(max_seqlen_q, 128), round_multiple(max_seqlen_k, 128))
    keep = None
    if dropout_p > 0.0 and (return_softmax or not use_kernels):
        keep = dropout.keep_mask(rng_state, *mask_shape, dropout_p, use_kernels)
    s_dmask = torch.empty(0, dtype=q.dtype, device=q.device)
    if return_softmax:
        s_dmask = dropout.varlen_s_dmask(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale, causal,
                                         window, softcap, alibi_slopes, keep, mask_shape, learnable_sink)

    if not use_kernels:
        out, lse = reference_path.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale,
                                                 causal, window, softcap, alibi_slopes, block_table, leftpad_k,
                                                 seqused_k, dropout_p, keep, descales if fp8 else None)
        if zero_tensors:  # as the kernel path fills them below (CPU tensors: reading cu_seqlens_q costs nothing)
            lse[:, int(cu_seqlens_q[-1]):] = float("-inf")
        if learnable_sink is not None:
            sink.fold_sink(out[None], lse[None], learnable_sink, runs_kernels=False)
        return out, lse, s_dmask, rng_state

    params = score_params(softmax_scale, causal, window_size_left, window_size_right, softcap, max_seqlen_k)
    out = new_empty((total_q, num_heads, v.shape[-1]), torch.bfloat16 if fp8 else q.dtype, q.device)
    lse = new_empty((num_heads, total_q), torch.float32, q.device)
    launch_fwd(q, k, v, out, lse, params, alibi_slopes, (0, lse.stride(0)), max_seqlen_q, max_seqlen_k, batch,
               cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, dropout_p=dropout_p,
               rng_state=rng_state, descales=descales if fp8 else None)
    _zero_uncovered_rows(out, cu_seqlens_q)
    _zero_uncovered_rows(lse, cu_seqlens_q, float("-inf") if zero_tensors else float("inf"), dim=1)
    if learnable_sink is not None:
        sink.fold_sink(out[None], lse[None], learnable_sink, runs_kernels=True)
    return out, lse, s_dmask, rng_state


def mha_varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                   max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
                   window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                   rng_state: Optional[torch.Tensor] = None, zero_tensors: bool = False) -> torch.Tensor:
    """Varlen backward into preallocated dq, dk, dv; returns softmax_d (H, Tq + 128 * B).

    Gradient rows not covered by any sequence are written as 0. A repeated signature runs its call plan
    (ops/call_plans; not with dropout).
    """
    return call_plans.run_planned(
        "varlen_bwd", _mha_varlen_bwd,
        (dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state)
        if dropout_p == 0.0 else None,
        (int(max_seqlen_q), int(max_seqlen_k), float(softmax_scale), bool(causal), int(window_size_left),
         int(window_size_right), float(softcap), bool(deterministic), bool(zero_tensors)),
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state,
        zero_tensors)


def _mha_varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                    alibi_slopes, deterministic, rng_state, zero_tensors):
    """mha_varlen_bwd's whole backward: checks, allocations, the launcher."""
    batch = checks.check_varlen_bwd(dout, q, k, v, out, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, dropout_p, softcap,
                                    alibi_slopes)
    dropout.require_rng_state(rng_state, dropout_p)
    total_q, num_heads, _ = q.shape
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    checks.check_varlen_index_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    softmax_d = torch.zeros(num_heads, total_q + 128 * batch, dtype=torch.float32, device=q.device)

    if not runs_triton(q):
        mask_shape = (batch, num_heads, round_multiple(max_seqlen_q, 128), round_multiple(max_seqlen_k, 128))
        return reference_path.varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                              max_seqlen_k, dropout_p, softmax_scale, causal,
                                              (window_size_left, window_size_right), softcap, alibi_slopes,
                                              rng_state, mask_shape, softmax_d)

    params = score_params(softmax_scale, causal, window_size_left, window_size_right, softcap, max_seqlen_k)
    lse = softmax_lse.contiguous()
    # delta is written straight into softmax_d's covered rows (the rest stays 0)
    launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_d, params, alibi_slopes, (0, lse.stride(0)),
               (0, softmax_d.stride(0)), max_seqlen_q, max_seqlen_k, batch, cu_seqlens_q, cu_seqlens_k,
               dropout_p=dropout_p, rng_state=rng_state, deterministic=deterministic)
    for grad, cu in ((dq, cu_seqlens_q), (dk, cu_seqlens_k), (dv, cu_seqlens_k)):
        _zero_uncovered_rows(grad, cu)
    return softmax_d

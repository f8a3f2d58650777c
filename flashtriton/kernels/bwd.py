"""Backward: preprocess (delta = rowsum(dO * O)), dK/dV per key tile, dQ per query tile.

By default every output element is written by exactly one program, so gradients are bitwise
reproducible. DQ_ATOMIC (configs that ask for it, never with deterministic=True): the dK/dV program also
adds each key tile's share of dQ (dS K, unscaled, fp32) into DQAccum with atomics, and the dQ kernel does
not run; the launcher scales and converts DQAccum. GQA reduces dK/dV over the query heads of a
group inside the dK/dV program. P is recomputed from the saved natural-log LSE (+inf rows give
P = 0). With softcap, dS is multiplied by 1 - tanh^2 before the scale (docs/api.md §4.10).
USE_TMA (the sm90 configs): the Q and dO tiles of the dK/dV kernel and the K and V tiles of the dQ kernel
come through in-kernel tensor descriptors over one sequence's rows of every head
(common.head_rows_descriptor); rows past the sequence read as zeros.

Grouped arguments of the dK/dV and dQ kernels (tuples flatten, in order, into the compiled kernel's parameter list,
and the generated code depends on that order):
  inputs       (Q, K, V, DOut, Lse, Delta): Q, K (and DQ, DK) HEAD_DIM wide, V, DOut (and DV) HEAD_DIM_V
  outputs      (dK/dV kernel): (DK, DV, DQAccum)
  optional     (AlibiSlopes, CuSeqlensQ, CuSeqlensK, RngState), each None where the call has none
  strides      (batch, row, head) strides of Q, K, V and DOut; grad_strides / dq_strides: those of the gradients
  head_counts  (query heads or KV heads, group_size): the heads the kernel's grid runs over, and query heads per KV head
  scores       ScoreParams.kernel_scores: (qk_scale_log2, softcap_in_scale, softcap_out_log2)
  dropout      (keep_threshold, dropout_scale)
  q_rows, k_rows  varlen: Q's and K's total rows, which every sequence is clamped into (common.sequence_bounds), so
               malformed cu_seqlens make sequences shorter or empty and never reach outside the tensors; dense: None
The Lse / Delta strides, sequence lengths, heads_per_group, window and row bounds are plain unspecialized arguments:
new values reuse the compiled kernel.
"""

import triton
import triton.language as tl

from .common import (alibi_bias_log2, dropout_keep, grouped_tile_and_batch_head, head_rows_descriptor,
                     kv_block_range, load_head_rows, mma, narrow, q_block_range, row_offsets, scores_log2,
                     sequence_bounds, tanh, tile_and_batch_head, to_int64, visibility_mask)


@triton.jit(do_not_specialize=["stride_delta_b", "stride_delta_h", "seqlen_q", "delta_rows", "q_rows"])
def attn_bwd_preprocess_kernel(
    Out, DOut, Delta, DQAccum, CuSeqlensQ, strides, stride_delta_b, stride_delta_h, dqa_strides, num_heads, seqlen_q,
    delta_rows, q_rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """delta = rowsum(dO * O) of each query row (HEAD_DIM_V wide) into Delta, and 0 into its rows [seqlen_q, delta_rows) (the
    padding of a dense softmax_d; varlen passes 0); where DQAccum is given, zeros into the rows' fp32 dQ
    accumulator (HEAD_DIM wide; the dQ atomics / reductions add into it), which saves a separate fill of it.
    strides: (batch, row, head) strides of Out and DOut; dqa_strides: DQAccum's. CuSeqlensQ None: dense layout;
    q_rows: the packed rows sequences are clamped into (None: dense)."""
    o_strides, do_strides = strides
    stride_ob, stride_om, stride_oh = o_strides
    stride_dob, stride_dom, stride_doh = do_strides
    stride_dqa_b, stride_dqa_m, stride_dqa_h = dqa_strides
    m_block, batch_head = tile_and_batch_head(tl.cdiv(tl.maximum(seqlen_q, delta_rows), BLOCK_M))
    batch = batch_head // num_heads
    head = batch_head % num_heads
    q_start, seqlen_q, _, _ = sequence_bounds(batch, CuSeqlensQ, CuSeqlensQ, None, None, seqlen_q, seqlen_q, q_rows,
                                              None)
    rows_end = tl.maximum(seqlen_q, delta_rows)
    m_start = m_block * BLOCK_M
    if m_start >= rows_end:
        return
    offs_row = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = (q_start + m_start).to(tl.int64)
    row_in = (m_start + offs_row) < seqlen_q
    mask = row_in[:, None] & (offs_d < HEAD_DIM)[None, :]
    mask_v = row_in[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
    # [BLOCK_M, BLOCK_DV]; rows past seqlen_q read 0, so their delta is 0
    o = tl.load(Out + batch.to(tl.int64) * stride_ob + rows * stride_om + head * stride_oh
                + offs_row[:, None] * stride_om + offs_dv[None, :], mask=mask_v, other=0.0)
    do = tl.load(DOut + batch.to(tl.int64) * stride_dob + rows * stride_dom + head * stride_doh
                 + offs_row[:, None] * stride_dom + offs_dv[None, :], mask=mask_v, other=0.0)
    # [BLOCK_M]
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    delta_base = Delta + batch.to(tl.int64) * stride_delta_b + head.to(tl.int64) * stride_delta_h + q_start + m_start
    tl.store(delta_base + offs_row, delta, mask=(m_start + offs_row) < rows_end)
    if DQAccum is not None:
        # [BLOCK_M, BLOCK_D]
        tl.store(DQAccum + batch.to(tl.int64) * stride_dqa_b + rows * stride_dqa_m + head.to(tl.int64) * stride_dqa_h
                 + offs_row[:, None] * stride_dqa_m + offs_d[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                 mask=mask)


@triton.jit
def _dkdv_q_loop(dk, dv, k, v, n_start, m_block_lo, m_block_hi, head_rows, row_strides, q_desc, do_desc, dqa_base,
                 visibility, scores, alibi, rng_state, stream, dropout, MASKED: tl.constexpr, IS_LOCAL: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
                 DQ_ATOMIC: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Accumulate query blocks [m_block_lo, m_block_hi) of one head into the (dk, dv) of keys n_start + [0, BLOCK_N).

    head_rows: (q_base, do_base, lse_base, delta_base, head), where the head's rows start in Q and dO (pointer
    loads), Lse and Delta, and the head's index in q_desc / do_desc (USE_TMA's loads); row_strides: (stride_qm,
    stride_dom, stride_dqa_m); dqa_base: the head's rows of the fp32 dQ accumulator that DQ_ATOMIC adds each query
    block's dS K into (unscaled); alibi: (slope in log2 units, alibi_pure_causal); dropout: the kernel's
    (keep_threshold, dropout_scale), drawn from rng_state in the head's Philox stream."""
    q_base, do_base, lse_base, delta_base, head = head_rows
    stride_qm, stride_dom, stride_dqa_m = row_strides
    seqlen_q, seqlen_k, _, _ = visibility
    _, softcap_in_scale, _ = scores
    slope_log2, alibi_pure_causal = alibi
    keep_threshold, dropout_scale = dropout
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_row = tl.arange(0, BLOCK_M)
    d_in = offs_d < HEAD_DIM
    dv_in = offs_dv < HEAD_DIM_V
    for m_block in range(m_block_lo, m_block_hi):
        m_start = m_block * BLOCK_M
        offs_m = m_start + offs_row
        row_in = offs_m < seqlen_q
        if USE_TMA:
            # [BLOCK_D, BLOCK_M], [BLOCK_M, BLOCK_DV]
            q_t = tl.trans(load_head_rows(q_desc, head, m_start, BLOCK_M, BLOCK_D))
            do = load_head_rows(do_desc, head, m_start, BLOCK_M, BLOCK_DV)
        else:
            q_offs = row_offsets(m_start, offs_row, seqlen_q, stride_qm, None, 1, 0, False)
            do_offs = row_offsets(m_start, offs_row, seqlen_q, stride_dom, None, 1, 0, False)
            # [BLOCK_D, BLOCK_M]
            q_t = tl.load(q_base + q_offs[None, :] + offs_d[:, None], mask=row_in[None, :] & d_in[:, None], other=0.0)
            # [BLOCK_M, BLOCK_DV]
            do = tl.load(do_base + do_offs[:, None] + offs_dv[None, :], mask=row_in[:, None] & dv_in[None, :],
                         other=0.0)
        # [BLOCK_M]; padded rows get lse = +inf, hence P = 0
        lse_log2 = tl.load(lse_base + offs_m, mask=row_in, other=float("inf")) * 1.4426950408889634
        delta = tl.load(delta_base + offs_m, mask=row_in, other=0.0)
        # [BLOCK_N, BLOCK_M] transposed scores
        qk_t = mma(k, q_t)
        s_t = scores_log2(qk_t, scores, HAS_SOFTCAP)
        if HAS_ALIBI:
            s_t += tl.trans(alibi_bias_log2(slope_log2, offs_m, offs_n, visibility, alibi_pure_causal))
        p_t = tl.exp2(s_t - lse_log2[None, :])
        if MASKED:
            p_t = tl.where(tl.trans(visibility_mask(offs_m, offs_n, visibility, IS_LOCAL)), p_t, 0.0)
        # [BLOCK_N, BLOCK_M]
        dp_t = mma(v, tl.trans(do))
        if HAS_DROPOUT:
            keep_t = tl.trans(dropout_keep(rng_state, stream, offs_m, n_start, keep_threshold, BLOCK_N))
            dv = mma(narrow(tl.where(keep_t, p_t, 0.0) * dropout_scale, do.dtype), do, dv)
            dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
        else:
            dv = mma(narrow(p_t, do.dtype), do, dv)
        ds_t = p_t * (dp_t - delta[None, :])
        if HAS_SOFTCAP:
            cap_t = tanh(qk_t * softcap_in_scale)
            ds_t = ds_t * (1.0 - cap_t * cap_t)
        dk = mma(narrow(ds_t, q_t.dtype), tl.trans(q_t), dk)
        if DQ_ATOMIC:
            # Unmasked blocks leave keys past seqlen_k unmasked (their dK/dV rows are never stored); their dS
            # must not reach dQ, where exp2(0 - lse) may be inf and k's row is 0.
            ds_t = tl.where((offs_n < seqlen_k)[:, None], ds_t, 0.0)
            # [BLOCK_M, BLOCK_D] this key tile's part of the query block's dQ (unscaled)
            dq_part = mma(tl.trans(narrow(ds_t, k.dtype)), k)
            tl.atomic_add(dqa_base + offs_m.to(tl.int64)[:, None] * stride_dqa_m + offs_d[None, :], dq_part,
                          mask=row_in[:, None] & d_in[None, :], sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["stride_lse_b", "stride_lse_h", "stride_delta_b", "stride_delta_h", "seqlen_q",
                               "seqlen_k", "heads_per_group", "window_left", "window_right", "q_rows", "k_rows"])
def attn_bwd_dkdv_kernel(
    inputs, outputs, optional, strides, stride_lse_b, stride_lse_h, stride_delta_b, stride_delta_h, grad_strides, stride_alibi_b, head_counts, seqlen_q, seqlen_k, heads_per_group, softmax_scale,
    scores, window_left, window_right, alibi_pure_causal, dropout, q_rows, k_rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, DQ_ATOMIC: tl.constexpr,
):
    """One program per (key tile, batch * kv head); loops over the group's query heads and query tiles.

    grad_strides: those of DK, DV and DQAccum; head_counts: (num_heads_k, group_size). Lse and Delta: (batch,
    head) strides of their own, rows contiguous. USE_TMA loads the Q and dO tiles through in-kernel descriptors
    bound to the sequence (rows past it read as zeros). Key tiles run in order, so under a causal mask the tiles
    seen by the most query rows start first; programs run in groups of heads_per_group (batch, kv head) pairs
    (grouped_tile_and_batch_head).
    """
    Q, K, V, DOut, Lse, Delta = inputs
    DK, DV, DQAccum = outputs
    AlibiSlopes, CuSeqlensQ, CuSeqlensK, RngState = optional
    q_strides, k_strides, v_strides, do_strides = strides
    stride_qb, stride_qm, stride_qh = q_strides
    stride_kb, stride_kn, stride_kh = k_strides
    stride_vb, stride_vn, stride_vh = v_strides
    stride_dob, stride_dom, stride_doh = do_strides
    dk_strides, dv_strides, dqa_strides = grad_strides
    stride_dkb, stride_dkn, stride_dkh = dk_strides
    stride_dvb, stride_dvn, stride_dvh = dv_strides
    stride_dqa_b, stride_dqa_m, stride_dqa_h = dqa_strides
    num_heads_k, group_size = head_counts
    HAS_ALIBI: tl.constexpr = AlibiSlopes is not None

    n_block, batch_head = grouped_tile_and_batch_head(tl.cdiv(seqlen_k, BLOCK_N), heads_per_group)
    batch = batch_head // num_heads_k
    head_k = batch_head % num_heads_k
    q_start, seqlen_q, k_start, seqlen_k = sequence_bounds(batch, CuSeqlensQ, CuSeqlensK, None, None, seqlen_q,
                                                           seqlen_k, q_rows, k_rows)
    visibility = (seqlen_q, seqlen_k, window_left, window_right)
    n_start = n_block * BLOCK_N
    if n_start >= seqlen_k:
        return
    batch64 = batch.to(tl.int64)
    rows_k = (k_start + n_start).to(tl.int64)
    offs_col = tl.arange(0, BLOCK_N)
    offs_n = n_start + offs_col
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_in = offs_n < seqlen_k
    d_in = offs_d < HEAD_DIM
    kv_mask = key_in[:, None] & d_in[None, :]
    v_mask = key_in[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
    # [BLOCK_N, BLOCK_D], [BLOCK_N, BLOCK_DV]
    k = tl.load(K + batch64 * stride_kb + rows_k * stride_kn + head_k.to(tl.int64) * stride_kh
                + offs_col[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + batch64 * stride_vb + rows_k * stride_vn + head_k.to(tl.int64) * stride_vh
                + offs_col[:, None] * stride_vn + offs_dv[None, :], mask=v_mask, other=0.0)
    # [BLOCK_N, BLOCK_D], [BLOCK_N, BLOCK_DV] fp32 accumulators, summed over the group's query heads
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    m_blocks = q_block_range(n_start, visibility, BLOCK_M, BLOCK_N, IS_LOCAL)
    q_desc = None
    do_desc = None
    if USE_TMA:
        num_heads = num_heads_k * group_size
        q_desc = head_rows_descriptor(Q + batch64 * stride_qb + to_int64(q_start) * stride_qm, num_heads, seqlen_q,
                                      stride_qh, stride_qm, HEAD_DIM, BLOCK_M, BLOCK_D)
        do_desc = head_rows_descriptor(DOut + batch64 * stride_dob + to_int64(q_start) * stride_dom, num_heads,
                                       seqlen_q, stride_doh, stride_dom, HEAD_DIM_V, BLOCK_M, BLOCK_DV)
    for group_member in range(group_size):
        head = head_k * group_size + group_member
        head64 = head.to(tl.int64)
        q_base = Q + batch64 * stride_qb + to_int64(q_start) * stride_qm + head64 * stride_qh
        do_base = DOut + batch64 * stride_dob + to_int64(q_start) * stride_dom + head64 * stride_doh
        lse_base = Lse + batch64 * stride_lse_b + head64 * stride_lse_h + q_start
        delta_base = Delta + batch64 * stride_delta_b + head64 * stride_delta_h + q_start
        dqa_base = DQAccum
        if DQ_ATOMIC:
            dqa_base = DQAccum + batch64 * stride_dqa_b + to_int64(q_start) * stride_dqa_m + head64 * stride_dqa_h
        slope_log2 = 0.0
        if HAS_ALIBI:
            slope_log2 = tl.load(AlibiSlopes + batch * stride_alibi_b + head) * 1.4426950408889634
        for part in tl.static_range(3):
            # part 0 and 2: the masked edges [m_block_min, m_full_min) and [m_full_max, m_block_max);
            # part 1: the query blocks that see the whole key tile, [m_full_min, m_full_max), without a mask
            dk, dv = _dkdv_q_loop(
                dk, dv, k, v, n_start, m_blocks[part], m_blocks[part + 1],
                (q_base, do_base, lse_base, delta_base, head), (stride_qm, stride_dom, stride_dqa_m), q_desc, do_desc,
                dqa_base, visibility, scores, (slope_log2, alibi_pure_causal), RngState,
                batch * num_heads_k * group_size + head, dropout, MASKED=part != 1, IS_LOCAL=IS_LOCAL, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI,
                HAS_DROPOUT=HAS_DROPOUT, USE_TMA=USE_TMA, DQ_ATOMIC=DQ_ATOMIC, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HEAD_DIM_V=HEAD_DIM_V, BLOCK_DV=BLOCK_DV)

    dk = dk * softmax_scale
    tl.store(DK + batch64 * stride_dkb + rows_k * stride_dkn + head_k.to(tl.int64) * stride_dkh
             + offs_col[:, None] * stride_dkn + offs_d[None, :], narrow(dk, DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + batch64 * stride_dvb + rows_k * stride_dvn + head_k.to(tl.int64) * stride_dvh
             + offs_col[:, None] * stride_dvn + offs_dv[None, :], narrow(dv, DV.dtype.element_ty), mask=v_mask)


@triton.jit
def _dq_kv_loop(dq, q, do, lse_log2, delta, offs_m, n_block_lo, n_block_hi, kv, k_desc, v_desc, visibility, scores,
                alibi, rng_state, stream, dropout, MASKED: tl.constexpr, IS_LOCAL: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_DV: tl.constexpr):
    """Accumulate key blocks [n_block_lo, n_block_hi) into the query tile's dq (unscaled).

    kv: (k_base, v_base, stride_kn, stride_vn, head_k), where the KV head's rows start in K and V (pointer loads),
    their row strides and the head's index in k_desc / v_desc (USE_TMA's loads); alibi: (slope in log2 units,
    alibi_pure_causal); dropout: the kernel's (keep_threshold, dropout_scale), drawn from rng_state in the query head's
    Philox stream.
    """
    k_base, v_base, stride_kn, stride_vn, head_k = kv
    _, seqlen_k, _, _ = visibility
    _, softcap_in_scale, _ = scores
    slope_log2, alibi_pure_causal = alibi
    keep_threshold, dropout_scale = dropout
    offs_col = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_in = offs_d < HEAD_DIM
    dv_in = offs_dv < HEAD_DIM_V
    for n_block in range(n_block_lo, n_block_hi):
        n_start = n_block * BLOCK_N
        offs_n = n_start + offs_col
        if USE_TMA:
            # [BLOCK_D, BLOCK_N], [BLOCK_DV, BLOCK_N]
            k_t = tl.trans(load_head_rows(k_desc, head_k, n_start, BLOCK_N, BLOCK_D))
            v_t = tl.trans(load_head_rows(v_desc, head_k, n_start, BLOCK_N, BLOCK_DV))
        else:
            key_in = offs_n < seqlen_k
            k_offs = row_offsets(n_start, offs_col, seqlen_k, stride_kn, None, 1, 0, False)
            v_offs = row_offsets(n_start, offs_col, seqlen_k, stride_vn, None, 1, 0, False)
            # [BLOCK_D, BLOCK_N], [BLOCK_DV, BLOCK_N]
            k_t = tl.load(k_base + k_offs[None, :] + offs_d[:, None], mask=key_in[None, :] & d_in[:, None], other=0.0)
            v_t = tl.load(v_base + v_offs[None, :] + offs_dv[:, None], mask=key_in[None, :] & dv_in[:, None],
                          other=0.0)
        # [BLOCK_M, BLOCK_N]
        qk = mma(q, k_t)
        s = scores_log2(qk, scores, HAS_SOFTCAP)
        if HAS_ALIBI:
            s += alibi_bias_log2(slope_log2, offs_m, offs_n, visibility, alibi_pure_causal)
        p = tl.exp2(s - lse_log2[:, None])
        if MASKED:
            p = tl.where(visibility_mask(offs_m, offs_n, visibility, IS_LOCAL), p, 0.0)
        dp = mma(do, v_t)
        if HAS_DROPOUT:
            keep = dropout_keep(rng_state, stream, offs_m, n_start, keep_threshold, BLOCK_N)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            cap = tanh(qk * softcap_in_scale)
            ds = ds * (1.0 - cap * cap)
        dq = mma(narrow(ds, k_t.dtype), tl.trans(k_t), dq)
    return dq


@triton.jit(do_not_specialize=["stride_lse_b", "stride_lse_h", "stride_delta_b", "stride_delta_h", "seqlen_q",
                               "seqlen_k", "heads_per_group", "window_left", "window_right", "q_rows", "k_rows"])
def attn_bwd_dq_kernel(
    inputs, DQ, optional, strides, stride_lse_b, stride_lse_h, stride_delta_b, stride_delta_h, dq_strides,
    stride_alibi_b, head_counts, seqlen_q, seqlen_k, heads_per_group, softmax_scale, scores, window_left,
    window_right, alibi_pure_causal, dropout, q_rows, k_rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
):
    """One program per (query tile, batch * head); loops over the visible key tiles (USE_TMA: loaded
    through in-kernel descriptors bound to the sequence). head_counts: (num_heads, group_size). Query tiles run in
    reverse order, so under a causal mask the longest rows start first; programs run in groups of heads_per_group
    (batch, head) pairs (grouped_tile_and_batch_head)."""
    Q, K, V, DOut, Lse, Delta = inputs
    AlibiSlopes, CuSeqlensQ, CuSeqlensK, RngState = optional
    q_strides, k_strides, v_strides, do_strides = strides
    stride_qb, stride_qm, stride_qh = q_strides
    stride_kb, stride_kn, stride_kh = k_strides
    stride_vb, stride_vn, stride_vh = v_strides
    stride_dob, stride_dom, stride_doh = do_strides
    stride_dqb, stride_dqm, stride_dqh = dq_strides
    num_heads, group_size = head_counts
    HAS_ALIBI: tl.constexpr = AlibiSlopes is not None

    num_tiles = tl.cdiv(seqlen_q, BLOCK_M)
    tile, batch_head = grouped_tile_and_batch_head(num_tiles, heads_per_group)
    m_block = num_tiles - 1 - tile
    batch = batch_head // num_heads
    head = batch_head % num_heads
    head_k = head // group_size
    q_start, seqlen_q, k_start, seqlen_k = sequence_bounds(batch, CuSeqlensQ, CuSeqlensK, None, None, seqlen_q,
                                                           seqlen_k, q_rows, k_rows)
    visibility = (seqlen_q, seqlen_k, window_left, window_right)
    m_start = m_block * BLOCK_M
    if m_start >= seqlen_q:
        return
    batch64 = batch.to(tl.int64)
    head64 = head.to(tl.int64)
    rows_q = (q_start + m_start).to(tl.int64)
    offs_row = tl.arange(0, BLOCK_M)
    offs_m = m_start + offs_row
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_in = offs_m < seqlen_q
    q_mask = row_in[:, None] & (offs_d < HEAD_DIM)[None, :]
    # [BLOCK_M, BLOCK_D], [BLOCK_M, BLOCK_DV]
    q = tl.load(Q + batch64 * stride_qb + rows_q * stride_qm + head64 * stride_qh
                + offs_row[:, None] * stride_qm + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DOut + batch64 * stride_dob + rows_q * stride_dom + head64 * stride_doh
                 + offs_row[:, None] * stride_dom + offs_dv[None, :],
                 mask=row_in[:, None] & (offs_dv < HEAD_DIM_V)[None, :], other=0.0)
    # [BLOCK_M]
    lse_log2 = tl.load(Lse + batch64 * stride_lse_b + head64 * stride_lse_h + q_start + offs_m,
                       mask=row_in, other=float("inf")) * 1.4426950408889634
    delta = tl.load(Delta + batch64 * stride_delta_b + head64 * stride_delta_h + q_start + offs_m, mask=row_in,
                    other=0.0)
    slope_log2 = 0.0
    if HAS_ALIBI:
        slope_log2 = tl.load(AlibiSlopes + batch * stride_alibi_b + head) * 1.4426950408889634
    k_base = K + batch64 * stride_kb + to_int64(k_start) * stride_kn + head_k.to(tl.int64) * stride_kh
    v_base = V + batch64 * stride_vb + to_int64(k_start) * stride_vn + head_k.to(tl.int64) * stride_vh
    k_desc = None
    v_desc = None
    if USE_TMA:
        num_heads_k = num_heads // group_size
        k_desc = head_rows_descriptor(K + batch64 * stride_kb + to_int64(k_start) * stride_kn, num_heads_k, seqlen_k,
                                      stride_kh, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D)
        v_desc = head_rows_descriptor(V + batch64 * stride_vb + to_int64(k_start) * stride_vn, num_heads_k, seqlen_k,
                                      stride_vh, stride_vn, HEAD_DIM_V, BLOCK_N, BLOCK_DV)
    # [BLOCK_M, BLOCK_D]
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    n_blocks = kv_block_range(m_start, visibility, BLOCK_M, BLOCK_N, IS_LOCAL)
    for part in tl.static_range(3):
        # part 0 and 2: the masked edges [n_block_min, n_full_min) and [n_full_max, n_block_max);
        # part 1: the blocks every row sees whole, [n_full_min, n_full_max), without a mask
        dq = _dq_kv_loop(dq, q, do, lse_log2, delta, offs_m, n_blocks[part], n_blocks[part + 1],
                         (k_base, v_base, stride_kn, stride_vn, head_k), k_desc, v_desc, visibility, scores,
                         (slope_log2, alibi_pure_causal), RngState, batch_head, dropout, MASKED=part != 1,
                         IS_LOCAL=IS_LOCAL, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI, HAS_DROPOUT=HAS_DROPOUT,
                         USE_TMA=USE_TMA, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HEAD_DIM_V=HEAD_DIM_V,
                         BLOCK_DV=BLOCK_DV)
    dq = dq * softmax_scale
    tl.store(DQ + batch64 * stride_dqb + rows_q * stride_dqm + head64 * stride_dqh
             + offs_row[:, None] * stride_dqm + offs_d[None, :], narrow(dq, DQ.dtype.element_ty), mask=q_mask)

"""Prefill forward: one program per (query tile, batch * head), online softmax in the log2 domain.

Numerics (docs/api.md §4.10): fp32 scores and accumulators, P rounded to V's dtype before P.V,
natural-log LSE out (+inf for rows that see no key). The running max lags by up to
RESCALE_THRESHOLD (log2 units) so most tiles skip the O / row-sum rescale; P then stays below
2**RESCALE_THRESHOLD, and the result is exact because O, the row sum and P share one base.

Variants (constexpr): TMA_MODE loads Q/K/V and stores O through 4-D tensor descriptors, built on the host
over whole (B, S, H, D) tensors (TMA_HOST: dense layouts, tiles addressed by batch, row and head) or in the
kernel over one sequence of one head (TMA_DEVICE: kv-cache, split-KV; tiles addressed by row). Either way
rows past a sequence are out of bounds: they read as zeros and are never stored. TMA_PACKED (varlen) loads
Q/K/V through host descriptors over the packed (1, total, H, D) tensors, tiles addressed by the sequence's
first row plus the tile's; rows past a sequence there belong to the next one, so they are zeroed (Q rows;
V rows in the masked key blocks, the only ones that reach past seqlen_k, so 0 * NaN cannot leak in), their
scores are masked, and O is stored by pointer. FOLD_SCALE
(no softcap, no ALiBi, positive scale) keeps raw q.k and folds the scale into the exp2 FMA;
PACK_GQA (decoding with GQA) puts the query heads that share a KV head into one tile, so each
K/V tile is read once per KV head instead of once per query head.
"""

import triton
import triton.language as tl

from .common import (alibi_bias_log2, dropout_keep, grouped_tile_and_batch_head, kv_block_range, mma,
                     narrow, paged_row_offsets, pages_in_pool, pv_product, row_offsets, scores_log2, sequence_bounds,
                     split_kv_block_range, to_int64, visibility_mask)

# TMA_MODE values
TMA_OFF = tl.constexpr(0)
TMA_HOST = tl.constexpr(1)
TMA_DEVICE = tl.constexpr(2)
TMA_PACKED = tl.constexpr(3)


@triton.jit
def _fwd_kv_loop(acc, l_i, m_i, q, offs_m, n_block_lo, n_block_hi, kv, k_desc, v_desc, block_table_row, pages,
                 visibility, scores, alibi, rng_state, stream, dropout, MASKED: tl.constexpr, IS_LOCAL: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                 FOLD_SCALE: tl.constexpr, RESCALE_THRESHOLD: tl.constexpr, TMA_MODE: tl.constexpr,
                 TILE_IN_PAGE: tl.constexpr, CHECK_PAGES: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Accumulate key blocks [n_block_lo, n_block_hi) into (acc, l_i, m_i); MASKED applies visibility_mask.

    kv: where this program's KV head is, (k_base, v_base, stride_kn, stride_vn) for pointer loads and the
    (batch, first row, head) coordinates of its tiles in k_desc / v_desc (TMA_MODE); block_table_row: the batch
    row's pages, None where K/V are not paged; pages: (page_size, stride_kpage, stride_vpage, num_pages); with
    CHECK_PAGES, keys on a page outside [0, num_pages) are masked (paged_row_offsets);
    alibi: ([BLOCK_M, 1] slopes in log2 units, alibi_pure_causal); dropout: the kernel's (keep_threshold,
    dropout_scale), drawn from rng_state in the rows' Philox streams. FP8 (e4m3) K and V: the P.V product takes P and
    V in fp16 (common.pv_product).
    """
    k_base, v_base, stride_kn, stride_vn, desc_kv_batch, desc_k_row0, desc_head_k = kv
    page_size, stride_kpage, stride_vpage, num_pages = pages
    _, seqlen_k, _, _ = visibility
    qk_scale_log2, _, _ = scores
    slope_log2, alibi_pure_causal = alibi
    keep_threshold, _ = dropout
    IS_PAGED: tl.constexpr = block_table_row is not None
    offs_col = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_in = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_in = offs_dv < HEAD_DIM_V
    for n_block in range(n_block_lo, n_block_hi):
        n_start = n_block * BLOCK_N
        offs_n = n_start + offs_col
        if TMA_MODE != TMA_OFF:
            # [BLOCK_D, BLOCK_N], [BLOCK_N, BLOCK_DV]
            k_t = tl.trans(k_desc.load([desc_kv_batch, desc_k_row0 + n_start, desc_head_k, 0]).reshape(BLOCK_N,
                                                                                                        BLOCK_D))
            v = v_desc.load([desc_kv_batch, desc_k_row0 + n_start, desc_head_k, 0]).reshape(BLOCK_N, BLOCK_DV)
            if TMA_MODE == TMA_PACKED and MASKED:
                v = tl.where((offs_n < seqlen_k)[:, None], v, 0.0)
        else:
            key_in = offs_n < seqlen_k
            value_in = key_in
            if CHECK_PAGES:
                k_offs, page_ok = paged_row_offsets(n_start, offs_col, seqlen_k, stride_kn, block_table_row,
                                                    page_size, stride_kpage, num_pages, TILE_IN_PAGE)
                v_offs, v_page_ok = paged_row_offsets(n_start, offs_col, seqlen_k, stride_vn, block_table_row,
                                                      page_size, stride_vpage, num_pages, TILE_IN_PAGE)
                # keys of a page outside the pool score -inf below; their values read as 0, so a replaced page's
                # contents (NaN in unused cache slots) cannot reach the output through 0 * NaN
                value_in = key_in & v_page_ok
            else:
                k_offs = row_offsets(n_start, offs_col, seqlen_k, stride_kn, block_table_row, page_size,
                                     stride_kpage, IS_PAGED, TILE_IN_PAGE)
                v_offs = row_offsets(n_start, offs_col, seqlen_k, stride_vn, block_table_row, page_size,
                                     stride_vpage, IS_PAGED, TILE_IN_PAGE)
            # [BLOCK_D, BLOCK_N]
            k_t = tl.load(k_base + k_offs[None, :] + offs_d[:, None], mask=key_in[None, :] & d_in[:, None], other=0.0)
            # [BLOCK_N, BLOCK_DV]
            v = tl.load(v_base + v_offs[:, None] + offs_dv[None, :], mask=value_in[:, None] & dv_in[None, :],
                        other=0.0)
        # [BLOCK_M, BLOCK_N]: raw q.k when FOLD_SCALE (the scale joins the exp2 FMA), else log2-domain logits
        s = mma(q, k_t)
        if not FOLD_SCALE:
            s = scores_log2(s, scores, HAS_SOFTCAP)
            if HAS_ALIBI:
                s += alibi_bias_log2(slope_log2, offs_m, offs_n, visibility, alibi_pure_causal)
        if MASKED:
            s = tl.where(visibility_mask(offs_m, offs_n, visibility, IS_LOCAL), s, float("-inf"))
        if CHECK_PAGES and TILE_IN_PAGE:
            s = tl.where(page_ok, s, float("-inf"))
        elif CHECK_PAGES:
            s = tl.where(page_ok[None, :], s, float("-inf"))
        scale = qk_scale_log2 if FOLD_SCALE else 1.0
        # [BLOCK_M] new running max; it lags while it grows by at most RESCALE_THRESHOLD
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
        if RESCALE_THRESHOLD > 0:
            m_new = tl.where(m_new > m_i + RESCALE_THRESHOLD, m_new, m_i)
        pivot = tl.where(m_new == float("-inf"), 0.0, m_new)
        # [BLOCK_M, BLOCK_N]
        p = tl.exp2(s * scale - pivot[:, None])
        alpha = tl.exp2(m_i - pivot)
        if RESCALE_THRESHOLD > 0:
            if tl.min(alpha, 0) < 1.0:
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
        else:
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
        l_i += tl.sum(p, 1)  # the softmax normalizer (and so the LSE) ignores dropout
        if HAS_DROPOUT:
            p = tl.where(dropout_keep(rng_state, stream, offs_m, n_start, keep_threshold, BLOCK_N), p, 0.0)
        acc = pv_product(p, v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kv_parts(acc, l_i, m_i, q, offs_m, n_blocks, kv, k_desc, v_desc, block_table_row, pages, visibility, scores,
                  alibi, rng_state, stream, dropout, IS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, FOLD_SCALE: tl.constexpr,
                  RESCALE_THRESHOLD: tl.constexpr, TMA_MODE: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
                  CHECK_PAGES: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr):
    """_fwd_kv_loop over the key blocks n_blocks = (n_block_min, n_full_min, n_full_max, n_block_max)."""
    for part in tl.static_range(3):
        # part 0 and 2: the masked edges [n_block_min, n_full_min) and [n_full_max, n_block_max);
        # part 1: the blocks every row sees whole, [n_full_min, n_full_max), without a mask
        acc, l_i, m_i = _fwd_kv_loop(
            acc, l_i, m_i, q, offs_m, n_blocks[part], n_blocks[part + 1], kv, k_desc, v_desc, block_table_row, pages,
            visibility, scores, alibi, rng_state, stream, dropout, MASKED=part != 1, IS_LOCAL=IS_LOCAL,
            HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI, HAS_DROPOUT=HAS_DROPOUT, FOLD_SCALE=FOLD_SCALE,
            RESCALE_THRESHOLD=RESCALE_THRESHOLD, TMA_MODE=TMA_MODE, TILE_IN_PAGE=TILE_IN_PAGE,
            CHECK_PAGES=CHECK_PAGES, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HEAD_DIM_V=HEAD_DIM_V,
            BLOCK_DV=BLOCK_DV)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["stride_lse_b", "stride_lse_h", "page_size", "seqlen_q", "seqlen_k", "heads_per_group",
                               "window_left", "window_right", "q_rows", "k_rows", "kv_rows"])
def attn_fwd_kernel(
    inputs, outputs, optional, q_desc, k_desc, v_desc, o_desc, strides, stride_lse_b, stride_lse_h, batch_strides,
    page_size, page_strides, split_strides, head_counts, seqlen_q, seqlen_k, heads_per_group, scores, window_left,
    window_right, alibi_pure_causal, dropout, q_rows, k_rows, kv_rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, IS_SPLIT: tl.constexpr, TMA_MODE: tl.constexpr, FOLD_SCALE: tl.constexpr,
    PACK_GQA: tl.constexpr, TILE_IN_PAGE: tl.constexpr, RESCALE_THRESHOLD: tl.constexpr,
):
    """One program per (query tile, batch * head), or per (packed tile, batch * kv head) with PACK_GQA.

    Grouped arguments:
      inputs         (Q, K, V): Q and K HEAD_DIM wide, V HEAD_DIM_V (also Out's); outputs: (Out, Lse)
      optional       (AlibiSlopes, CuSeqlensQ, CuSeqlensK, SeqUsedK, LeftPadK, BlockTable, CacheBatchIdx, RngState,
                     Descales), each None where the call has none (and no code for it is generated); Descales:
                     (QDescale, KDescale, VDescale) of FP8 inputs, fp32 (batch, kv heads) contiguous
      strides        (batch, row, head) strides of Q, K, V and Out
      batch_strides  (AlibiSlopes, BlockTable) batch-row strides
      page_strides   (K, V) strides between pages; split_strides: (Out, Lse) strides between splits
      head_counts    (num_heads, group_size): query heads, query heads per KV head
      scores         ScoreParams.kernel_scores: (qk_scale_log2, softcap_in_scale, softcap_out_log2)
      dropout        (keep_threshold, dropout_scale)
      q_rows, k_rows the rows each sequence's queries / keys must lie in, None where no index value decides them
                     (dense calls): varlen Q's and K's total rows, K's sequence length (seqused_k / leftpad_k), a
                     block-table row's capacity (paged: the key length alone is clamped)
      kv_rows        K's and V's first dimension where CacheBatchIdx or BlockTable indexes it (cache rows, pages),
                     else None
    The Lse strides, page size, sequence lengths, heads_per_group, window and row bounds are plain unspecialized
    arguments: new values reuse the compiled kernel. Rows and pages that malformed index values put out of range
    count as empty: the kernel never addresses memory outside its tensors (docs/api.md §6). Tuples flatten, in order,
    into the compiled kernel's parameter list, and the generated code depends on that order: reordering arguments
    changes the SASS. q_desc .. o_desc (host-built descriptors of TMA_HOST / TMA_PACKED, else None) stay separate
    arguments: Triton's launcher expands a host descriptor into its kernel parameters only where it is an argument of
    its own, not inside a tuple.

    Paged K/V (BlockTable) are addressed one page lookup per key tile with TILE_IN_PAGE; a program first scans the
    block-table entries of the keys it reads (pages_in_pool) and runs the key loop that checks pages
    (CHECK_PAGES) only where one is outside the pool, so valid tables keep the unchecked loop. CacheBatchIdx maps batch
    row b to K/V row CacheBatchIdx[b] (the kv-cache's cache_batch_idx). Query tiles run in reverse order, so under a
    causal mask the longest rows start first; programs run in groups of heads_per_group (batch, head) pairs
    (grouped_tile_and_batch_head). HAS_DROPOUT drops P elements by dropout_keep (seeded from RngState) after the row
    sum, so the LSE ignores dropout, and scales the output by dropout_scale = 1 / (1 - dropout_p) (FA2: fp32).
    IS_SPLIT (split-KV, grid axis 1 = split): each split attends to its share of the visible key blocks and
    writes fp32 partial outputs and LSEs (-inf where it saw no key) for attn_combine_kernel to merge.
    """
    Q, K, V = inputs
    Out, Lse = outputs
    AlibiSlopes, CuSeqlensQ, CuSeqlensK, SeqUsedK, LeftPadK, BlockTable, CacheBatchIdx, RngState, Descales = optional
    q_strides, k_strides, v_strides, o_strides = strides
    stride_qb, stride_qm, stride_qh = q_strides
    stride_kb, stride_kn, stride_kh = k_strides
    stride_vb, stride_vn, stride_vh = v_strides
    stride_ob, stride_om, stride_oh = o_strides
    stride_alibi_b, stride_block_table_b = batch_strides
    stride_kpage, stride_vpage = page_strides
    stride_o_split, stride_lse_split = split_strides
    num_heads, group_size = head_counts
    _, dropout_scale = dropout
    HAS_ALIBI: tl.constexpr = AlibiSlopes is not None
    IS_PAGED: tl.constexpr = BlockTable is not None

    num_heads_k = num_heads // group_size
    if PACK_GQA:
        num_tiles = tl.cdiv(seqlen_q * group_size, BLOCK_M)
    else:
        num_tiles = tl.cdiv(seqlen_q, BLOCK_M)
    tile, batch_head = grouped_tile_and_batch_head(num_tiles, heads_per_group)
    m_block = num_tiles - 1 - tile
    if PACK_GQA:
        batch = batch_head // num_heads_k
        head_k = batch_head % num_heads_k
    else:
        batch = batch_head // num_heads
        head_k = (batch_head % num_heads) // group_size
    q_start, seqlen_q, k_start, seqlen_k = sequence_bounds(batch, CuSeqlensQ, CuSeqlensK, SeqUsedK, LeftPadK, seqlen_q,
                                                           seqlen_k, q_rows, None if IS_PAGED else k_rows)
    if IS_PAGED:
        seqlen_k = tl.minimum(tl.maximum(seqlen_k, 0), k_rows)
    kv_batch = batch
    if CacheBatchIdx is not None:
        # a cache row outside K's rows: the batch row sees no key
        kv_batch = tl.load(CacheBatchIdx + batch)
        kv_batch_ok = (kv_batch >= 0) & (kv_batch < kv_rows)
        kv_batch = tl.where(kv_batch_ok, kv_batch, 0)
        seqlen_k = tl.where(kv_batch_ok, seqlen_k, 0)
    visibility = (seqlen_q, seqlen_k, window_left, window_right)
    offs_row = tl.arange(0, BLOCK_M)
    if PACK_GQA:
        # tile row r holds query row p // group_size of head head_k * group_size + p % group_size, p = packed index
        packed_start = m_block * BLOCK_M
        if packed_start >= seqlen_q * group_size:
            return
        offs_packed = packed_start + offs_row
        offs_m = offs_packed // group_size
        heads = head_k * group_size + offs_packed % group_size
        m_start = packed_start // group_size
    else:
        m_start = m_block * BLOCK_M
        if m_start >= seqlen_q:
            return
        offs_m = m_start + offs_row
        heads = batch_head % num_heads + 0 * offs_row
    # [BLOCK_M] the query head of each tile row
    head_in_tile = heads.to(tl.int64)
    row_in = offs_m < seqlen_q

    batch64 = batch.to(tl.int64)
    kv_batch64 = kv_batch.to(tl.int64)
    q_base = Q + batch64 * stride_qb + to_int64(q_start) * stride_qm
    if IS_PAGED:
        k_start = 0  # paged keys are addressed through the block table, not cu_seqlens_k
    k_base = K + kv_batch64 * stride_kb + to_int64(k_start) * stride_kn + head_k.to(tl.int64) * stride_kh
    v_base = V + kv_batch64 * stride_vb + to_int64(k_start) * stride_vn + head_k.to(tl.int64) * stride_vh
    block_table_row = BlockTable
    if IS_PAGED:
        block_table_row = BlockTable + batch64 * stride_block_table_b
    split_idx = tl.program_id(1)
    o_base = Out + split_idx.to(tl.int64) * stride_o_split + batch64 * stride_ob + to_int64(q_start) * stride_om
    lse_base = Lse + split_idx.to(tl.int64) * stride_lse_split + batch64 * stride_lse_b + q_start

    offs_d = tl.arange(0, BLOCK_D)
    d_in = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_in = offs_dv < HEAD_DIM_V
    # [BLOCK_M] offsets of each tile row inside Q, Out and Lse from their bases
    q_row_offs = offs_m.to(tl.int64) * stride_qm + head_in_tile * stride_qh
    o_row_offs = offs_m.to(tl.int64) * stride_om + head_in_tile * stride_oh
    lse_row_offs = head_in_tile * stride_lse_h + offs_m
    # descriptor coordinates (batch, head, kv batch, kv head) of this program's tiles, and the rows its
    # sequence starts at (packed varlen tensors)
    desc_batch, desc_head, desc_kv_batch, desc_head_k = batch, batch_head % num_heads, kv_batch, head_k
    desc_q_row0, desc_k_row0 = 0, 0
    if TMA_MODE == TMA_PACKED:
        desc_batch, desc_kv_batch, desc_q_row0, desc_k_row0 = 0, 0, q_start, k_start
    if TMA_MODE == TMA_DEVICE:
        desc_batch, desc_head, desc_kv_batch, desc_head_k = 0, 0, 0, 0
        k_desc = tl.make_tensor_descriptor(k_base, shape=[1, seqlen_k, 1, HEAD_DIM],
                                           strides=[stride_kn, stride_kn, stride_kh, 1],
                                           block_shape=[1, BLOCK_N, 1, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[1, seqlen_k, 1, HEAD_DIM_V],
                                           strides=[stride_vn, stride_vn, stride_vh, 1],
                                           block_shape=[1, BLOCK_N, 1, BLOCK_DV])
        if not PACK_GQA:
            head64 = (batch_head % num_heads).to(tl.int64)
            q_desc = tl.make_tensor_descriptor(q_base + head64 * stride_qh, shape=[1, seqlen_q, 1, HEAD_DIM],
                                               strides=[stride_qm, stride_qm, stride_qh, 1],
                                               block_shape=[1, BLOCK_M, 1, BLOCK_D])
            o_desc = tl.make_tensor_descriptor(o_base + head64 * stride_oh, shape=[1, seqlen_q, 1, HEAD_DIM_V],
                                               strides=[stride_om, stride_om, stride_oh, 1],
                                               block_shape=[1, BLOCK_M, 1, BLOCK_DV])
    # [BLOCK_M, BLOCK_D]
    if TMA_MODE != TMA_OFF and not PACK_GQA:
        q = q_desc.load([desc_batch, desc_q_row0 + m_start, desc_head, 0]).reshape(BLOCK_M, BLOCK_D)
        if TMA_MODE == TMA_PACKED:
            q = tl.where(row_in[:, None], q, 0.0)
    else:
        q = tl.load(q_base + q_row_offs[:, None] + offs_d[None, :], mask=row_in[:, None] & d_in[None, :], other=0.0)

    # [BLOCK_M, 1] ALiBi slope of each row's head (log2 units); dropout's stream batch * heads + head (per row,
    # [BLOCK_M, 1], where heads are packed)
    slope_log2 = tl.zeros([BLOCK_M, 1], tl.float32)
    if HAS_ALIBI:
        slope_log2 = tl.load(AlibiSlopes + batch * stride_alibi_b + heads)[:, None] * 1.4426950408889634
    if PACK_GQA:
        stream = (batch * num_heads + heads)[:, None]
    else:  # one head: rows from a tile's first (dropout_keep draws each Philox call once for two rows)
        stream = batch * num_heads + batch_head % num_heads

    if Descales is not None:
        # FP8: q and k dequantize into the scores' scale (softcap's input scale too), v's into the output's (below)
        QDescale, KDescale, VDescale = Descales
        descale_index = batch * num_heads_k + head_k
        qk_descale = tl.load(QDescale + descale_index) * tl.load(KDescale + descale_index)
        scores = (scores[0] * qk_descale, scores[1] * qk_descale, scores[2])
    # [BLOCK_M] running max (log2), row sum; [BLOCK_M, BLOCK_DV] output accumulator
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    n_blocks = kv_block_range(m_start, visibility, BLOCK_M, BLOCK_N, IS_LOCAL)
    if IS_SPLIT:
        n_blocks = split_kv_block_range(n_blocks, split_idx, tl.num_programs(1))
    kv = (k_base, v_base, stride_kn, stride_vn, desc_kv_batch, desc_k_row0, desc_head_k)
    pages = (page_size, stride_kpage, stride_vpage, kv_rows)
    alibi = (slope_log2, alibi_pure_causal)
    if IS_PAGED:
        # The pages this program reads are scanned once: all in the pool (always, for valid block tables), the key
        # loop is the one without page checks; otherwise the loop that masks the keys of out-of-pool pages runs.
        n_block_min, _, _, n_block_max = n_blocks
        if pages_in_pool(block_table_row, n_block_min * BLOCK_N, tl.minimum(n_block_max * BLOCK_N, seqlen_k),
                         page_size, kv_rows):
            acc, l_i, m_i = _fwd_kv_parts(
                acc, l_i, m_i, q, offs_m, n_blocks, kv, k_desc, v_desc, block_table_row, pages, visibility, scores,
                alibi, RngState, stream, dropout, CHECK_PAGES=False, IS_LOCAL=IS_LOCAL,
                HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI, HAS_DROPOUT=HAS_DROPOUT, FOLD_SCALE=FOLD_SCALE,
                RESCALE_THRESHOLD=RESCALE_THRESHOLD, TMA_MODE=TMA_MODE, TILE_IN_PAGE=TILE_IN_PAGE, HEAD_DIM=HEAD_DIM,
                BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HEAD_DIM_V=HEAD_DIM_V, BLOCK_DV=BLOCK_DV)
        else:
            acc, l_i, m_i = _fwd_kv_parts(
                acc, l_i, m_i, q, offs_m, n_blocks, kv, k_desc, v_desc, block_table_row, pages, visibility, scores,
                alibi, RngState, stream, dropout, CHECK_PAGES=True, IS_LOCAL=IS_LOCAL,
                HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI, HAS_DROPOUT=HAS_DROPOUT, FOLD_SCALE=FOLD_SCALE,
                RESCALE_THRESHOLD=RESCALE_THRESHOLD, TMA_MODE=TMA_MODE, TILE_IN_PAGE=TILE_IN_PAGE, HEAD_DIM=HEAD_DIM,
                BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HEAD_DIM_V=HEAD_DIM_V, BLOCK_DV=BLOCK_DV)
    else:
        acc, l_i, m_i = _fwd_kv_parts(
            acc, l_i, m_i, q, offs_m, n_blocks, kv, k_desc, v_desc, block_table_row, pages, visibility, scores, alibi,
            RngState, stream, dropout, CHECK_PAGES=False, IS_LOCAL=IS_LOCAL,
            HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI, HAS_DROPOUT=HAS_DROPOUT, FOLD_SCALE=FOLD_SCALE,
            RESCALE_THRESHOLD=RESCALE_THRESHOLD, TMA_MODE=TMA_MODE, TILE_IN_PAGE=TILE_IN_PAGE, HEAD_DIM=HEAD_DIM,
            BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HEAD_DIM_V=HEAD_DIM_V, BLOCK_DV=BLOCK_DV)

    # rows that saw no key: out 0, lse +inf (docs/api.md §4.5)
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if HAS_DROPOUT:
        out = out * dropout_scale
    if Descales is not None:
        out = out * tl.load(VDescale + descale_index)
    # rows that saw no key: +inf as flash_attn returns it, -inf inside a split so the combine weighs it 0
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf") if IS_SPLIT else float("inf"))
    if (TMA_MODE == TMA_HOST or TMA_MODE == TMA_DEVICE) and not PACK_GQA:
        o_desc.store([desc_batch, m_start, desc_head, 0],
                     narrow(out, Out.dtype.element_ty).reshape(1, BLOCK_M, 1, BLOCK_DV))
    else:
        tl.store(o_base + o_row_offs[:, None] + offs_dv[None, :], narrow(out, Out.dtype.element_ty),
                 mask=row_in[:, None] & dv_in[None, :])
    tl.store(lse_base + lse_row_offs, lse, mask=row_in)

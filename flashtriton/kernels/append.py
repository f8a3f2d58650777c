"""KV-cache append: copy new keys/values into a contiguous or paged cache at each row's end (docs/api.md §5.4).

Row b's new token t goes to cache position cache_seqlens[b] + t of cache row cache_batch_idx[b] (or b),
or through the block table when the cache is paged. Copies are bit-exact; positions outside [0, capacity) are not
written (the launcher checks capacity where flash_attn does), nor are tokens whose cache row (cache_batch_idx) or
page (block table entry) lies outside the cache: whatever the index values, no write leaves the cache.
"""

import triton
import triton.language as tl

from .common import tile_and_batch_head


@triton.jit(do_not_specialize=["seqlen_new", "capacity", "page_size", "cache_rows"])
def kv_append_kernel(
    KNew, VNew, KCache, VCache, CacheSeqlens, CacheBatchIdx, BlockTable,
    stride_knb, stride_kns, stride_knh,
    stride_vnb, stride_vns, stride_vnh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    stride_block_table_b, page_size,
    num_heads_k, seqlen_new, capacity, cache_rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, IS_PAGED: tl.constexpr,
):
    """One program per (block of new tokens, batch * kv head); K rows HEAD_DIM wide, V rows HEAD_DIM_V. cache_rows: KCache's first dimension (cache rows, or
    pages when IS_PAGED) that cache_batch_idx / block table entries must name; None when neither is given."""
    s_block, batch_head = tile_and_batch_head(tl.cdiv(seqlen_new, BLOCK_S))
    batch = batch_head // num_heads_k
    head = (batch_head % num_heads_k).to(tl.int64)
    cache_row = batch
    end = tl.load(CacheSeqlens + batch)
    offs_t = s_block * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    positions = end + offs_t
    valid = (offs_t < seqlen_new) & (positions < capacity) & (positions >= 0)
    if HAS_BATCH_IDX:
        cache_row = tl.load(CacheBatchIdx + batch)
        row_ok = (cache_row >= 0) & (cache_row < cache_rows)
        valid = valid & row_ok
        cache_row = tl.where(row_ok, cache_row, 0)
    if IS_PAGED:
        # [BLOCK_S] the page of each position; positions outside [0, capacity) look nothing up (slot 0)
        slots = tl.where(valid, positions, 0)
        page = tl.load(BlockTable + batch.to(tl.int64) * stride_block_table_b + slots // page_size, mask=valid,
                       other=0)
        page_ok = (page >= 0) & (page < cache_rows)
        valid = valid & page_ok
        page = tl.where(page_ok, page, 0).to(tl.int64)
        # [BLOCK_S] element offsets of the destination rows inside one head's cache
        in_page = (slots % page_size).to(tl.int64)
        k_rows = page * stride_kcb + in_page * stride_kcs
        v_rows = page * stride_vcb + in_page * stride_vcs
    else:
        # positions that are not written are addressed as row 0, so no address leaves the cache
        rows = tl.where(valid, positions, 0).to(tl.int64)
        k_rows = rows * stride_kcs
        v_rows = rows * stride_vcs
    mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    mask_v = valid[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
    batch64 = batch.to(tl.int64)
    src_k = KNew + batch64 * stride_knb + head * stride_knh + offs_t[:, None].to(tl.int64) * stride_kns
    src_v = VNew + batch64 * stride_vnb + head * stride_vnh + offs_t[:, None].to(tl.int64) * stride_vns
    dst_k = KCache + head * stride_kch + k_rows[:, None] + offs_d[None, :]
    dst_v = VCache + head * stride_vch + v_rows[:, None] + offs_dv[None, :]
    if not IS_PAGED:
        dst_k += cache_row.to(tl.int64) * stride_kcb
        dst_v += cache_row.to(tl.int64) * stride_vcb
    # [BLOCK_S, BLOCK_D], [BLOCK_S, BLOCK_DV]
    tl.store(dst_k, tl.load(src_k + offs_d[None, :], mask=mask), mask=mask)
    tl.store(dst_v, tl.load(src_v + offs_dv[None, :], mask=mask_v), mask=mask_v)

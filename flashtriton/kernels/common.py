"""Jit helpers shared by every attention kernel: block ranges, masks, score modifiers and the matrix product.

Naming legend (all kernels):
  m_block / n_block   index of a query / key tile; offs_m, offs_n, offs_d index rows, keys, features
  BLOCK_M, BLOCK_N    tile sizes; BLOCK_D the head dim rounded up to a power of two (>= 16)
  window_left/right   the normalized window of docs/api.md §4.2.3: both < 0 (no window) or both >= 0;
                      causal is window_right == 0 with window_left >= seqlen_k (never binds)
  *_log2              a quantity in log2 units (scores are kept as log2-domain logits inside kernels)
  visibility          (seqlen_q, seqlen_k, window_left, window_right) of one sequence: what decides which keys a
                      row sees (kv_block_range, q_block_range, visibility_mask)
  scores              (qk_scale_log2, softcap_in_scale, softcap_out_log2), ScoreParams.kernel_scores (scores_log2)
  None pointer        an optional tensor the call does not have; `X is not None` is decided at compile time, so the
                      kernel holds no code for an absent feature
Masks and key-block ranges live here and nowhere else: kernels loop over the masked edge blocks and the unmasked
full blocks that these helpers return.
"""

import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc=None):
    """tl.dot(a, b, acc) of fp16 / bf16 / fp8 (e4m3) tiles: exact products summed in fp32 onto acc (zeros when None).
    Every matrix product of the Triton kernels goes through here. Triton's interpreter (3.6-3.9) multiplies bf16 and
    fp8 operands as their integer storage, an integer product; where the kernels are interpreted, such operands are
    first widened to fp32 (exactly), which gives what the GPU's MMA computes: exact products, fp32 sums. Compiled,
    INTERPRETED is False, the branch leaves no code and the generated code is that of a direct tl.dot."""
    if INTERPRETED:
        if a.dtype == tl.bfloat16 or a.dtype.is_fp8():
            a = a.to(tl.float32)
        if b.dtype == tl.bfloat16 or b.dtype.is_fp8():
            b = b.to(tl.float32)
    return tl.dot(a, b, acc)


@triton.jit
def narrow(x, dtype: tl.constexpr):
    """x in dtype (fp16, bf16 or e4m3), rounded to nearest even (e4m3 saturating at +-448), as the GPU converts.
    Every narrowing conversion of the Triton kernels goes through here. Triton's interpreter (3.6) converts fp32 to
    bf16 by truncation (0.99995 -> 0.9961) and to e4m3 by truncation with lost carries (0.49 -> 0.25); interpreted,
    x is first rounded onto dtype's grid in fp32, whose values it then converts exactly: bf16 by rounding the fp32
    bits to their upper 16 (NaN kept; fp32 subnormals still flush to 0 there), e4m3 by adding and subtracting
    1.5 * 2^23 ulps (which rounds to the ulp). Compiled, INTERPRETED is False, the branches leave no code and this is
    x.to(dtype)."""
    if INTERPRETED and x.dtype == tl.float32:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            # + 0x7FFF, + 1 more where the kept part is odd: ties go to even; then the lower 16 bits cleared
            bits = (bits + (32767 + ((bits >> 16) & 1))) >> 16 << 16
            x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
        if dtype == tl.float8e4nv:
            # the e4m3 ulp at |x|: 2^(exponent - 3), normal exponents from -6 (below: the subnormals' 2^-9)
            exponent = tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(x), 0.001953125))), -6.0)
            magic = tl.exp2(exponent - 3.0) * 12582912.0
            rounded = tl.minimum(tl.maximum((x + magic) - magic, -448.0), 448.0)
            x = tl.where(rounded == 0.0, x * 0.0, rounded)  # zeros keep x's sign
    return x.to(dtype)


@triton.jit
def pv_product(p, v, acc):
    """acc + p.v for a [BLOCK_M, BLOCK_N] fp32 p and a [BLOCK_N, BLOCK_DV] v. fp16 / bf16 v: p rounded to v's dtype,
    one product. FP8 (e4m3) v: v widened to fp16 (exactly: every e4m3 value is an fp16 one) and p rounded to fp16,
    one fp16 product: P keeps 11 significant bits (one e4m3 term would keep 4: a 10x larger output RMSE on N(0, 1)
    inputs), and no e4m3 V tile needs the key-major transpose an FP8 product's B operand asks for."""
    if v.dtype == tl.float8e4nv:
        if INTERPRETED:
            v = v.to(tl.float32)  # the interpreter widens e4m3 to fp32 only
        return mma(narrow(p, tl.float16), v.to(tl.float16), acc)
    return mma(narrow(p, v.dtype), v, acc)


# TRITON_INTERPRET is read when @triton.jit decorates, so a decorated function says whether kernels are
# interpreted (flashtriton.ops.backend.KERNELS_INTERPRETED asks attn_fwd_kernel the same question).
INTERPRETED = tl.constexpr(type(mma).__name__ == "InterpretedFunction")
# Dropout's Philox rounds: FA2's seven (Philox4x32-7, which passes BigCrush; ten is the default of Triton's
# tl.random and of the Random123 paper's safety margin). kernels/hopper/dropout.py unrolls the same count.
PHILOX_ROUNDS = tl.constexpr(7)


@triton.jit
def tile_and_batch_head(num_tiles):
    """(tile, batch * heads index) of this program. Grids are 1-D over num_tiles tiles per (batch, head),
    tiles fastest (the programs of one head run together and share its K/V in L2), so CUDA's 65535 limit
    on grid axes 1 and 2 never binds on batch * heads. Launchers size axis 0 as num_tiles * batch * heads."""
    pid = tl.program_id(0)
    return pid % num_tiles, pid // num_tiles


@triton.jit
def grouped_tile_of(linear, num_tiles, num_batch_heads, heads_per_group):
    """(tile, batch * heads index) of work item `linear` of num_tiles * num_batch_heads, in launch order: batch *
    heads is cut into groups of heads_per_group consecutive indices (the last group may be smaller); inside a group
    the tile is slowest and the head fastest, so tile 0 of every head in the group starts before tile 1 of any.
    Kernels number their tiles longest first, so the last items are short ones (no long tail); launchers size
    groups so that the K/V the group's programs share stays in L2 (configs.heads_per_l2_group). heads_per_group = 1
    is tile_and_batch_head's order. Persistent kernels (kernels/hopper/fwd.py) pass their own item numbers."""
    group_items = num_tiles * heads_per_group
    group = linear // group_items
    first_head = group * heads_per_group
    heads_in_group = tl.minimum(heads_per_group, num_batch_heads - first_head)
    within = linear - group * group_items
    return within // heads_in_group, first_head + within % heads_in_group


@triton.jit
def grouped_tile_and_batch_head(num_tiles, heads_per_group):
    """grouped_tile_of for a 1-D grid of one program per work item (num_tiles * batch * heads programs)."""
    return grouped_tile_of(tl.program_id(0), num_tiles, tl.num_programs(0) // num_tiles, heads_per_group)


@triton.jit
def kv_block_range(m_start, visibility, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_LOCAL: tl.constexpr):
    """Key blocks visible to query rows [m_start, m_start + BLOCK_M) under visibility = (seqlen_q, seqlen_k,
    window_left, window_right).

    Returns (n_block_min, n_full_min, n_full_max, n_block_max): blocks in [n_full_min, n_full_max)
    are visible to every row and need no mask; blocks in [n_block_min, n_full_min) and
    [n_full_max, n_block_max) need one; blocks outside [n_block_min, n_block_max) are never loaded.
    """
    seqlen_q, seqlen_k, window_left, window_right = visibility
    n_blocks = tl.cdiv(seqlen_k, BLOCK_N)
    if IS_LOCAL:
        offset = seqlen_k - seqlen_q
        m_last = tl.minimum(m_start + BLOCK_M, seqlen_q) - 1
        first_key = m_start + offset - window_left           # first key the first row sees
        end_key = m_last + offset + window_right + 1         # one past the last key the last row sees
        n_block_min = tl.maximum(first_key, 0) // BLOCK_N
        n_block_max = tl.minimum(tl.cdiv(tl.maximum(end_key, 0), BLOCK_N), n_blocks)
        full_first = m_last + offset - window_left          # keys every row sees start here ...
        full_end = tl.minimum(m_start + offset + window_right + 1, seqlen_k)  # ... and end here
        n_full_min = tl.cdiv(tl.maximum(full_first, 0), BLOCK_N)
        n_full_max = tl.maximum(full_end, 0) // BLOCK_N
        n_full_min = tl.minimum(tl.maximum(n_full_min, n_block_min), n_block_max)
        n_full_max = tl.minimum(tl.maximum(n_full_max, n_full_min), n_block_max)
    else:
        n_block_min = 0
        n_full_min = 0
        n_full_max = seqlen_k // BLOCK_N
        n_block_max = n_blocks
    return n_block_min, n_full_min, n_full_max, n_block_max


@triton.jit
def split_kv_block_range(n_blocks, split_idx, num_splits):
    """kv_block_range's (n_block_min, n_full_min, n_full_max, n_block_max) of split `split_idx` when the visible
    blocks are cut into num_splits parts of equal block counts (the last ones may be shorter or empty)."""
    n_block_min, n_full_min, n_full_max, n_block_max = n_blocks
    per_split = tl.cdiv(tl.maximum(n_block_max - n_block_min, 0), num_splits)
    lo = tl.minimum(n_block_min + split_idx * per_split, n_block_max)
    hi = tl.minimum(lo + per_split, n_block_max)
    n_full_min = tl.minimum(tl.maximum(n_full_min, lo), hi)
    n_full_max = tl.minimum(tl.maximum(n_full_max, n_full_min), hi)
    return lo, n_full_min, n_full_max, hi


@triton.jit
def q_block_range(n_start, visibility, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_LOCAL: tl.constexpr):
    """Query blocks that see any of the keys [n_start, n_start + BLOCK_N): the mirror of kv_block_range.

    Returns (m_block_min, m_full_min, m_full_max, m_block_max) with the same meaning. Key rows past
    seqlen_k in the last key block are never stored, so only the window decides what is full.
    """
    seqlen_q, seqlen_k, window_left, window_right = visibility
    m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    if IS_LOCAL:
        offset = seqlen_k - seqlen_q
        n_last = tl.minimum(n_start + BLOCK_N, seqlen_k) - 1
        first_row = n_start - offset - window_right          # first row that sees the first key
        end_row = n_last - offset + window_left + 1          # one past the last row that sees the last key
        m_block_min = tl.maximum(first_row, 0) // BLOCK_M
        m_block_max = tl.minimum(tl.cdiv(tl.maximum(end_row, 0), BLOCK_M), m_blocks)
        full_first = n_last - offset - window_right
        full_end = tl.minimum(n_start - offset + window_left + 1, seqlen_q)
        m_full_min = tl.cdiv(tl.maximum(full_first, 0), BLOCK_M)
        m_full_max = tl.maximum(full_end, 0) // BLOCK_M
        m_full_min = tl.minimum(tl.maximum(m_full_min, m_block_min), m_block_max)
        m_full_max = tl.minimum(tl.maximum(m_full_max, m_full_min), m_block_max)
    else:
        m_block_min = 0
        m_full_min = 0
        m_full_max = m_blocks
        m_block_max = m_blocks
    return m_block_min, m_full_min, m_full_max, m_block_max


@triton.jit
def visibility_mask(offs_m, offs_n, visibility, IS_LOCAL: tl.constexpr):
    """[BLOCK_M, BLOCK_N] bool: key offs_n is inside the sequence and the window of row offs_m."""
    seqlen_q, seqlen_k, window_left, window_right = visibility
    # [BLOCK_M, BLOCK_N]
    visible = offs_n[None, :] < seqlen_k
    if IS_LOCAL:
        aligned = offs_m[:, None] + (seqlen_k - seqlen_q)
        visible = visible & (offs_n[None, :] >= aligned - window_left) & (offs_n[None, :] <= aligned + window_right)
    return visible


@triton.jit
def tanh(x):
    """tanh from exp2, identical in compiled and interpreted kernels; saturates cleanly at +-1."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def alibi_bias_log2(slope_log2, offs_m, offs_n, visibility, alibi_pure_causal):
    """[BLOCK_M, BLOCK_N] ALiBi bias in log2 units (docs/api.md §4.4), with FA2's pure-causal LSE quirk
    (alibi_pure_causal != 0: the distance is -j instead of |c_i - j|)."""
    seqlen_q, seqlen_k, _, _ = visibility
    # [BLOCK_M, BLOCK_N] key distance |c_i - j|, or -j in the pure causal configuration
    aligned = offs_m[:, None] + (seqlen_k - seqlen_q)
    distance = tl.where(alibi_pure_causal != 0, -offs_n[None, :] + 0 * aligned, tl.abs(aligned - offs_n[None, :]))
    bias = -slope_log2 * distance.to(tl.float32)
    return bias


@triton.jit
def scores_log2(qk, scores, HAS_SOFTCAP: tl.constexpr):
    """Raw q.k (fp32) to log2-domain logits: scale, then softcap * tanh(scaled / softcap) (docs/api.md §4.1).
    scores: ScoreParams.kernel_scores, (qk_scale_log2, softcap_in_scale, softcap_out_log2)."""
    qk_scale_log2, softcap_in_scale, softcap_out_log2 = scores
    if HAS_SOFTCAP:
        return tanh(qk * softcap_in_scale) * softcap_out_log2
    else:
        return qk * qk_scale_log2


@triton.jit
def sequence_bounds(batch, CuSeqlensQ, CuSeqlensK, SeqUsedK, LeftPadK, seqlen_q, seqlen_k, q_rows, k_rows):
    """(first row of q, q length, first row of k, k length) of one batch entry; a None pointer: the call has none.

    Varlen reads cu_seqlens; seqused_k replaces the key length; leftpad_k moves the first key forward
    inside the sequence's slot (docs/api.md §7). q_rows / k_rows (None: no index value decides the rows) are the
    rows the q / k ranges must lie in: each range is clamped into [0, rows) (clamped_range), so malformed index
    values make sequences shorter or empty, never reach outside the tensors.
    """
    if CuSeqlensQ is not None:
        q_start = tl.load(CuSeqlensQ + batch)
        q_len = tl.load(CuSeqlensQ + batch + 1) - q_start
        k_start = tl.load(CuSeqlensK + batch)
        k_len = tl.load(CuSeqlensK + batch + 1) - k_start
    else:
        q_start = tl.zeros([], tl.int32)
        q_len = seqlen_q
        k_start = tl.zeros([], tl.int32)
        k_len = seqlen_k
    if SeqUsedK is not None:
        k_len = tl.load(SeqUsedK + batch)
    if LeftPadK is not None:
        left_pad = tl.load(LeftPadK + batch)
        k_start += left_pad
        k_len -= left_pad
    if q_rows is not None:
        q_start, q_len = clamped_range(q_start, q_len, q_rows)
    if k_rows is not None:
        k_start, k_len = clamped_range(k_start, k_len, k_rows)
    return q_start, q_len, k_start, k_len


@triton.jit
def clamped_range(start, length, rows):
    """(start, length) of rows [start, start + length) clamped into [0, rows); a range that ends before it starts is
    empty. Whatever the index values, a kernel then addresses only rows of its tensors (docs/api.md §6)."""
    end = start + length
    start = tl.minimum(tl.maximum(start, 0), rows)
    end = tl.minimum(tl.maximum(end, start), rows)
    return start, end - start


@triton.jit
def head_rows_descriptor(base, num_heads, seqlen, stride_h, stride_row, HEAD_DIM: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """In-kernel tensor descriptor over rows [0, seqlen) of every head of one sequence, seen as a
    [num_heads, seqlen, HEAD_DIM] tensor at base; loads [1, BLOCK_ROWS, BLOCK_D] tiles (load_head_rows).
    Rows past seqlen and features past HEAD_DIM read as zeros."""
    return tl.make_tensor_descriptor(base, shape=[num_heads, seqlen, HEAD_DIM], strides=[stride_h, stride_row, 1],
                                     block_shape=[1, BLOCK_ROWS, BLOCK_D])


@triton.jit
def load_head_rows(desc, head, row_start, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """[BLOCK_ROWS, BLOCK_D] tile of rows row_start.. of one head through a head_rows_descriptor."""
    return desc.load([head, row_start, 0]).reshape(BLOCK_ROWS, BLOCK_D)


@triton.jit
def to_int64(x):
    """Widen a scalar (tensor or interpreter int) to int64 before it multiplies a stride."""
    return x + tl.zeros([], tl.int64)


@triton.jit
def row_offsets(n_start, offs_col, seqlen_k, stride_row, block_table_row, page_size, stride_page,
                IS_PAGED: tl.constexpr, TILE_IN_PAGE: tl.constexpr = False):
    """[BLOCK] int64 element offsets of rows n_start + offs_col (keys, or query rows) from their head's base.

    Paged caches (docs/api.md §3.4, §5.2) map key t to row t % page_size of page block_table_row[t // page_size].
    TILE_IN_PAGE (the tile size divides page_size, n_start is a tile start): the whole tile lies in one
    page, looked up once.
    """
    if IS_PAGED and TILE_IN_PAGE:
        page = tl.load(block_table_row + n_start // page_size).to(tl.int64)
        return page * stride_page + ((n_start % page_size) + offs_col) * stride_row
    elif IS_PAGED:
        offs_n = n_start + offs_col
        page = tl.load(block_table_row + offs_n // page_size, mask=offs_n < seqlen_k, other=0).to(tl.int64)
        return page * stride_page + (offs_n % page_size) * stride_row
    else:
        return to_int64(n_start) * stride_row + offs_col * stride_row


@triton.jit
def paged_row_offsets(n_start, offs_col, seqlen_k, stride_row, block_table_row, page_size, stride_page, num_pages,
                      TILE_IN_PAGE: tl.constexpr):
    """row_offsets of paged keys, and whether their page is one of the pool's num_pages: ([BLOCK] int64 offsets,
    page_ok, a bool scalar with TILE_IN_PAGE, else [BLOCK]). A page id outside [0, num_pages) is replaced by page 0
    so that no address leaves the pool; the caller masks the keys of such pages (they count as absent)."""
    if TILE_IN_PAGE:
        page = tl.load(block_table_row + n_start // page_size)
        rows = (n_start % page_size) + offs_col
    else:
        offs_n = n_start + offs_col
        page = tl.load(block_table_row + offs_n // page_size, mask=offs_n < seqlen_k, other=0)
        rows = offs_n % page_size
    page_ok = (page >= 0) & (page < num_pages)
    page = tl.where(page_ok, page, 0).to(tl.int64)
    return page * stride_page + rows * stride_row, page_ok


@triton.jit
def pages_in_pool(block_table_row, key_start, key_end, page_size, num_pages, BLOCK: tl.constexpr = 64):
    """Whether every block-table entry that keys [key_start, key_end) use names a page in [0, num_pages)."""
    first = key_start // page_size
    end = tl.cdiv(tl.maximum(key_end, key_start), page_size)
    outside = 0
    for start in range(first, end, BLOCK):
        entries = start + tl.arange(0, BLOCK)
        page = tl.load(block_table_row + entries, mask=entries < end, other=0)
        outside += tl.sum(((page < 0) | (page >= num_pages)).to(tl.int32), 0)
    return outside == 0


@triton.jit
def _keep_bytes(words, shift, threshold):
    """[..., 2] int8: whether bytes shift / 8 and shift / 8 + 1 of words (uint32) are <= threshold."""
    low = ((words >> shift) & 0xFF) <= threshold
    high = ((words >> (shift + 8)) & 0xFF) <= threshold
    return tl.join(low.to(tl.int8), high.to(tl.int8))


@triton.jit
def _keep_rows(words, threshold):
    """[..., 2 (key parity e), 2 (row half h)] int8: whether byte 2 h + e of words (uint32) is <= threshold."""
    return tl.join(_keep_bytes(words, 0, threshold), _keep_bytes(words, 16, threshold))


@triton.jit
def _key_pair_counters(n_start, GROUPS: tl.constexpr):
    """[GROUPS, 4] the first Philox counter of each (32-key group, key pair t) from key n_start: 4 (j / 32) + t."""
    return (n_start // 32 + tl.arange(0, GROUPS))[:, None] * 4 + tl.arange(0, 4)[None, :]


@triton.jit
def _row_pair_counter(rows):
    """The second Philox counter of query rows `rows` (any shape): 8 (i / 16) + i % 8, one for rows i and i + 8."""
    return (rows // 16) * 8 + rows % 8


@triton.jit
def _row_pair_keep(seed, offset, threshold, stream, offs_m, n_start, BLOCK_N: tl.constexpr):
    """dropout_keep [BLOCK_M, GROUPS * 32] of rows offs_m that run on from a multiple of 16 (stream a scalar): one
    Philox call per (row pair, 32-key group, key pair), as a wgmma thread draws them."""
    BLOCK_M: tl.constexpr = offs_m.shape[0]
    GROUPS: tl.constexpr = (BLOCK_N + 31) // 32
    # [BLOCK_M / 16, 8]: the first row of each pair (rows i and i + 8 of a 16-row group)
    rows = tl.reshape(offs_m, [BLOCK_M // 16, 2, 8])
    first_rows = tl.sum(tl.where((tl.arange(0, 2) == 0)[None, :, None], rows, 0), 1)
    # [BLOCK_M / 16, 8, 1, 1] the second Philox counter; [1, 1, GROUPS, 4] the first
    row_pair = _row_pair_counter(first_rows)[:, :, None, None]
    first_counter = _key_pair_counters(n_start, GROUPS)[None, None, :, :]
    zeros = tl.zeros_like(row_pair + first_counter)
    word0, word1, word2, word3 = tl.random.philox(seed, first_counter + zeros, row_pair + zeros, stream + zeros,
                                                  offset + zeros, PHILOX_ROUNDS)
    # [BLOCK_M / 16, 8 (g), GROUPS, 4 (t), 2 (e), 2 (h), 2 (k // 2), 2 (k % 2)]
    keep = tl.join(tl.join(_keep_rows(word0, threshold), _keep_rows(word2, threshold)),
                   tl.join(_keep_rows(word1, threshold), _keep_rows(word3, threshold)))
    # [BLOCK_M / 16, 2 (h), 8 (g), GROUPS, 2, 2, 4 (t), 2 (e)]: row 16 a + 8 h + g, key 32 group + 8 k + 2 t + e
    keep = tl.permute(keep, (0, 5, 1, 2, 6, 7, 3, 4))
    return tl.reshape(keep, [BLOCK_M, GROUPS * 32])


@triton.jit
def _row_keep(seed, offset, threshold, stream, offs_m, n_start, BLOCK_N: tl.constexpr):
    """dropout_keep [BLOCK_M, GROUPS * 32] of any rows offs_m (stream a scalar or per row [BLOCK_M, 1]): each row
    draws its own Philox calls and keeps its half of each."""
    BLOCK_M: tl.constexpr = offs_m.shape[0]
    GROUPS: tl.constexpr = (BLOCK_N + 31) // 32
    # [BLOCK_M, GROUPS, 4]: the first Philox counter of each (32-key group, key pair t); [BLOCK_M, 1, 1] the second
    first_counter = _key_pair_counters(n_start, GROUPS)[None, :, :]
    row_pair = _row_pair_counter(offs_m)[:, None, None]
    zeros = tl.zeros_like(row_pair + first_counter)
    streams = stream
    if len(stream.shape) == 2:
        streams = stream[:, :, None]
    word0, word1, word2, word3 = tl.random.philox(seed, first_counter + zeros, row_pair + zeros, streams + zeros,
                                                  offset + zeros, PHILOX_ROUNDS)
    # [BLOCK_M, 1, 1]: bit offset of the row's two bytes in each word
    shift = (16 * ((offs_m // 8) % 2))[:, None, None].to(tl.uint32)
    # [BLOCK_M, GROUPS, 4 (t), 2 (e), 2 (k // 2), 2 (k % 2)]: word k's byte 2 h + e
    keep = tl.join(tl.join(_keep_bytes(word0, shift, threshold), _keep_bytes(word2, shift, threshold)),
                   tl.join(_keep_bytes(word1, shift, threshold), _keep_bytes(word3, shift, threshold)))
    # [BLOCK_M, GROUPS, 2, 2, 4, 2]: key 32 group + 8 k + 2 t + e
    keep = tl.permute(keep, (0, 1, 4, 5, 2, 3))
    return tl.reshape(keep, [BLOCK_M, GROUPS * 32])


@triton.jit
def dropout_keep(rng_state, stream, offs_m, n_start, keep_threshold, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] bool keep mask of flash-attention dropout for query rows offs_m [BLOCK_M] and keys
    n_start + [0, BLOCK_N) (n_start a multiple of BLOCK_N and of 32 where BLOCK_N is 32 or more).

    FA2's convention (docs/api.md §4.7): one random byte per element, kept where byte <= keep_threshold =
    floor((1 - dropout_p) * 255) (ops/dropout.keep_threshold), so the keep probability is (keep_threshold + 1) / 256.
    Counter-based (Philox4x32-7, PHILOX_ROUNDS, keyed by the seed): key j of query row i in stream (batch * heads +
    head) takes byte 2 ((i / 8) % 2) + j % 2 of word (j / 8) % 4 of philox(4 (j / 32) + (j / 2) % 4, 8 (i / 16) +
    i % 8, stream, offset), with (seed, offset) = rng_state[0:2]. One Philox call covers rows i, i + 8 and keys
    2 t + {0, 1} of four 8-key groups: the sixteen elements one thread holds of a wgmma accumulator
    (kernels/hopper/dropout.py draws them that way). The mask never depends on tile sizes, launch order or splits.
    stream: a scalar, where offs_m runs on from a multiple of 16 (BLOCK_M a multiple of 16: each Philox call is
    drawn once for its two rows), or a [BLOCK_M, 1] tensor (one stream per row, any rows: each row draws its calls).
    """
    BLOCK_M: tl.constexpr = offs_m.shape[0]
    seed = tl.load(rng_state)
    offset = (tl.load(rng_state + 1) & 0x7FFFFFFF).to(tl.int32)
    threshold = (tl.zeros([], tl.float32) + keep_threshold).to(tl.uint32)
    if len(stream.shape) == 0 and BLOCK_M % 16 == 0:
        keep = _row_pair_keep(seed, offset, threshold, stream, offs_m, n_start, BLOCK_N)
    else:
        keep = _row_keep(seed, offset, threshold, stream, offs_m, n_start, BLOCK_N)
    if BLOCK_N < 32:
        # [BLOCK_M, 32 / BLOCK_N, BLOCK_N]: the block's part of its 32-key group
        parts = tl.reshape(keep, [BLOCK_M, 32 // BLOCK_N, BLOCK_N])
        part = (n_start % 32) // BLOCK_N
        chosen = (tl.arange(0, 32 // BLOCK_N) == part)[None, :, None]
        keep = tl.sum(tl.where(chosen, parts, 0), 1)
    return keep != 0

"""Gluon helpers shared by the Hopper kernels (fwd.py, bwd.py, bwd_d256.py): launch-order scheduling, the barrier
arrival after wgmmas, and the backward's key-block schedule, producer, probabilities and dK / dV stores, which the d64
/ d128 kernel (bwd.py) and the d256 kernel (bwd_d256.py) share."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .. import common as _triton_common

# kernels/common's launch-order, query-block-range and row-range helpers (plain integer arithmetic) compiled as
# Gluon functions: the Gluon kernels take them from the same code as the Triton kernels
grouped_tile_of = gluon.jit(_triton_common.grouped_tile_of.fn)
q_block_range = gluon.jit(_triton_common.q_block_range.fn)
clamped_range = gluon.jit(_triton_common.clamped_range.fn)


@gluon.jit
def arrive_after_wgmma(barrier, pred=True):
    """One arrival on `barrier` (by one thread of the calling warpgroup) handing back shared memory that only the
    warpgroup's wgmmas read, once the caller waited for them (or, for a turn barrier, issued them): an arrival that
    expects zero bytes. mbarrier.arrive arrives the same way but after a warpgroup-wide BAR.SYNC (Triton 3.6's
    barrier pass orders every shared-memory access of the partition before an arrival, and the next barrier
    operation after it), which would cost the forward four warpgroup barriers per key block. A wgmma completes for
    its whole warpgroup, so the thread that waited for it may arrive alone (CUTLASS's clustered consumer release
    relies on the same). Not for shared memory the warpgroup's threads also read or wrote with plain loads / stores,
    unless a warpgroup barrier (gl.thread_barrier) follows the last of those before the arrival (the backward's Q /
    dO stages: lse and delta are loaded by every thread, then the dS store's barrier)."""
    mbarrier.expect(barrier, 0, pred=pred)


@gluon.jit
def query_block(iteration, blocks_per_head, m_block_lo, head_k, group_size, ROWS: gl.constexpr):
    """(query head, first row) of loop iteration `iteration`: the group's heads in turn, each over its blocks of
    ROWS rows."""
    head = head_k * group_size + iteration // blocks_per_head
    return head, (m_block_lo + iteration % blocks_per_head) * ROWS


@gluon.jit
def loop_position(i, first_visit, n_iterations):
    """The loop position (query block of the group's heads, as query_block counts them) of iteration i: the
    program's n_iterations positions in turn from first_visit."""
    return (first_visit + i) % n_iterations


@gluon.jit
def sequence_rows(CuSeqlens, batch, rows):
    """(first row, length) of sequence `batch` of a varlen call: cu_seqlens entries clamped into [0, rows] (an end
    before its start gives an empty sequence; kernels/common.clamped_range), so malformed values never address rows
    outside the tensor."""
    start = gl.load(CuSeqlens + batch)
    return clamped_range(start, gl.load(CuSeqlens + batch + 1) - start, rows)


@gluon.jit
def key_block_of_program(num_heads_k, group_size, seqlen_q, seqlen_k, heads_per_group, window, KEYS: gl.constexpr,
                         ROWS: gl.constexpr, CAUSAL: gl.constexpr, LAST_FIRST: gl.constexpr, seqs):
    """(batch, kv head, first key, first query block, query blocks per head, loop iterations, bounds) of this
    program: key blocks of KEYS keys in order (under a causal mask the blocks seen by the most query rows first;
    LAST_FIRST: the last key block first, as ordered dQ needs: a block's reductions wait for the next block's), in
    launch-order groups of heads_per_group (batch, kv head) pairs; the query blocks of ROWS rows that see a key of
    the block, all or, under the causal mask (bottom-right aligned), those from row n_start - (seqlen_k - seqlen_q)
    on, or under a local window (window: (window_left, window_right), or () without one) those whose rows' windows
    meet the block (none: no iteration, dK and dV of the block are 0); the loop runs over the group's query heads
    too. seqs: () for a dense call, or (CuSeqlensQ, CuSeqlensK, q_rows, k_rows) for a varlen one: seqlen_q and
    seqlen_k are the longest lengths (the grid's), the ranges those of the program's sequence (sequence_rows), and a
    key block past its sequence's keys has no iteration. bounds: (first q row, query length, first k row, key
    length) of the program's sequence ((0, seqlen_q, 0, seqlen_k) for a dense call)."""
    n_key_blocks = gl.cdiv(seqlen_k, KEYS)
    n_block, batch_head = grouped_tile_of(gl.program_id(0), n_key_blocks, gl.num_programs(0) // n_key_blocks,
                                          heads_per_group)
    if LAST_FIRST:
        n_block = n_key_blocks - 1 - n_block
    batch = batch_head // num_heads_k
    head_k = batch_head % num_heads_k
    n_start = n_block * KEYS
    q_start = n_start * 0
    k_start = q_start
    if len(seqs) > 0:
        q_start, seqlen_q = sequence_rows(seqs[0], batch, seqs[2])
        k_start, seqlen_k = sequence_rows(seqs[1], batch, seqs[3])
    m_block_lo = 0
    if CAUSAL:
        m_block_lo = gl.maximum(n_start - (seqlen_k - seqlen_q), 0) // ROWS
    m_block_end = gl.cdiv(seqlen_q, ROWS)
    if len(window) > 0:
        # the query blocks whose rows' windows meet keys [n_start, n_start + KEYS) (kernels/common.q_block_range)
        m_block_lo, _, _, m_block_end = q_block_range(n_start, (seqlen_q, seqlen_k, window[0], window[1]), ROWS,
                                                      KEYS, True)
    blocks_per_head = gl.maximum(m_block_end - m_block_lo, 0)
    if len(seqs) > 0:
        blocks_per_head = gl.where(n_start < seqlen_k, blocks_per_head, 0)
    return (batch, head_k, n_start, m_block_lo, blocks_per_head, group_size * blocks_per_head,
            (q_start, seqlen_q, k_start, seqlen_k))


@gluon.jit
def store_key_rows(dk, dv, DK, DV, stride_dk_b, stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h,
                   batch, head_k, first_row, feature0, seqlen_k, head_dim, softmax_scale):
    """Store dk * softmax_scale and dv ([KEY_ROWS, FEATURES] fp32 accumulators) into key rows [first_row, +
    KEY_ROWS) below seqlen_k and features [feature0, + FEATURES) below head_dim (DK's and DV's own, where the tiles
    are wider) of DK and DV, in their dtype. The rows go out in
    16-byte pieces (a blocked layout, converted through shared memory): stored straight from the wgmma layout, every
    32-byte sector would be written in two halves."""
    KEY_ROWS: gl.constexpr = dk.shape[0]
    FEATURES: gl.constexpr = dk.shape[1]
    dtype: gl.constexpr = DK.dtype.element_ty
    VECTOR: gl.constexpr = 16 // (dtype.primitive_bitwidth // 8)
    ROW_THREADS: gl.constexpr = 32 // (FEATURES // VECTOR)
    layout: gl.constexpr = gl.BlockedLayout([1, VECTOR], [ROW_THREADS, FEATURES // VECTOR], [gl.num_warps(), 1],
                                            [1, 0])
    # [KEY_ROWS] key rows, [FEATURES] features
    rows = first_row + gl.arange(0, KEY_ROWS, gl.SliceLayout(1, layout))
    features = feature0 + gl.arange(0, FEATURES, gl.SliceLayout(0, layout))
    store_mask = gl.expand_dims(rows < seqlen_k, 1) & gl.expand_dims(features < head_dim, 0)
    dk_ptrs = (DK + batch.to(gl.int64) * stride_dk_b + head_k.to(gl.int64) * stride_dk_h
               + gl.expand_dims(rows.to(gl.int64) * stride_dk_n, 1) + gl.expand_dims(features, 0))
    dv_ptrs = (DV + batch.to(gl.int64) * stride_dv_b + head_k.to(gl.int64) * stride_dv_h
               + gl.expand_dims(rows.to(gl.int64) * stride_dv_n, 1) + gl.expand_dims(features, 0))
    gl.store(dk_ptrs, gl.convert_layout((dk * softmax_scale).to(dtype), layout), mask=store_mask)
    gl.store(dv_ptrs, gl.convert_layout(dv.to(dtype), layout), mask=store_mask)


@gluon.jit
def sequence_descriptor(desc, base, start, length):
    """A device-made copy of host descriptor desc ((1, T, H, D), [1, ROWS, 1, D'] blocks) over rows [start, + length)
    of its tensor (base: the tensor's first element): rows past the sequence read zeros. At least one row (a
    sequence without rows loads nothing through it)."""
    return tma.make_tensor_descriptor(base + start.to(gl.int64) * desc.strides[1],
                                      [1, gl.maximum(length, 1), desc.shape[2], desc.shape[3]],
                                      [desc.strides[0], desc.strides[1], desc.strides[2], 1], desc.block_type.shape,
                                      desc.layout)


@gluon.jit
def backward_producer(k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_pieces, do_pieces,
                      lse_smem, delta_smem, kv_ready, q_ready, q_empty, batch, head_k, n_start, num_heads, group_size,
                      m_block_lo, blocks_per_head, n_iterations, first_visit, q_start, load_kv, sequence):
    """One warp: the key block's K and V once, then Q_i, dO_i and their rows' log2(e) * lse and delta of every iteration
    (loop_position(i)) into stage i % STAGES. batch: the descriptors' batch coordinate; q_start: the sequence's first
    row in the lse / delta matrices (a varlen call's; 0 for a dense one). load_kv 0: the key block holds none of its
    sequence's keys (a varlen call's block past them): kv_ready completes without a load. Q and dO are staged in feature
    pieces (q_pieces, do_pieces: tuples of [STAGES, 1, ROWS, 1, PIECE] buffers, piece j holding features [j PIECE, +
    PIECE); one piece at head dims 64 and 128, two at 256). sequence: () for a dense call; a varlen call's (Q, dO, K,
    V base pointers, q_start, seqlen_q, k_start, seqlen_k, LSE, DELTA, lse_row_stride, delta_row_stride): this warp
    makes the sequence's own Q, dO, K and V descriptors (sequence_descriptor) before its first load (a descriptor made
    in the kernel is visible only to the threads whose TMA loads read it after the fence that ends its making, so the
    partition that loads makes them), and copies the rows' lse and delta from the (H, T) matrices LSE and DELTA with
    plain loads (stage_row_statistics): a sequence's rows start anywhere, and a TMA load's innermost coordinate must
    be 16-byte aligned (an unaligned one is an illegal instruction)."""
    STAGES: gl.constexpr = q_pieces[0].shape[0]
    KEYS: gl.constexpr = k_smem.shape[1]
    ROWS: gl.constexpr = q_pieces[0].shape[2]
    PIECE: gl.constexpr = q_pieces[0].shape[4]
    HEAD_DIM: gl.constexpr = k_smem.shape[3]
    element_bytes: gl.constexpr = k_desc.dtype.primitive_bitwidth // 8
    if len(sequence) > 0:
        q_desc = sequence_descriptor(q_desc, sequence[0], sequence[4], sequence[5])
        do_desc = sequence_descriptor(do_desc, sequence[1], sequence[4], sequence[5])
        k_desc = sequence_descriptor(k_desc, sequence[2], sequence[6], sequence[7])
        v_desc = sequence_descriptor(v_desc, sequence[3], sequence[6], sequence[7])
    if load_kv != 0:
        mbarrier.expect(kv_ready, 2 * KEYS * HEAD_DIM * element_bytes)
        tma.async_copy_global_to_shared(k_desc, [batch, n_start, head_k, 0], kv_ready, k_smem)
        tma.async_copy_global_to_shared(v_desc, [batch, n_start, head_k, 0], kv_ready, v_smem)
    else:
        mbarrier.arrive(kv_ready)
    for i in range(n_iterations):
        stage = i % STAGES
        mbarrier.wait(q_empty.index(stage), ((i // STAGES) - 1) & 1, pred=i >= STAGES)
        head, m_start = query_block(loop_position(i, first_visit, n_iterations), blocks_per_head, m_block_lo,
                                    head_k, group_size, ROWS)
        if len(sequence) > 0:
            stage_row_statistics(sequence[8], sequence[10], lse_smem.index(stage), head, q_start, m_start, sequence[5])
            stage_row_statistics(sequence[9], sequence[11], delta_smem.index(stage), head, q_start, m_start,
                                 sequence[5])
            # the plain stores above come before this arrival (Triton's barrier pass puts a warp barrier between)
            mbarrier.expect(q_ready.index(stage), 2 * ROWS * HEAD_DIM * element_bytes)
        else:
            mbarrier.expect(q_ready.index(stage), 2 * ROWS * HEAD_DIM * element_bytes + 2 * ROWS * 4)
        for piece in gl.static_range(len(q_pieces)):
            tma.async_copy_global_to_shared(q_desc, [batch, m_start, head, piece * PIECE], q_ready.index(stage),
                                            q_pieces[piece].index(stage))
        for piece in gl.static_range(len(do_pieces)):
            tma.async_copy_global_to_shared(do_desc, [batch, m_start, head, piece * PIECE], q_ready.index(stage),
                                            do_pieces[piece].index(stage))
        if len(sequence) == 0:
            row = batch * num_heads + head
            tma.async_copy_global_to_shared(lse_desc, [row, m_start], q_ready.index(stage), lse_smem.index(stage))
            tma.async_copy_global_to_shared(delta_desc, [row, m_start], q_ready.index(stage), delta_smem.index(stage))


@gluon.jit
def stage_row_statistics(statistic, row_stride, stage, head, q_start, m_start, seqlen_q):
    """Copy rows [m_start, + ROWS) of a varlen sequence's per-row statistic (lse or delta: an (H, T) fp32 matrix with
    rows of row_stride, the sequence from column q_start) into stage ([1, ROWS] shared) by one warp's plain loads;
    rows past seqlen_q get 0, as a dense call's rows past its end do."""
    ROWS: gl.constexpr = stage.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([ROWS // 32], [32], [1], [0])
    # [ROWS] rows of the block
    rows = m_start + gl.arange(0, ROWS, layout)
    values = gl.load(statistic + head.to(gl.int64) * row_stride + q_start + rows, mask=rows < seqlen_q, other=0.0)
    stage.reshape([ROWS]).store(values)


@gluon.jit
def masked_probabilities(s, lse_log2, qk_scale_log2, first_key, m_start, seqlen_q, seqlen_k, causal, window):
    """P = exp2(s * qk_scale_log2 - lse_log2) of scores s [ROWS, KEYS] (query rows from m_start, keys from first_key),
    0 where a key is past seqlen_k or, causal (bottom-right aligned), after the row's last key, or outside the row's
    local window (window: (window_left, window_right), or ()); blocks that need none of it come back without mask
    arithmetic. One comparison per element against each row's last visible key,
    and nothing kept live across the caller's loop (key vectors held across it would spill ~40 registers of the
    d128 causal consumers). Query rows past seqlen_q are not masked: their Q, dO, lse and delta read as zeros, so
    P = 1 there but dS = 0 and dO = 0, and every product they enter adds zeros. Keys past seqlen_k are (their K
    rows are zeros, so P would be exp2(-lse_log2), which may overflow)."""
    ROWS: gl.constexpr = s.shape[0]
    KEYS: gl.constexpr = s.shape[1]
    row_layout: gl.constexpr = gl.SliceLayout(1, s.type.layout)
    p = gl.exp2(s * qk_scale_log2 - gl.expand_dims(lse_log2, 1))
    last_key = first_key + KEYS - 1
    if len(window) > 0:
        offset = seqlen_k - seqlen_q
        # the first row's last visible key, the last row's first
        if (last_key >= seqlen_k) | (last_key > m_start + offset + window[1]) | (
                first_key < m_start + ROWS - 1 + offset - window[0]):
            # [ROWS] each row's position on the keys, counted from first_key
            aligned = m_start + gl.arange(0, ROWS, row_layout) + offset - first_key
            row_last = gl.minimum(aligned + window[1], seqlen_k - 1 - first_key)
            # [ROWS, KEYS]
            columns = gl.expand_dims(gl.arange(0, KEYS, gl.SliceLayout(0, s.type.layout)), 0)
            visible = (columns <= gl.expand_dims(row_last, 1)) & (columns >= gl.expand_dims(aligned - window[0], 1))
            p = gl.where(visible, p, 0.0)
    elif (last_key >= seqlen_k) | ((causal != 0) & (last_key > m_start + (seqlen_k - seqlen_q))):
        # [ROWS] each row's last visible key, counted from first_key
        row_last = gl.full([ROWS], seqlen_k - 1 - first_key, gl.int32, row_layout)
        if causal != 0:
            diagonal = m_start + gl.arange(0, ROWS, row_layout) + (seqlen_k - seqlen_q) - first_key
            row_last = gl.minimum(row_last, diagonal)
        # [ROWS, KEYS]
        visible = (gl.expand_dims(gl.arange(0, KEYS, gl.SliceLayout(0, s.type.layout)), 0)
                   <= gl.expand_dims(row_last, 1))
        p = gl.where(visible, p, 0.0)
    return p

"""Gluon helpers shared by the Hopper kernels (fwd.py, bwd.py, bwd_d256.py, bwd_dq.py): launch-order scheduling, the
barrier arrival after wgmmas, and the backward's key-block schedule, producer, probabilities and row stores, which the
backward kernels share."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .. import common as _triton_common

# kernels/common's launch-order, key- and query-block-range and row-range helpers (plain integer arithmetic)
# compiled as Gluon functions: the Gluon kernels take them from the same code as the Triton kernels
grouped_tile_of = gluon.jit(_triton_common.grouped_tile_of.fn)
q_block_range = gluon.jit(_triton_common.q_block_range.fn)
kv_block_range = gluon.jit(_triton_common.kv_block_range.fn)
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
                   batch, head_k, first_row, feature0, seqlen_k, head_dim, aligned, softmax_scale):
    """Store dk * softmax_scale and dv ([KEY_ROWS, FEATURES] fp32 accumulators) into key rows [first_row, +
    KEY_ROWS) below seqlen_k and features [feature0, + FEATURES) below head_dim of DK and DV (store_rows)."""
    store_rows(dk * softmax_scale, DK, stride_dk_b, stride_dk_n, stride_dk_h, batch, head_k, first_row, feature0,
               seqlen_k, head_dim, aligned)
    store_rows(dv, DV, stride_dv_b, stride_dv_n, stride_dv_h, batch, head_k, first_row, feature0, seqlen_k, head_dim,
               aligned)


@gluon.jit
def store_rows(values, Out, stride_b, stride_n, stride_h, batch, head, first_row, feature0, seqlen, head_dim,
               aligned):
    """Store values ([ROWS, FEATURES] fp32, any layout) into rows [first_row, + ROWS) below seqlen and features
    [feature0, + FEATURES) below head_dim (Out's own, where the tiles are wider) of Out (B, S, H, D) at (batch,
    head), in Out's dtype. The rows go out in 16-byte pieces (a blocked layout, converted through shared memory):
    stored straight from the wgmma layout, every 32-byte sector would be written in two halves. aligned: (0, ) where
    Out's address and strides but the last are multiples of 16 bytes and head_dim one of a piece (ops/hopper.
    aligned_rows): the compiler is told so (partition arguments carry no alignment) and the feature mask is taken
    per piece, so that each piece is one 16-byte store; () otherwise: 2-byte stores."""
    ROWS: gl.constexpr = values.shape[0]
    FEATURES: gl.constexpr = values.shape[1]
    dtype: gl.constexpr = Out.dtype.element_ty
    VECTOR: gl.constexpr = 16 // (dtype.primitive_bitwidth // 8)
    ROW_THREADS: gl.constexpr = 32 // (FEATURES // VECTOR)
    layout: gl.constexpr = gl.BlockedLayout([1, VECTOR], [ROW_THREADS, FEATURES // VECTOR], [gl.num_warps(), 1],
                                            [1, 0])
    # [ROWS] rows, [FEATURES] features
    rows = first_row + gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    features = feature0 + gl.arange(0, FEATURES, gl.SliceLayout(0, layout))
    ptrs = (Out + batch.to(gl.int64) * stride_b + head.to(gl.int64) * stride_h
            + gl.expand_dims(rows.to(gl.int64) * stride_n, 1) + gl.expand_dims(features, 0))
    if len(aligned) > 0:
        # a piece's features are all below head_dim or none is (head_dim is a multiple of VECTOR)
        stored = (features // VECTOR) * VECTOR < head_dim
        ptrs = gl.max_contiguous(gl.multiple_of(ptrs, [1, 16]), [1, VECTOR])
    else:
        stored = features < head_dim
    store_mask = gl.expand_dims(rows < seqlen, 1) & gl.expand_dims(stored, 0)
    gl.store(ptrs, gl.convert_layout(values.to(dtype), layout), mask=store_mask)


@gluon.constexpr_function
def chunks_bytes(chunks):
    """Bytes of one entry of every chunk's shared allocation (chunks: [N, ..., WIDTH] allocations of one entry
    shape each)."""
    total = 0
    for chunk in chunks:
        elements = 1
        for size in list(chunk.shape)[1:]:
            elements *= int(getattr(size, "value", size))
        total += elements * chunk.dtype.primitive_bitwidth // 8
    return total


@gluon.jit
def copy_pieces(descs, tiles, batch, row, head, ready):
    """TMA copies of a head dim's pieces (descs: a descriptor per piece; tiles: [1, ROWS, 1, WIDTH] shared tiles, one
    per piece) at (batch, row, head), piece j from column sum(widths before j), all landing on ready."""
    column = 0
    for piece in gl.static_range(len(descs)):
        tma.async_copy_global_to_shared(descs[piece], [batch, row, head, column], ready, tiles[piece])
        column = column + tiles[piece].shape[3]


@gluon.jit
def entries_of(pieces, index):
    """Entry `index` of every piece's allocation ([N, ...] each)."""
    entries = ()
    for piece in gl.static_range(len(pieces)):
        entries = entries + (pieces[piece].index(index), )
    return entries


@gluon.constexpr_function
def chunks_width(chunks):
    """The head dim a tuple of chunks covers (shared allocations or tensors): their last dims summed."""
    return sum(int(getattr(chunk.shape[-1], "value", chunk.shape[-1])) for chunk in chunks)


@gluon.jit
def matrices_of(tiles):
    """[1, ROWS, 1, WIDTH] tiles (one per chunk) as [ROWS, WIDTH] matrices, the wgmmas' operands."""
    matrices = ()
    for chunk in gl.static_range(len(tiles)):
        matrices = matrices + (tiles[chunk].reshape([tiles[chunk].shape[1], tiles[chunk].shape[3]]), )
    return matrices


@gluon.jit
def chained_products(a, b, zero):
    """A B^T [M, N] over a head dim's chunks (a: [M, WIDTH] per chunk, b: [N, WIDTH] per chunk, shared), one wgmma
    per chunk chained on one accumulator (zero: [M, N] in its layout); issued, not waited for."""
    product = warpgroup_mma(a[0], b[0].permute((1, 0)), zero, use_acc=False, is_async=True)
    for chunk in gl.static_range(1, len(a)):
        product = warpgroup_mma(a[chunk], b[chunk].permute((1, 0)), product, is_async=True)
    return product


@gluon.jit
def accumulate_products(a, b, accumulators):
    """accumulators[c] += A B_c per chunk (a: [M, K] shared; b: [K, WIDTH] per chunk, shared; accumulators: [M, WIDTH]
    per chunk); issued, not waited for."""
    products = ()
    for chunk in gl.static_range(len(b)):
        products = products + (warpgroup_mma(a, b[chunk], accumulators[chunk], is_async=True), )
    return products


@gluon.jit
def accumulate_register_products(a, b, accumulators):
    """accumulators[c] += A B_c per chunk (a: [M, K] in registers, made the A operand of each chunk's wgmma; b:
    [K, WIDTH] per chunk, shared; accumulators: [M, WIDTH] per chunk); issued, not waited for."""
    products = ()
    for chunk in gl.static_range(len(b)):
        operand = gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=accumulators[chunk].type.layout,
                                                           k_width=2))
        products = products + (warpgroup_mma(operand, b[chunk], accumulators[chunk], is_async=True), )
    return products


@gluon.jit
def wait_products(products):
    """Every wgmma of the warpgroup waited for; the chunks' accumulators (a tuple, also for one chunk)."""
    if len(products) == 1:
        return (warpgroup_mma_wait(0, deps=products), )
    else:
        return warpgroup_mma_wait(0, deps=products)


@gluon.jit
def wait_accumulators(first, second):
    """Both tuples of accumulators (one per chunk each) waited for: every wgmma of this warpgroup completed."""
    if len(first) == 1:
        first, second = warpgroup_mma_wait(0, deps=(first[0], second[0]))
        return (first, ), (second, )
    else:
        gl.static_assert(len(first) == 2, "one or two chunks")
        a, b, c, d = warpgroup_mma_wait(0, deps=(first[0], first[1], second[0], second[1]))
        return (a, b), (c, d)


@gluon.jit
def zero_accumulators(M: gl.constexpr, widths_of):
    """Zero fp32 accumulators [M, WIDTH] in the wgmma layout of their width, one per chunk (widths_of: a tuple of
    tensors or shared views whose last dims are the chunks' widths)."""
    zeros = ()
    for chunk in gl.static_range(len(widths_of)):
        zeros = zeros + (_zero_accumulator(M, widths_of[chunk]), )
    return zeros


@gluon.jit
def _zero_accumulator(M: gl.constexpr, width_of):
    WIDTH: gl.constexpr = width_of.shape[len(width_of.shape) - 1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, WIDTH, 16])
    # [M, WIDTH]
    return gl.zeros([M, WIDTH], gl.float32, layout)


@gluon.jit
def chunk_descriptors(first, second):
    """A tensor's descriptors by chunk of its head dim: (first, ), or (first, second) where a second chunk exists."""
    if second is None:
        return (first, )
    else:
        return (first, second)


@gluon.jit
def allocate_chunks(descs, entries: gl.constexpr, rows: gl.constexpr = 0):
    """Shared memory for `entries` tiles of every chunk's descriptor (descs): [entries] + the descriptor's block
    shape each, or with `rows` rows (dim 1 of a [1, rows, 1, WIDTH] block; 0: the block's) for tiles that several
    boxes fill."""
    chunks = ()
    for chunk in gl.static_range(len(descs)):
        chunks = chunks + (gl.allocate_shared_memory(descs[chunk].dtype,
                                                     _tiles_shape(entries, descs[chunk].block_type.shape, rows),
                                                     descs[chunk].layout), )
    return chunks


@gluon.constexpr_function
def _tiles_shape(entries, block_shape, rows):
    """[entries] + block_shape, with dim 1 of the block `rows` where rows is not 0 (allocate_chunks)."""
    shape = [int(getattr(size, "value", size)) for size in block_shape]
    rows = int(getattr(rows, "value", rows))
    if rows:
        shape[1] = rows
    return [int(getattr(entries, "value", entries))] + shape


@gluon.jit
def key_rows(chunks, first, count: gl.constexpr, ROW_DIM: gl.constexpr = 0):
    """Rows [first, + count) of every chunk ([KEYS, WIDTH] each, or rows along ROW_DIM: [1, KEYS, 1, WIDTH] tiles
    with ROW_DIM 1)."""
    rows = ()
    for chunk in gl.static_range(len(chunks)):
        rows = rows + (chunks[chunk].slice(first, count, dim=ROW_DIM), )
    return rows


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
def sequence_descriptors(descs, base, start, length):
    """sequence_descriptor of every piece's descriptor (descs: a tuple)."""
    made = ()
    for piece in gl.static_range(len(descs)):
        made = made + (sequence_descriptor(descs[piece], base, start, length), )
    return made


@gluon.jit
def backward_producer(k_descs, v_descs, q_descs, do_descs, lse_desc, delta_desc, k_pieces, v_pieces, q_pieces,
                      do_pieces, lse_smem, delta_smem, kv_ready, q_ready, q_empty, batch, head_k, n_start, num_heads,
                      group_size, m_block_lo, blocks_per_head, n_iterations, first_visit, q_start, load_kv, sequence):
    """One warp: the key block's K and V once, then Q_i, dO_i and their rows' log2(e) * lse and delta of every
    iteration (loop_position(i)) into stage i % STAGES. Every tensor moves in feature pieces (a descriptor and a
    shared allocation per piece: k_pieces / v_pieces [1, 1, KEYS, 1, WIDTH], q_pieces / do_pieces [STAGES, 1, ROWS,
    1, WIDTH]; piece j holds the features from the widths before it on): one piece at head dims 64 and 128, two
    column chunks at 80 and 96 (configs.HOPPER_BWD_CHUNKS), Q / dO in two 128-wide halves at 256. batch: the
    descriptors' batch coordinate; q_start: the sequence's first row in the lse / delta matrices (a varlen call's; 0
    for a dense one). load_kv 0: the key block holds none of its sequence's keys (a varlen call's block past them):
    kv_ready completes without a load. sequence: () for a dense call; a varlen call's (Q, dO, K, V base pointers,
    q_start, seqlen_q, k_start, seqlen_k, LSE, DELTA, lse_row_stride, delta_row_stride): this warp makes the
    sequence's own descriptors (sequence_descriptors) before its first load (a descriptor made in the kernel is
    visible only to the threads whose TMA loads read it after the fence that ends its making, so the partition that
    loads makes them), and copies the rows' lse and delta from the (H, T) matrices LSE and DELTA with plain loads
    (row_statistics): a sequence's rows start anywhere, and a TMA load's innermost coordinate must be 16-byte
    aligned (an unaligned one is an illegal instruction). Those loads run one iteration ahead: the rows of iteration
    i + 1 load while stage i's copies run and stage i + 1 frees, so the warp never waits on them before a TMA issue."""
    ROWS: gl.constexpr = q_pieces[0].shape[2]
    STAGES: gl.constexpr = q_pieces[0].shape[0]
    if len(sequence) > 0:
        q_descs = sequence_descriptors(q_descs, sequence[0], sequence[4], sequence[5])
        do_descs = sequence_descriptors(do_descs, sequence[1], sequence[4], sequence[5])
        k_descs = sequence_descriptors(k_descs, sequence[2], sequence[6], sequence[7])
        v_descs = sequence_descriptors(v_descs, sequence[3], sequence[6], sequence[7])
    if load_kv != 0:
        mbarrier.expect(kv_ready, chunks_bytes(k_pieces) + chunks_bytes(v_pieces))
        copy_pieces(k_descs, entries_of(k_pieces, 0), batch, n_start, head_k, kv_ready)
        copy_pieces(v_descs, entries_of(v_pieces, 0), batch, n_start, head_k, kv_ready)
    else:
        mbarrier.arrive(kv_ready)
    if len(sequence) > 0:
        # ([ROWS], [ROWS]) lse and delta of the next iteration's rows (the first's here), loads in flight
        statistics = row_statistics(sequence, 0, first_visit, n_iterations, blocks_per_head, m_block_lo, head_k,
                                    group_size, q_start, ROWS)
    for i in range(n_iterations):
        stage = i % STAGES
        mbarrier.wait(q_empty.index(stage), ((i // STAGES) - 1) & 1, pred=i >= STAGES)
        head, m_start = query_block(loop_position(i, first_visit, n_iterations), blocks_per_head, m_block_lo,
                                    head_k, group_size, ROWS)
        if len(sequence) > 0:
            lse_smem.index(stage).reshape([ROWS]).store(statistics[0])
            delta_smem.index(stage).reshape([ROWS]).store(statistics[1])
            # the plain stores above come before this arrival (Triton's barrier pass puts a warp barrier between)
            mbarrier.expect(q_ready.index(stage), chunks_bytes(q_pieces) + chunks_bytes(do_pieces))
        else:
            mbarrier.expect(q_ready.index(stage), chunks_bytes(q_pieces) + chunks_bytes(do_pieces) + 2 * ROWS * 4)
        copy_pieces(q_descs, entries_of(q_pieces, stage), batch, m_start, head, q_ready.index(stage))
        copy_pieces(do_descs, entries_of(do_pieces, stage), batch, m_start, head, q_ready.index(stage))
        if len(sequence) == 0:
            row = batch * num_heads + head
            tma.async_copy_global_to_shared(lse_desc, [row, m_start], q_ready.index(stage), lse_smem.index(stage))
            tma.async_copy_global_to_shared(delta_desc, [row, m_start], q_ready.index(stage), delta_smem.index(stage))
        else:
            statistics = row_statistics(sequence, i + 1, first_visit, n_iterations, blocks_per_head, m_block_lo,
                                        head_k, group_size, q_start, ROWS)


@gluon.jit
def row_statistics(sequence, i, first_visit, n_iterations, blocks_per_head, m_block_lo, head_k, group_size, q_start,
                   ROWS: gl.constexpr):
    """([ROWS], [ROWS]) one warp's plain loads of the lse and delta rows of a varlen program's iteration i (the
    position after the last wraps to the first; none without iterations) from the (H, T) fp32 matrices of
    backward_producer's `sequence` (the sequence from column q_start); rows past its seqlen_q get 0, as a dense
    call's rows past its end do."""
    layout: gl.constexpr = gl.BlockedLayout([ROWS // 32], [32], [1], [0])
    head, m_start = query_block(loop_position(i, first_visit, gl.maximum(n_iterations, 1)),
                                gl.maximum(blocks_per_head, 1), m_block_lo, head_k, group_size, ROWS)
    # [ROWS] rows of the block
    rows = m_start + gl.arange(0, ROWS, layout)
    mask = (rows < sequence[5]) & (n_iterations > 0)
    lse = gl.load(sequence[8] + head.to(gl.int64) * sequence[10] + q_start + rows, mask=mask, other=0.0)
    delta = gl.load(sequence[9] + head.to(gl.int64) * sequence[11] + q_start + rows, mask=mask, other=0.0)
    return lse, delta


@gluon.jit
def alibi_bias(s, alibi, first_key, m_start, seqlen_q, seqlen_k, KEY_AXIS: gl.constexpr):
    """Like s (scores of query rows from m_start and keys from first_key, keys along KEY_AXIS): the ALiBi bias in
    log2 units, kernels/common.alibi_bias_log2's: -slope_log2 * |row + seqlen_k - seqlen_q - key|, or -slope_log2 *
    -key in FA2's pure-causal configuration (alibi: (slope_log2, alibi_pure_causal)). The distances come from each
    row's position on the keys counted from first_key (an opaque copy: the pure-causal one does not move with
    m_start, and LLVM would hoist its tile out of the caller's loop) and the keys' offsets in the block as key // 8
    * 8 + key % 8."""
    ROW_AXIS: gl.constexpr = 1 - KEY_AXIS
    ROWS: gl.constexpr = s.shape[ROW_AXIS]
    KEYS: gl.constexpr = s.shape[KEY_AXIS]
    rows = gl.arange(0, ROWS, gl.SliceLayout(KEY_AXIS, s.type.layout))
    # [ROWS] each row's position on the keys counted from first_key, or -first_key (pure causal)
    row_base = gl.where(alibi[1] != 0, rows * 0 - first_key, m_start + rows + (seqlen_k - seqlen_q) - first_key)
    row_base = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [row_base], dtype=gl.int32, is_pure=True, pack=1)
    keys = gl.arange(0, KEYS, gl.SliceLayout(ROW_AXIS, s.type.layout))
    # like s: |row - key|, or -key
    difference = ((gl.expand_dims(row_base, KEY_AXIS) - gl.expand_dims(keys // 8 * 8, ROW_AXIS))
                  - gl.expand_dims(keys % 8, ROW_AXIS))
    distance = gl.where(alibi[1] != 0, difference, gl.abs(difference))
    return -alibi[0] * distance.to(gl.float32)


@gluon.jit
def capped_logits(s, softcap):
    """Scores s (fp32) to log2-domain logits under softcap (softcap_in_scale, softcap_out_log2): softcap_out_log2 *
    tanh(s * softcap_in_scale), tanh from exp2 as kernels/common.tanh computes it; and like s, the derivative's
    factor 1 - tanh^2 that dS takes (kernels/bwd.py's)."""
    t = 1.0 - 2.0 / (gl.exp2(s * (softcap[0] * 2.8853900817779268)) + 1.0)
    return t * softcap[1], 1.0 - t * t


@gluon.jit
def masked_probabilities(s, lse_log2, qk_scale_log2, first_key, m_start, seqlen_q, seqlen_k, causal, window,
                         KEY_AXIS: gl.constexpr, alibi, softcap):
    """P = exp2(s * qk_scale_log2 - lse_log2) of scores s (query rows from m_start, keys from first_key; [ROWS, KEYS],
    or [KEYS, ROWS] with KEY_AXIS 0: the transposed scores K Q^T), 0 where a key is past seqlen_k or, causal
    (bottom-right aligned), after the row's last key, or outside the row's local window (window: (window_left,
    window_right), or ()); blocks that need none of it come back without mask arithmetic. lse_log2: [ROWS] along
    s's row axis. One comparison per element against each row's last visible key, and nothing kept live across the
    caller's loop (key vectors held across it would spill ~40 registers of the d128 causal consumers). Query rows
    past seqlen_q are not masked: their Q, dO, lse and delta read as zeros, so P = 1 there but dS = 0 and dO = 0,
    and every product they enter adds zeros (with ALiBi P is at most 1, see below). Keys past seqlen_k are (their
    K rows are zeros, so P would be exp2(-lse_log2), which may overflow). alibi: () or (slope_log2 of the rows'
    head, alibi_pure_causal): the logits get kernels/common.alibi_bias_log2's bias (alibi_bias). softcap: () or
    (softcap_in_scale, softcap_out_log2): the logits are capped first (capped_logits). Returns (P, () or, with
    softcap, like s the factor 1 - tanh^2)."""
    ROW_AXIS: gl.constexpr = 1 - KEY_AXIS
    ROWS: gl.constexpr = s.shape[ROW_AXIS]
    KEYS: gl.constexpr = s.shape[KEY_AXIS]
    # [ROWS] a value per query row; [KEYS] a value per key
    row_layout: gl.constexpr = gl.SliceLayout(KEY_AXIS, s.type.layout)
    key_layout: gl.constexpr = gl.SliceLayout(ROW_AXIS, s.type.layout)
    if len(softcap) > 0:
        logits, tanh_factor = capped_logits(s, softcap)
    else:
        logits = s * qk_scale_log2
        tanh_factor = ()
    if len(alibi) > 0:
        logits = logits + alibi_bias(s, alibi, first_key, m_start, seqlen_q, seqlen_k, KEY_AXIS)
    exponent = logits - gl.expand_dims(lse_log2, KEY_AXIS)
    if len(alibi) > 0:
        # at most 0 (P <= 1): rows past seqlen_q read lse 0, and FA2's pure-causal bias grows with the key (2^150 and
        # more is inf, and inf * their zero dO is NaN); a visible key's exponent exceeds 0 by rounding only
        exponent = gl.minimum(exponent, 0.0)
    p = gl.exp2(exponent)
    last_key = first_key + KEYS - 1
    if len(window) > 0:
        offset = seqlen_k - seqlen_q
        # the first row's last visible key, the last row's first
        if (last_key >= seqlen_k) | (last_key > m_start + offset + window[1]) | (
                first_key < m_start + ROWS - 1 + offset - window[0]):
            # [ROWS] each row's position on the keys, counted from first_key
            aligned = m_start + gl.arange(0, ROWS, row_layout) + offset - first_key
            row_last = gl.minimum(aligned + window[1], seqlen_k - 1 - first_key)
            # like s: each key's position in the block
            keys = gl.expand_dims(gl.arange(0, KEYS, key_layout), ROW_AXIS)
            visible = (keys <= gl.expand_dims(row_last, KEY_AXIS)) & (
                keys >= gl.expand_dims(aligned - window[0], KEY_AXIS))
            p = gl.where(visible, p, 0.0)
    elif (last_key >= seqlen_k) | ((causal != 0) & (last_key > m_start + (seqlen_k - seqlen_q))):
        # [ROWS] each row's last visible key, counted from first_key
        row_last = gl.full([ROWS], seqlen_k - 1 - first_key, gl.int32, row_layout)
        if causal != 0:
            diagonal = m_start + gl.arange(0, ROWS, row_layout) + (seqlen_k - seqlen_q) - first_key
            row_last = gl.minimum(row_last, diagonal)
        # like s
        visible = gl.expand_dims(gl.arange(0, KEYS, key_layout), ROW_AXIS) <= gl.expand_dims(row_last, KEY_AXIS)
        p = gl.where(visible, p, 0.0)
    return p, tanh_factor

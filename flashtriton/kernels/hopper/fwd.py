"""Prefill forward for Hopper (sm_90) in Gluon, warp-specialized: a one-warp TMA producer feeds K/V stages to two or
three consumer warpgroups (configs.HopperFwdConfig.consumers: three for non-causal head dim 64), each owning 64 query
rows of a 128- (192-) row tile. The consumers share the stages and run out of phase with each other, so one's
softmax overlaps another's wgmma (what the Triton kernel cannot schedule).

Scope (ops/hopper.gluon_runs decides): dense (B, S, H, D) bf16/fp16 tensors addressed by host tensor descriptors, tiles
of the head dims in configs.HOPPER_FWD_CHUNKS (64, 80, 96, 128, 192, 256; tiles whose width is no power of two move
in two chunks of columns; head dims between run on the next wider tiles: the descriptors read the missing columns as
zeros and store only out's own; V and O may have tiles of another width than Q and K: V's own head dim), GQA, any window
(causal, or local: LOCAL; bottom-right aligned), positive softmax scale, ALiBi (causal-like calls), no softcap or
dropout; everything else runs kernels/fwd.py. Numerics are those of kernels/fwd.py: fp32 scores and accumulators, P
rounded to V's dtype, natural-log LSE, +inf for rows that see no key; the A-1 rescale skip (max lagging) where
configs.HOPPER_FWD has a rescale_threshold, decided per warp (fwd_softmax.rescale).

Work: the grid's programs take work items in turn, p, p + P, p + 2P, ... (ops/hopper.forward_grid sizes the grid:
one program per item, or persistent: as many as fit the GPU at once); a persistent varlen grid's tiles differ in
length, so there each program takes the next untaken tile from a counter instead (the dynamic schedule). An item is
one tile, or for persistent causal grids a pair of tiles (the longest and the shortest left) so that every item has
the same number of key blocks. Where configs.HopperFwdConfig.split_tail says, the items of a persistent grid's last,
partial wave (the tail) are cut by key blocks evenly among all programs (stream-K style, next_piece): a piece short
of its tile writes its normalized partial output and LSE to a workspace, and attn_tail_merge_kernel merges them by
LSE weights after the kernel. The producer loads the next tile's Q and K/V blocks while the consumers finish the
current one (their last wgmmas, normalization, O store). A tile's key blocks are visited from the last to the first
(FA2's order): the blocks that can need a mask come first, so non-causal kernels mask only the first one visited and
their key-block loop holds no mask code (_key_blocks).

Synchronisation: q_ready[c] completes when consumer c's Q tile has landed, q_empty[c] when consumer c no longer
reads it (after its last S wgmma; where O is staged in the Q tile, after O's store). k_ready[s] / v_ready[s]
complete when stage s's K / V tile has landed (TMA transaction bytes); k_empty[s] / v_empty[s] when all consumers
are done with stage s's K / V tile (one arrival per consumer warpgroup, by one thread without a warpgroup barrier:
common.arrive_after_wgmma), so the producer refills K before V is free. The program's loads are numbered across
its items: load l goes to stage l % STAGES and is the (l // STAGES)-th use of that stage, whose parity the waits
check; the program's i-th tile's Q tiles are the i-th use of q_ready / q_empty.

Consumer schedule (FA3's intra-warpgroup pipelining): S_j and P_{j-1} V_{j-1} are issued together, the softmax of
block j runs while P_{j-1} V_{j-1} is on the tensor cores, and the output rescale waits for it. In the binary the
softmax runs under P V only where configs.HOPPER_FWD holds the schedule (fwd_softmax.hold_schedule; ptxas otherwise
waits for P V first: tools/offline_compile.exp2_before_pv_wait). With ping-pong (config, on at head dim 128; two consumers
only) the two also take turns issuing those wgmmas, so that one's softmax runs while the other's products do
(_wait_turn).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma_wait

from .common import accumulate_register_products, allocate_chunks, arrive_after_wgmma, chained_products, \
    chunk_descriptors, chunks_bytes, chunks_width, copy_pieces, entries_of, key_rows, matrices_of, wait_products, \
    zero_accumulators
from .dropout import draw_words, dropout_key, kept_operand, row_draws
from .fwd_softmax import hold_schedule, logits, mask_block, mask_local, operand_of, reciprocal, rescale, softmax_block
from .schedule import block_rows, first_cursor, mask_absent_page, more_work, next_piece, page_presence, sequence_pages

SHARED_BYTES_FOR_TILES = gl.constexpr(220 * 1024)  # sm_90: 227 KiB per program, less barriers and the compiler's
CONSUMER_ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (one wgmma M tile); a tile has one per consumer


@gluon.jit
def _copy_out(descs, tiles, batch, row, head):
    """TMA stores of [1, ROWS, 1, WIDTH] tiles (one per chunk, common.copy_pieces' columns) at (batch, row, head)."""
    column = 0
    for chunk in gl.static_range(len(descs)):
        tma.async_copy_shared_to_global(descs[chunk], [batch, row, head, column], tiles[chunk])
        column = column + tiles[chunk].shape[3]


@gluon.jit
def _load_stage(descs, smem, ready, empty, load, batch, rows, head_k):
    """The producer's load number `load` of K or V (descs, smem: per chunk of the head dim, [STAGES, 1, BLOCK_N, 1,
    WIDTH]): the key block whose pieces start at `rows` (schedule.block_rows: one row, or a paged block's pieces of
    BLOCK_N / len(rows) rows each, the descriptors' box) into stage load % STAGES once every consumer released that
    stage's previous tile, landing on ready (TMA transaction bytes)."""
    STAGES: gl.constexpr = smem[0].shape[0]
    stage = load % STAGES
    mbarrier.wait(empty.index(stage), ((load // STAGES) - 1) & 1, pred=load >= STAGES)
    mbarrier.expect(ready.index(stage), chunks_bytes(smem))
    tiles = entries_of(smem, stage)
    if len(rows) == 1:
        copy_pieces(descs, tiles, batch, rows[0], head_k, ready.index(stage))
    else:
        PIECE: gl.constexpr = smem[0].shape[2] // len(rows)
        for piece in gl.static_range(len(rows)):
            copy_pieces(descs, key_rows(tiles, piece * PIECE, PIECE, 1), batch, rows[piece], head_k,
                        ready.index(stage))


@gluon.jit
def _load_key_block(k_descs, v_descs, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, load, batch, rows,
                    head_k):
    """K, then V, of the key block whose pieces start at `rows` as the producer's load number `load` (_load_stage)."""
    _load_stage(k_descs, k_smem, k_ready, k_empty, load, batch, rows, head_k)
    _load_stage(v_descs, v_smem, v_ready, v_empty, load, batch, rows, head_k)


@gluon.jit
def _producer(q_descs, k_descs, v_descs, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
              v_empty, group_size, tail, work, pages, dynamic):
    """One warp, per tile of this program's work items: K of the tile's first key block, the consumers' Q tiles (q_smem
    per chunk of the head dim: [CONSUMERS, 1, ROWS, 1, WIDTH]) once each consumer released its previous one, then V of
    the first block and K and V of the others; the program's load number l (counted across tiles) goes to stage l %
    STAGES once every consumer freed that stage's K (resp. V). The first K goes ahead of Q: its stage is free once the
    consumers' second-to-last S of the previous tile is done, Q's only after their last (loaded after Q, the first K
    would wait for both consumers' last S, and the tile's first S for its landing). Varlen tiles past their
    sequence's end (no key block) are skipped, by the consumers too. pages: () or the paged pool's group
    (schedule.sequence_pages): each block's rows come from its page or pages (schedule.block_rows). dynamic: () or
    (item counter, ids) (varlen tiles, one per item, no tail): after its own first item the program takes the next
    one nobody has taken (an atomic increment of the zeroed counter), and hands each tile's item id to the consumers
    in ids[done % 2] with their Q tiles (_published_item); -1 after the last."""
    CONSUMERS: gl.constexpr = q_smem[0].shape[0]
    ROWS: gl.constexpr = q_smem[0].shape[2]
    BLOCK_N: gl.constexpr = k_smem[0].shape[2]
    load = 0
    done = 0
    item, which, x_start, x_end = first_cursor(tail)
    x = x_start
    # [1] an item id, the warp's copy
    id_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    while more_work(item, x, x_end, tail):
        current = item
        batch, head, m_start, top, count, slot, item, which, x, bounds = next_piece(item, which, x, x_start, x_end,
                                                                                    tail, work, CONSUMERS * ROWS,
                                                                                    BLOCK_N)
        if len(dynamic) > 0:
            item = gl.atomic_add(dynamic[0], 1) + gl.num_programs(0)
        if count > 0:
            if len(dynamic) > 0:
                # the consumers read it once the tile's Q landed: ids[done % 2] was last read two tiles ago, before
                # the Q tiles this warp has since waited to be freed
                dynamic[1].index(done % 2).store(gl.full([1], current, gl.int32, id_layout))
            _, _, q_start, k_start, desc_batch = bounds
            head_k = head // group_size
            row_pages = sequence_pages(pages, batch)
            # key blocks from the piece's last to its first (_key_blocks)
            top_rows = block_rows(row_pages, k_start, top, BLOCK_N)
            _load_stage(k_descs, k_smem, k_ready, k_empty, load, desc_batch, top_rows, head_k)
            for consumer in gl.static_range(CONSUMERS):
                mbarrier.wait(q_empty.index(consumer), (done - 1) & 1, pred=done > 0)
                mbarrier.expect(q_ready.index(consumer), chunks_bytes(q_smem))
                copy_pieces(q_descs, entries_of(q_smem, consumer), desc_batch, q_start + m_start + consumer * ROWS,
                            head, q_ready.index(consumer))
            _load_stage(v_descs, v_smem, v_ready, v_empty, load, desc_batch, top_rows, head_k)
            for j in range(1, count):
                _load_key_block(k_descs, v_descs, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, load + j,
                                desc_batch, block_rows(row_pages, k_start, top - j, BLOCK_N), head_k)
            load += count
            done += 1
    if len(dynamic) > 0:
        dynamic[1].index(done % 2).store(gl.full([1], -1, gl.int32, id_layout))
        for consumer in gl.static_range(CONSUMERS):
            mbarrier.wait(q_empty.index(consumer), (done - 1) & 1, pred=done > 0)
            mbarrier.arrive(q_ready.index(consumer))


@gluon.jit
def _published_item(q_ready, ids, done):
    """The item id of this consumer's tile number `done` (its Q tile's barrier q_ready; -1: no more tiles), as the
    producer hands it over with a dynamic schedule."""
    # [1] the id, each warpgroup thread's copy
    id_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    mbarrier.wait(q_ready, done & 1)
    return gl.max(ids.index(done % 2).load(id_layout), 0)


@gluon.jit
def _wait_turn(turns, step, lead):
    """Ping-pong between the consumers (turns: (this consumer's barrier, the other's), or () without it): before its
    step-th issue of wgmmas (steps counted across the program's tiles) a consumer waits until the other one has
    issued its own wgmmas of the step before (lead = 1: the first consumer, which goes first) or of the same step
    (lead = 0), so that the two issue in alternation and one's softmax runs while the other's wgmmas do (FA3's
    warp-scheduler barrier); after issuing, it arrives on the other's (_pass_turn). Constexprs do not reach
    partitions in Triton 3.6, a tuple's length does: without ping-pong no code is left."""
    for _ in gl.static_range(len(turns) // 2):
        mbarrier.wait(turns[0], (step - lead) & 1, pred=step >= lead)


@gluon.jit
def _pass_turn(turns):
    for _ in gl.static_range(len(turns) // 2):
        arrive_after_wgmma(turns[1])


@gluon.jit
def _clear_rows_past(v_stage, valid_rows):
    """Zero the rows from valid_rows on of a V stage (v_stage: [BLOCK_N, WIDTH] per chunk of V's head dim, shared
    memory) and make the stores visible to the wgmmas (async proxy) of the whole warpgroup. A varlen sequence's last
    key block reads past its end: the next sequence's rows, or whatever lies past the last one (garbage, NaN). Its
    scores are masked to -inf, so P is 0 there, but 0 * NaN in P V is NaN: such rows must hold zeros. Both consumers
    clear the stage they share; they write the same values."""
    for chunk in gl.static_range(len(v_stage)):
        _clear_chunk_rows_past(v_stage[chunk], valid_rows)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _clear_chunk_rows_past(v_chunk, valid_rows):
    """_clear_rows_past on one chunk v_chunk [BLOCK_N, WIDTH], 16 rows at a time."""
    BLOCK_N: gl.constexpr = v_chunk.shape[0]
    WIDTH: gl.constexpr = v_chunk.shape[1]
    CHUNK_ROWS: gl.constexpr = 16
    # 8 elements (16 bytes) per thread and row, the warpgroup's 128 threads over [CHUNK_ROWS, WIDTH] (narrow chunks
    # hold some rows in more than one thread: they store the same values)
    THREADS_PER_ROW: gl.constexpr = WIDTH // 8 if WIDTH // 8 < 32 else 32
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // THREADS_PER_ROW, THREADS_PER_ROW], [4, 1], [1, 0])
    for step in gl.static_range(BLOCK_N // CHUNK_ROWS):
        if (step + 1) * CHUNK_ROWS > valid_rows:
            rows = v_chunk.slice(step * CHUNK_ROWS, CHUNK_ROWS, dim=0)
            # [CHUNK_ROWS, WIDTH] the rows' values, those from valid_rows on zeroed
            values = rows.load(layout)
            row = step * CHUNK_ROWS + gl.arange(0, CHUNK_ROWS, gl.SliceLayout(1, layout))
            rows.store(gl.where(gl.expand_dims(row < valid_rows, 1), values, gl.zeros_like(values)))


@gluon.jit
def _rescale_chunks(acc, alpha, lag):
    """fwd_softmax.rescale on every chunk of the output."""
    scaled = ()
    for chunk in gl.static_range(len(acc)):
        scaled = scaled + (rescale(acc[chunk], alpha, lag), )
    return scaled


@gluon.jit
def _key_blocks(q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, q_free, release_q, first_load, top, count,
                row0, offs_m, seqlen_q, seqlen_k, qk_scale_log2, alibi, causal, window, turns, lead, fences, lag,
                residues, clear_v, draws, row_pages):
    """One consumer's pass over a work item's key blocks (the program's loads first_load, first_load + 1, ...) for its
    Q tile q ([ROWS, WIDTH] per chunk of the head dim, shared memory; k_smem and v_smem [STAGES, 1, BLOCK_N, 1, WIDTH]
    per chunk of their head dims): `count` key blocks from block `top` down (step j visits block top - j; a whole
    tile's top is its last block). Only blocks crossing seqlen_k or (causal) the diagonal need a mask, and they come
    first: non-causal, the first step's block alone, so the loop has no mask code (code that never runs there would
    still cost time); causal, the loop keeps it (a 64-row consumer's diagonal can cross two blocks, and its tile's
    last block can lie wholly past it: the second step may need one, never the third). Overlapped inside the
    warpgroup: step 0's softmax first, then per step j S_j and P_{j-1} V_{j-1} issued together, softmax j while
    P_{j-1} V_{j-1} runs (where fences hold the schedule; else ptxas waits for P V first), then P_j's operand and the
    rescale. Arrives on q_free (if release_q) once its last S wgmma completed. With ping-pong the S_0 issue and each
    block's S_j + P_{j-1} V_{j-1} issue are steps first_load, first_load + 1, ... of _wait_turn (both consumers
    count the same loads). lag: softmax_block's; residues: mask_block's; alibi: logits' (qk_scale_log2 is 1 where it
    is given). clear_v: (0, ) for a varlen call, else (): V's rows past seqlen_k in block `top` (the only block that
    crosses it) are zeroed before its P V (_clear_rows_past). draws: () or (dropout.row_draws' of the rows, ):
    each block's Philox words are drawn while its S wgmma runs, and the dropped elements of P zeroed after the row
    sum took them (the LSE ignores dropout). row_pages: () or schedule.sequence_pages' entry: each block's page ids
    are read while its S wgmma runs, and keys on a page outside the pool are masked (schedule.mask_absent_page).
    Returns the unnormalized output ([ROWS, WIDTH] per chunk of V's head dim), the running max (log2 units) and the
    row sum [ROWS]."""
    ROWS: gl.constexpr = q[0].shape[0]
    STAGES: gl.constexpr = k_smem[0].shape[0]
    BLOCK_N: gl.constexpr = k_smem[0].shape[2]
    # the S wgmma's accumulator (its instruction's K: 32 bytes of q's dtype, 16 columns of bf16, 32 of e4m3)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 256 // q[0].dtype.primitive_bitwidth])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    # [ROWS, BLOCK_N] the zero accumulator of the S wgmmas; [ROWS, WIDTH] per chunk: the output accumulators
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    acc = zero_accumulators(ROWS, v_smem)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc[0].type.layout, k_width=2)
    # wgmma groups a P V issue leaves in flight (one per chunk of V's head dim)
    PV_GROUPS: gl.constexpr = len(v_smem)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([ROWS], gl.float32, row_s)
    stage = first_load % STAGES
    mbarrier.wait(k_ready.index(stage), (first_load // STAGES) & 1)
    _wait_turn(turns, first_load, lead)
    # [ROWS, BLOCK_N] raw q.k of the last key block
    s = chained_products(q, matrices_of(entries_of(k_smem, stage)), zero_s)
    _pass_turn(turns)
    if len(draws) > 0:
        # [ROWS, BLOCK_N] the block's dropout draws, while its S wgmma runs
        words = draw_words(zero_s, top, draws[0], col_s)
    presence = page_presence(row_pages, top, BLOCK_N)
    s = logits(warpgroup_mma_wait(0, deps=(s, )), top, offs_m, seqlen_q, seqlen_k, alibi, col_s)
    arrive_after_wgmma(k_empty.index(stage))
    s = mask_absent_page(s, presence, zero_s, col_s)
    # [ROWS, BLOCK_N] probabilities of the block whose P.V is pending
    if len(window) > 0:
        s = mask_local(s, top, row0, offs_m, seqlen_q, seqlen_k, window, col_s)
    else:
        s = mask_block(s, top, row0, offs_m, seqlen_q, seqlen_k, causal, residues, col_s)
    p, m_i, l_i, alpha = softmax_block(s, m_i, l_i, qk_scale_log2, lag)
    # [ROWS, BLOCK_N] the wgmma's A operand, made where the softmax ends: only these half-width registers stay live
    # across the next S issue (fp32 p live there pushes ptxas to wait for P V before the softmax, serializing them);
    # with dropout, the dropped elements zeroed as it is made
    if len(draws) > 0:
        p = kept_operand(p, words, draws[0], v_smem[0].dtype, p_layout)
    else:
        p = operand_of(p, v_smem[0].dtype, p_layout)
    for j in range(1, count):
        load = first_load + j
        stage = load % STAGES
        previous = (load - 1) % STAGES
        mbarrier.wait(k_ready.index(stage), (load // STAGES) & 1)
        mbarrier.wait(v_ready.index(previous), ((load - 1) // STAGES) & 1)
        v_previous = matrices_of(entries_of(v_smem, previous))
        if len(clear_v) > 0:
            if (j == 1) & ((top + 1) * BLOCK_N > seqlen_k):
                _clear_rows_past(v_previous, seqlen_k - top * BLOCK_N)
        _wait_turn(turns, load, lead)
        s = chained_products(q, matrices_of(entries_of(k_smem, stage)), zero_s)
        acc = accumulate_register_products(p, v_previous, acc)
        _pass_turn(turns)
        if len(draws) > 0:
            words = draw_words(zero_s, top - j, draws[0], col_s)
        presence = page_presence(row_pages, top - j, BLOCK_N)
        # S_j done (wgmma groups complete in order); P_{j-1} V_{j-1} may still run
        s = logits(warpgroup_mma_wait(PV_GROUPS, deps=(s, )), top - j, offs_m, seqlen_q, seqlen_k, alibi, col_s)
        arrive_after_wgmma(k_empty.index(stage))
        s = mask_absent_page(s, presence, zero_s, col_s)
        if len(window) > 0:
            s = mask_local(s, top - j, row0, offs_m, seqlen_q, seqlen_k, window, col_s)
        elif causal != 0:
            s = mask_block(s, top - j, row0, offs_m, seqlen_q, seqlen_k, causal, residues, col_s)
        p, m_i, l_i, alpha = softmax_block(s, m_i, l_i, qk_scale_log2, lag)
        hold_schedule(fences)
        acc = wait_products(acc)
        arrive_after_wgmma(v_empty.index(previous))
        if len(draws) > 0:
            p = kept_operand(p, words, draws[0], v_smem[0].dtype, p_layout)
        else:
            p = operand_of(p, v_smem[0].dtype, p_layout)
        acc = _rescale_chunks(acc, alpha, lag)
    arrive_after_wgmma(q_free, pred=release_q)
    last = first_load + count - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    v_last = matrices_of(entries_of(v_smem, last % STAGES))
    if len(clear_v) > 0:
        if (count == 1) & ((top + 1) * BLOCK_N > seqlen_k):
            _clear_rows_past(v_last, seqlen_k - top * BLOCK_N)
    acc = wait_products(accumulate_register_products(p, v_last, acc))
    arrive_after_wgmma(v_empty.index(last % STAGES))
    return acc, m_i, l_i


@gluon.jit
def _store_rows(out, rows_out, rows, head, row_in):
    """out ([ROWS, WIDTH] per chunk of V's head dim, wgmma layouts) into rows `rows` [ROWS] (row_in: which to store) of
    a varlen output by pointer; rows_out: (Out, stride_om, stride_oh, head_dim_v), its columns past head_dim_v (the
    tile's padding) left alone."""
    column = 0
    for chunk in gl.static_range(len(out)):
        _store_chunk_rows(out[chunk], column, rows_out, rows, head, row_in)
        column = column + out[chunk].shape[1]


@gluon.jit
def _store_chunk_rows(out, column0, rows_out, rows, head, row_in):
    """_store_rows of one chunk out [ROWS, WIDTH] into columns from column0."""
    WIDTH: gl.constexpr = out.shape[1]
    Out, stride_om, stride_oh, head_dim_v = rows_out
    layout: gl.constexpr = out.type.layout
    # [ROWS] rows, [WIDTH] columns, in the accumulator's layout
    rows = gl.convert_layout(rows, gl.SliceLayout(1, layout))
    row_in = gl.convert_layout(row_in, gl.SliceLayout(1, layout))
    columns = column0 + gl.arange(0, WIDTH, gl.SliceLayout(0, layout))
    pointers = (Out + head.to(gl.int64) * stride_oh + gl.expand_dims(rows.to(gl.int64) * stride_om, 1)
                + gl.expand_dims(columns, 0))
    gl.store(pointers, out.to(Out.dtype.element_ty),
             mask=gl.expand_dims(row_in, 1) & gl.expand_dims(columns < head_dim_v, 0))


@gluon.jit
def _store_output(out, lse, o_tile, o_desc, q_empty, Lse, stride_lse_b, stride_lse_h, batch, head, row0, offs_m,
                  bounds, rows_out, o_in_q):
    """A consumer's rows of a whole tile's result: lse [ROWS] (rows offs_m below the sequence's length), out ([ROWS,
    WIDTH] per chunk of V's head dim) through o_tile (per chunk) by TMA (which clips rows past a dense call's
    seqlen_q); where O is staged in the consumer's Q tile (o_in_q), Q's slot is released once the store has read it.
    bounds: schedule.tile_work's. rows_out: () for a dense call; for a varlen one (_store_rows' argument) a tile that
    runs past its sequence's end is stored by pointer instead, as the next sequence's rows follow in the same tensor
    (and the LSE's rows are offset by the sequence's first row: stride_lse_b is 0)."""
    ROWS: gl.constexpr = out[0].shape[0]
    seqlen_q, _, q_start, _, desc_batch = bounds
    lse_row_base = batch.to(gl.int64) * stride_lse_b + head.to(gl.int64) * stride_lse_h + q_start
    gl.store(Lse + lse_row_base + offs_m, lse, mask=offs_m < seqlen_q)
    if len(rows_out) > 0:
        if row0 + ROWS > seqlen_q:
            _store_rows(out, rows_out, q_start + offs_m, head, offs_m < seqlen_q)
            if o_in_q != 0:
                mbarrier.arrive(q_empty)
        else:
            _store_tile(out, o_tile, o_desc, q_empty, desc_batch, q_start + row0, head, o_in_q)
    else:
        _store_tile(out, o_tile, o_desc, q_empty, desc_batch, row0, head, o_in_q)


@gluon.jit
def _store_tile(out, o_tile, o_desc, q_empty, batch, row, head, o_in_q):
    """out ([ROWS, WIDTH] per chunk) through o_tile ([1, ROWS, 1, WIDTH] per chunk) to O's descriptors at (batch,
    row, head) by TMA; where O is staged in the consumer's Q tile (o_in_q), Q's slot is released once the store has
    read it."""
    tma.store_wait(0)  # the previous tile's O store has read o_tile
    for chunk in gl.static_range(len(out)):
        o_chunk = o_tile[chunk]
        o_chunk.reshape([o_chunk.shape[1], o_chunk.shape[3]]).store(out[chunk].to(o_chunk.dtype))
    fence_async_shared()
    _copy_out(o_desc, o_tile, batch, row, head)
    if o_in_q != 0:
        tma.store_wait(0)
        mbarrier.arrive(q_empty)


@gluon.jit
def _store_partial(out, lse, Partial, PartialLse, slot, row_offset, TILE_ROWS: gl.constexpr):
    """A consumer's part of a tail piece's result (out: [ROWS, WIDTH] per chunk of the head dim, normalized by the
    piece's own row sums; lse [ROWS] its natural-log LSE, -inf for rows that saw no key in it) into workspace slot
    `slot` (Partial [slots, TILE_ROWS, HEAD_DIM] with HEAD_DIM the chunks' widths summed, PartialLse [slots,
    TILE_ROWS], fp32; rows past seqlen_q too: the merge skips them)."""
    ROWS: gl.constexpr = out[0].shape[0]
    HEAD_DIM: gl.constexpr = chunks_width(out)
    column = 0
    for chunk in gl.static_range(len(out)):
        _store_partial_chunk(out[chunk], column, Partial, slot, row_offset, TILE_ROWS, HEAD_DIM)
        column = column + out[chunk].shape[1]
    gl.store(PartialLse + slot.to(gl.int64) * TILE_ROWS + row_offset
             + gl.arange(0, ROWS, lse.type.layout), lse)


@gluon.jit
def _store_partial_chunk(out, column0, Partial, slot, row_offset, TILE_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """_store_partial's output chunk out [ROWS, WIDTH] into the workspace's columns from column0."""
    ROWS: gl.constexpr = out.shape[0]
    WIDTH: gl.constexpr = out.shape[1]
    # [ROWS] the tile's rows of this consumer; [WIDTH] the chunk's columns
    rows = row_offset + gl.arange(0, ROWS, gl.SliceLayout(1, out.type.layout))
    columns = column0 + gl.arange(0, WIDTH, gl.SliceLayout(0, out.type.layout))
    slot_rows = slot.to(gl.int64) * TILE_ROWS + rows
    gl.store(Partial + gl.expand_dims(slot_rows * HEAD_DIM, 1) + gl.expand_dims(columns, 0), out)


@gluon.jit
def _consumer(q_tile, o_tile, q_ready, q_empty, turns, row_offset, o_desc, Lse, Partial, PartialLse, k_smem, v_smem,
              k_ready, v_ready, k_empty, v_empty, team, fences, lag, residues, stride_lse_b, stride_lse_h, tail,
              work, qk_scale_log2, alibi, o_in_q, rows_out, dropout, sinks, fp8, pages, dynamic):
    """One warpgroup: query rows [m_start + row_offset, + ROWS) of every piece of work of this program (a tile, or part
    of a tail tile's key blocks: next_piece). Per piece: wait for its Q tile (q_tile [1, ROWS, 1, WIDTH] per chunk,
    shared), run the key blocks, normalize, store the natural-log LSE and O (_store_output; a partial piece's to the
    workspace instead: _store_partial). q_empty tells the producer that q_tile may be refilled: after the last S
    wgmma, or where O is staged in q_tile itself (o_in_q) once O's store has read it. q_tile, o_tile: one entry per
    chunk of Q's (V's) head dim. Rows that saw no key: out 0,
    lse +inf (docs/api.md §4.5). team: one entry per consumer of the program (a tile has len(team) * ROWS rows; a
    tuple's length reaches partitions where a constexpr does not). turns: the ping-pong barriers (_wait_turn), this
    consumer's first, or (); the first consumer (row_offset 0) leads. fences: hold_schedule's; lag:
    softmax_block's; residues: mask_block's; alibi: () or (AlibiSlopes, stride_alibi_b,
    alibi_pure_causal, qk_scale_log2 of the logits) (_run_piece loads each tile's slope for logits); rows_out:
    _store_output's (varlen: O's pointer, strides and head dim; its length also tells _key_blocks to clear V past
    each sequence's keys); dropout: () or (RngState, keep_threshold, dropout_scale), sinks: () or (LearnableSink, ),
    fp8: () or (QDescale, KDescale, VDescale, group_size) (_run_piece); pages, dynamic: the producer's (with a
    dynamic schedule each tile's item id comes from the producer: _published_item)."""
    ROWS: gl.constexpr = q_tile[0].shape[1]
    TILE_ROWS: gl.constexpr = len(team) * ROWS
    BLOCK_N: gl.constexpr = k_smem[0].shape[2]
    # (0, ) for varlen calls: _key_blocks clears V's rows past a sequence's keys
    if len(rows_out) > 0:
        clear_v = (0, )
    else:
        clear_v = ()
    lead = (row_offset == 0).to(gl.int32)
    # _run_piece's groups
    tiles = (matrices_of(q_tile), o_tile, k_smem, v_smem)
    barriers = (q_ready, q_empty, k_ready, v_ready, k_empty, v_empty)
    outputs = (o_desc, Lse, Partial, PartialLse, stride_lse_b, stride_lse_h, rows_out)
    options = (row_offset, turns, lead, fences, lag, residues, clear_v, work[6], work[8], qk_scale_log2, alibi,
               o_in_q, tail, team, dropout, work[3], sinks, fp8, pages)
    load = 0
    done = 0
    item, which, x_start, x_end = first_cursor(tail)
    x = x_start
    if len(dynamic) > 0:
        # the producer's items, each a tile with key blocks
        item = _published_item(q_ready, dynamic[1], done)
        while item >= 0:
            batch, head, m_start, top, count, slot, _, _, _, bounds = next_piece(item, which, x, x_start, x_end, tail,
                                                                                 work, TILE_ROWS, BLOCK_N)
            piece = (batch, head, m_start, top, count, slot, bounds)
            load, done = _run_piece(piece, load, done, tiles, barriers, outputs, options)
            item = _published_item(q_ready, dynamic[1], done)
    else:
        while more_work(item, x, x_end, tail):
            batch, head, m_start, top, count, slot, item, which, x, bounds = next_piece(item, which, x, x_start,
                                                                                        x_end, tail, work, TILE_ROWS,
                                                                                        BLOCK_N)
            piece = (batch, head, m_start, top, count, slot, bounds)
            if len(rows_out) > 0:
                if count > 0:  # a varlen tile past its sequence's end has no work
                    load, done = _run_piece(piece, load, done, tiles, barriers, outputs, options)
            else:
                load, done = _run_piece(piece, load, done, tiles, barriers, outputs, options)
    tma.store_wait(0)


@gluon.jit
def _run_piece(piece, load, done, tiles, barriers, outputs, options):
    """_consumer's work on one piece (schedule.next_piece's (batch, head, m_start, top, count, slot, bounds)): wait for
    its Q tile, run its key blocks, normalize, store. Returns the program's load and piece counters after it.
    tiles: (q ([ROWS, WIDTH] per chunk, shared), o_tile, k_smem, v_smem); barriers: (q_ready, q_empty, k_ready, v_ready,
    k_empty, v_empty); outputs: (o_desc, Lse, Partial, PartialLse, stride_lse_b, stride_lse_h, rows_out); options:
    (row_offset, turns, lead, fences, lag, residues, clear_v, causal, window, qk_scale_log2, alibi, o_in_q, tail,
    team, dropout, num_heads, sinks, fp8, pages); dropout: () or (RngState, keep_threshold, dropout_scale); sinks: () or
    (LearnableSink, ): folded into the output and LSE (not into a partial piece's: launch_fwd cuts no tail then);
    fp8: () or (QDescale, KDescale, VDescale, group_size): the piece's scores scaled by its (batch, kv head)'s q and
    k descales, its output by the v descale."""
    batch, head, m_start, top, count, slot, bounds = piece
    q, o_tile, k_smem, v_smem = tiles
    q_ready, q_empty, k_ready, v_ready, k_empty, v_empty = barriers
    o_desc, Lse, Partial, PartialLse, stride_lse_b, stride_lse_h, rows_out = outputs
    (row_offset, turns, lead, fences, lag, residues, clear_v, causal, window, qk_scale_log2, alibi, o_in_q, tail,
     team, dropout, num_heads, sinks, fp8, pages) = options
    ROWS: gl.constexpr = q[0].shape[0]
    TILE_ROWS: gl.constexpr = len(team) * ROWS
    BLOCK_N: gl.constexpr = k_smem[0].shape[2]
    # the S wgmma's accumulator (its instruction's K: 32 bytes of q's dtype, 16 columns of bf16, 32 of e4m3)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 256 // q[0].dtype.primitive_bitwidth])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    seqlen_q, seqlen_k = bounds[0], bounds[1]
    # logits' ALiBi entry: the tile's head's slope in log2 units
    alibi_row = ()
    if len(alibi) > 0:
        slope_log2 = gl.load(alibi[0] + batch.to(gl.int64) * alibi[1] + head) * 1.4426950408889634
        alibi_row = (slope_log2, alibi[2], alibi[3])
    row0 = m_start + row_offset
    # [ROWS] this consumer's query rows (of the sequence)
    offs_m = row0 + gl.arange(0, ROWS, row_s)
    # the rows' dropout draws in the (batch, head) stream, or ()
    draws = ()
    if len(dropout) > 0:
        draws = (row_draws(dropout_key(dropout[0], dropout[1]), batch * num_heads + head, offs_m), )
    scale_log2 = qk_scale_log2
    if len(fp8) > 0:
        # the (batch, kv head)'s descales: (B, Hk) fp32
        descale_index = batch * (num_heads // fp8[3]) + head // fp8[3]
        scale_log2 = qk_scale_log2 * gl.load(fp8[0] + descale_index) * gl.load(fp8[1] + descale_index)
    mbarrier.wait(q_ready, done & 1)
    acc, m_i, l_i = _key_blocks(q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, q_empty, o_in_q == 0,
                                load, top, count, row0, offs_m, seqlen_q, seqlen_k, scale_log2, alibi_row,
                                causal, window, turns, lead, fences, lag, residues, clear_v, draws,
                                sequence_pages(pages, batch))
    seen = l_i > 0.0
    if len(sinks) > 0:
        # the head's sink logit (log2 units) joins every row's sum; [ROWS] what the keys keep of it (0 for rows
        # that saw no key: their output is 0 and their LSE the sink's)
        sink = gl.load(sinks[0] + head).to(gl.float32)
        sink_log2 = sink * 1.4426950408889634
        top = gl.maximum(m_i, sink_log2)
        keys_share = gl.exp2(m_i - top)
        # [ROWS] the sums with the sink, >= 1 (the larger of the row's max and the sink contributes 1)
        row_sum = l_i * keys_share + gl.exp2(sink_log2 - top)
        inverse_sum = reciprocal(row_sum) * keys_share
        lse = (top + gl.log2(row_sum)) * 0.6931471805599453
        stored_lse = gl.where(seen, lse, sink)
    else:
        # [ROWS] the row sums, 1 for rows that saw no key
        row_sum = gl.where(seen, l_i, 1.0)
        # [ROWS] one reciprocal per row, then a multiply per element (a division per element costs ~5
        # instructions: div.full's range fix-ups, and spills at d128); rcp.approx is within 1 ulp, and a seen
        # row's sum is >= 1 (its max's own term), so no denormal reaches it.
        inverse_sum = reciprocal(row_sum)
        # [ROWS] natural-log LSE (rows without a key: +inf in the output, -inf, no weight, in a partial result)
        lse = (m_i + gl.log2(row_sum)) * 0.6931471805599453
        stored_lse = gl.where(seen, lse, float("inf"))
    if len(dropout) > 0:
        inverse_sum = inverse_sum * dropout[2]  # kept probabilities count 1 / (1 - p) times
    if len(fp8) > 0:
        inverse_sum = inverse_sum * gl.load(fp8[2] + descale_index)
    out = _rescale_chunks(acc, inverse_sum, ())
    if len(tail) > 1:
        if slot < 0:
            _store_output(out, stored_lse, o_tile, o_desc, q_empty, Lse,
                          stride_lse_b, stride_lse_h, batch, head, row0, offs_m, bounds, rows_out, o_in_q)
        else:
            _store_partial(out, gl.where(seen, lse, float("-inf")), Partial, PartialLse, slot, row_offset,
                           TILE_ROWS)
            if o_in_q != 0:
                mbarrier.arrive(q_empty)
    else:
        _store_output(out, stored_lse, o_tile, o_desc, q_empty, Lse, stride_lse_b,
                      stride_lse_h, batch, head, row0, offs_m, bounds, rows_out, o_in_q)
    load += count
    done += 1
    return load, done


@gluon.jit
def _consumer_args(consumer: gl.constexpr, q_smem, o_smem, q_ready, q_empty, turns, common):
    """_consumer's arguments for consumer warpgroup `consumer`: its Q and O tiles, Q barriers, ping-pong barriers
    (turns: one entry per consumer) and first row in the tile, then what every consumer gets (common)."""
    return (entries_of(q_smem, consumer), entries_of(o_smem, consumer), q_ready.index(consumer),
            q_empty.index(consumer), turns[consumer], consumer * CONSUMER_ROWS) + common


@gluon.jit(do_not_specialize=["stride_lse_b", "stride_lse_h", "batch", "seqlen_q", "seqlen_k", "heads_per_group",
                              "paired", "full_items", "tail_programs", "tail_blocks", "item_blocks", "window_left",
                              "window_right", "q_rows", "k_rows", "paged_args"])
def attn_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, q_desc2, k_desc2, v_desc2, o_desc2, Lse, Partial,
                           PartialLse, stride_lse_b, stride_lse_h, batch, num_heads, group_size, seqlen_q, seqlen_k, heads_per_group, paired, full_items,
                           tail_programs, tail_blocks, item_blocks, qk_scale_log2, rescale_threshold, window_left,
                           window_right, varlen, q_rows, k_rows, alibi_args, dropout_args, LearnableSink, fp8_args,
                           paged_args, item_counter,
                           CAUSAL: gl.constexpr, LOCAL: gl.constexpr,
                           STAGES: gl.constexpr,
                           CONSUMERS: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr, HOLD_SCHEDULE: gl.constexpr,
                           RESCALE_SKIP: gl.constexpr, MASK_BY_RESIDUES: gl.constexpr,
                           SPLIT_TAIL: gl.constexpr, KEY_PIECES: gl.constexpr, num_warps: gl.constexpr):
    """q_desc, k_desc, v_desc, o_desc: the tensors' descriptors of the first chunk of their head dims (column 0 on);
    q_desc2 ... o_desc2: those of the second chunk (from the first one's width on), or None where one chunk covers the
    head dim (configs.HOPPER_FWD_CHUNKS: Gluon's shared tiles and wgmmas take power-of-two widths, so head dim 192 runs
    as 128 + 64 columns, 96 as 64 + 32, 80 as 64 + 16: two chained S wgmmas, an output accumulator and a P V wgmma per
    chunk of V's head dim; no padding). Work items: query tiles of CONSUMERS * 64 rows of every (batch, head), longest first, in launch-order groups of
    heads_per_group (batch, head) pairs like kernels/fwd.py, or with `paired` (1) pairs of tiles of equal total
    length (item_tiles); program p takes items p, p + P, p + 2P, ... of a grid of P programs (one per item, or
    persistent: one per SM, so the next tile's loads overlap this one's end) below full_items. The items from
    full_items on (the tail: fewer than a wave) are cut by key blocks evenly among the first tail_programs programs
    (ops/hopper.tail_split: tail_blocks positions, every item item_blocks long); pieces short of their tile write
    partial results (Partial, PartialLse: two slots per tail program) that attn_tail_merge_kernel merges
    (next_piece). full_items = all items and tail_programs = 0: no tail; SPLIT_TAIL off: no code for one. num_warps
    (4) is the first consumer's; the other consumers (4 warps, CONSUMER_REGS registers each) and the producer (1
    warp) are worker partitions. PINGPONG (two consumers): they issue their wgmmas in alternation (_wait_turn).
    RESCALE_SKIP: the max lags by up to rescale_threshold (log2 units) and unmoved warps skip the output rescale
    (fwd_softmax.softmax_block, rescale). MASK_BY_RESIDUES: how a causal block's mask compares columns (fwd_softmax.mask_block). LOCAL: a
    local window (window_left, window_right, both >= 0, normalized as kernels/common's): each tile visits the key
    blocks its rows see (tile_work) and masks both edges (fwd_softmax.mask_local); grids are not paired and the tail is not cut
    (ops/hopper.launch_fwd). Varlen (varlen: (CuSeqlensQ, CuSeqlensK, Out, stride_om, stride_oh, head_dim_v), the
    pointers None for a dense call): batch sequences packed in (T, H, D) tensors, (1, T, H, D) to the descriptors
    (q_rows / k_rows: T of q / k, unspecialized as they change every call); seqlen_q / seqlen_k are the
    longest lengths; each tile's sequence bounds come from schedule.tile_work; a tile that runs past its sequence's
    end stores O by pointer (Out, stride_om, stride_oh; head_dim_v: out's own head dim), and V's rows past a
    sequence's keys are zeroed in shared memory before they meet P (_clear_rows_past). Grids are not paired and the
    tail is not cut. alibi_args: (AlibiSlopes, stride_alibi_b, alibi_pure_causal, logit_scale_log2); ALiBi
    (AlibiSlopes given, None otherwise; stride_alibi_b 0 for (H,) slopes): the logits q.k * logit_scale_log2 get
    kernels/common.alibi_bias_log2's bias (fwd_softmax.logits), qk_scale_log2 1. dropout_args: (RngState,
    keep_threshold, dropout_scale), RngState None without dropout: P's elements are dropped by kernels/common.dropout_keep's
    mask (kernels/hopper/dropout.py) after the row sums, and the output scaled by dropout_scale. LearnableSink ((H,)
    logits, or None): each head's sink joins its rows' softmax sums (docs/api.md §4.11: out and the LSE include it;
    rows without a key: out 0, LSE the sink); the launcher cuts no tail with sinks (a partial piece has none).
    fp8_args: (QDescale, KDescale, VDescale, group_size), the pointers None without FP8: e4m3 q and k (their product
    on fp8 tensor cores), V in fp16 (the launcher widens it), bf16 out; each tile's scores are scaled by its (batch,
    kv head)'s q and k descales and its output by the v descale ((B, Hk) fp32 each); P enters P V in fp16 as V's
    dtype (docs/api.md §4.12). No ALiBi, no tail cut then. paged_args: (BlockTable, stride_bt, page_size,
    num_pages), BlockTable None without pages: a varlen call's K and V are a pool of num_pages pages of page_size
    keys, (1, num_pages * page_size, Hk, D) to the descriptors, whose key blocks the producer reads from each
    sequence's block-table row (schedule.block_rows), in KEY_PIECES boxes of the descriptors' rows where a block is
    wider than a page (the descriptors' rows divide page_size); keys start at 0 of the row, k_rows is its capacity
    (max pages per sequence * page_size); keys on pages outside [0, num_pages) are absent. item_counter (a zeroed
    int32, or None): a persistent varlen grid's dynamic schedule, its tiles being of unequal lengths: after its own
    first item a program takes the next one nobody has taken (_producer), the consumers learn each tile's item from
    the producer (no tail: full_items = all items)."""
    ROWS: gl.constexpr = CONSUMER_ROWS
    # keys per K / V stage: KEY_PIECES boxes of the descriptors' rows (a paged block wider than a page: one per page)
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1] * KEY_PIECES
    q_descs, k_descs = chunk_descriptors(q_desc, q_desc2), chunk_descriptors(k_desc, k_desc2)
    v_descs, o_descs = chunk_descriptors(v_desc, v_desc2), chunk_descriptors(o_desc, o_desc2)
    # per chunk of the head dims: [CONSUMERS, 1, ROWS, 1, WIDTH] the consumers' Q tiles, [STAGES, 1, BLOCK_N, 1, WIDTH]
    # K and V
    q_smem = allocate_chunks(q_descs, CONSUMERS)
    k_smem = allocate_chunks(k_descs, STAGES, BLOCK_N)
    v_smem = allocate_chunks(v_descs, STAGES, BLOCK_N)
    HEAD_DIM: gl.constexpr = chunks_width(k_smem)
    HEAD_DIM_V: gl.constexpr = chunks_width(v_smem)
    # O gets tiles of its own where they fit next to Q and the K/V stages, so the next tile's Q can land while O is
    # stored; else (head dim 256; (192, 128) on 128-key blocks) O is staged in the consumer's Q tile, its chunks in
    # Q's first ones (of the same widths)
    # bytes per element of each tensor (FP8: 1 for q and k, 2 for v and out)
    q_bytes: gl.constexpr = q_desc.dtype.primitive_bitwidth // 8
    k_bytes: gl.constexpr = k_desc.dtype.primitive_bitwidth // 8
    v_bytes: gl.constexpr = v_desc.dtype.primitive_bitwidth // 8
    o_bytes: gl.constexpr = o_desc.dtype.primitive_bitwidth // 8
    tiles_bytes: gl.constexpr = CONSUMERS * ROWS * (HEAD_DIM * q_bytes + HEAD_DIM_V * o_bytes)
    stage_bytes: gl.constexpr = BLOCK_N * (HEAD_DIM * k_bytes + HEAD_DIM_V * v_bytes)
    O_IN_Q: gl.constexpr = tiles_bytes + STAGES * stage_bytes > SHARED_BYTES_FOR_TILES
    num_tiles = gl.cdiv(seqlen_q, CONSUMERS * ROWS)
    num_batch_heads = batch * num_heads
    # per chunk of V's head dim: [CONSUMERS, 1, ROWS, 1, WIDTH] the consumers' O tiles
    if O_IN_Q:
        gl.static_assert((len(o_descs) <= len(q_descs)) & (q_bytes == o_bytes),
                         "O tiles of V's head dim must fit beside the Q tiles")
        o_smem = ()
        for chunk in gl.static_range(len(o_descs)):
            gl.static_assert(q_smem[chunk].shape[4] == o_descs[chunk].block_type.shape[3],
                             "O's chunks are staged in Q's chunks of the same widths")
            o_smem = o_smem + (q_smem[chunk], )
    else:
        o_smem = allocate_chunks(o_descs, CONSUMERS)
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for consumer in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(consumer), count=1)
        mbarrier.init(q_empty.index(consumer), count=1)
    if PINGPONG:
        # one allocation each: waits on one and arrivals on the other would otherwise be ordered by a barrier
        first_turn = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        second_turn = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(first_turn, count=1)
        mbarrier.init(second_turn, count=1)
        turns = ((first_turn, second_turn), (second_turn, first_turn))
    else:
        turns = ((), (), ())  # one entry per consumer (three at most)
    # hold_schedule's fence, present or not (a tuple's length reaches the partitions where a constexpr does not)
    if HOLD_SCHEDULE:
        fences = (0, )
    else:
        fences = ()
    # one entry per consumer (_consumer's team)
    if CONSUMERS == 3:
        team = (0, 1, 2)
    else:
        team = (0, 1)
    # the rescale skip's threshold, or () without it (a tuple's length again)
    if RESCALE_SKIP:
        lag = (rescale_threshold, )
    else:
        lag = ()
    # mask_block's causal comparison by column residues, or () for the plain one
    if MASK_BY_RESIDUES:
        residues = (0, )
    else:
        residues = ()
    for stage in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(stage), count=1)
        mbarrier.init(v_ready.index(stage), count=1)
        mbarrier.init(k_empty.index(stage), count=CONSUMERS)
        mbarrier.init(v_empty.index(stage), count=CONSUMERS)
    # constexprs arrive in partitions as plain ints (Triton 3.6): the flags travel as tensors
    causal = gl.to_tensor(CAUSAL).to(gl.int32)
    o_in_q = gl.to_tensor(O_IN_Q).to(gl.int32)
    # the work items and the tail's cut (next_piece)
    # the local window, or () without one (a tuple's length reaches the partitions)
    if LOCAL:
        window = (window_left, window_right)
    else:
        window = ()
    # ALiBi's slopes, or () without them (logits; qk_scale_log2 is then 1)
    if alibi_args[0] is not None:
        alibi = alibi_args
    else:
        alibi = ()
    # the varlen sequences and O's rows by pointer, or () for a dense call (schedule.tile_work, _store_output)
    # a varlen call's keys in a paged pool, or () (schedule.block_rows)
    if paged_args[0] is not None:
        pieces = ()  # one entry per piece of a key block (schedule.block_rows)
        for _ in gl.static_range(KEY_PIECES):
            pieces = pieces + (0, )
        pages = paged_args + (pieces, )
    else:
        gl.static_assert(KEY_PIECES == 1, "key blocks in pieces are paged blocks")
        pages = ()
    if varlen[0] is not None:
        seqs = (varlen[0], varlen[1], q_rows, k_rows, pages)
        rows_out = (varlen[2], varlen[3], varlen[4], varlen[5])
    else:
        seqs = ()
        rows_out = ()
    work = (num_tiles, num_batch_heads, heads_per_group, num_heads, seqlen_q, seqlen_k, causal, paired, window, seqs)
    # dropout's (RngState, keep_threshold, dropout_scale), or () without it
    if dropout_args[0] is not None:
        dropout = dropout_args
    else:
        dropout = ()
    # the sinks, or () without them
    if LearnableSink is not None:
        sinks = (LearnableSink, )
    else:
        sinks = ()
    # FP8's descales and group size, or () without them
    if fp8_args[0] is not None:
        fp8 = fp8_args
    else:
        fp8 = ()
    if SPLIT_TAIL:
        tail = (full_items, tail_programs, tail_blocks, item_blocks)
    else:
        tail = (full_items, )
    # the dynamic schedule's (item counter, [2, 1] the item ids of the tiles in flight), or ()
    if item_counter is not None:
        gl.static_assert(varlen[0] is not None, "the dynamic schedule is a varlen grid's")
        dynamic = (item_counter, gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0])))
    else:
        dynamic = ()
    common = (o_descs, Lse, Partial, PartialLse, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, team, fences, lag,
              residues, stride_lse_b, stride_lse_h, tail, work, qk_scale_log2, alibi, o_in_q, rows_out, dropout, sinks,
              fp8, pages, dynamic)
    producer_args = (q_descs, k_descs, v_descs, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                     v_empty, group_size, tail, work, pages, dynamic)
    first = _consumer_args(0, q_smem, o_smem, q_ready, q_empty, turns, common)
    second = _consumer_args(1, q_smem, o_smem, q_ready, q_empty, turns, common)
    if CONSUMERS == 3:
        third = _consumer_args(2, q_smem, o_smem, q_ready, q_empty, turns, common)
        gl.warp_specialize([(_consumer, first), (_consumer, second), (_consumer, third), (_producer, producer_args)],
                           [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([(_consumer, first), (_consumer, second), (_producer, producer_args)], [4, 1],
                           [CONSUMER_REGS, 24])

"""Backward dK / dV and dQ for Hopper (sm_90) at head dims 64, 80, 96 and 128 in Gluon (80 and 96 in two power-of-two
column chunks, configs.HOPPER_BWD_CHUNKS: S and dP chain a wgmma per chunk, dK / dV keep an accumulator per chunk,
and consumer w adds chunk w's dQ features), warp-specialized, FA3's division of the work: one program per 128-key
block, a one-warp TMA producer streaming Q / dO blocks of 64 rows, two consumer warpgroups that each own 64 keys of
the block (their dK, dV accumulators stay in registers for the whole loop) and share the query blocks.

Per query block i (64 rows), consumer w (keys [64w, 64w + 64) of the block), every product an M = 64 wgmma, with
key-major score tiles (configs.HopperBwdConfig.key_major; FA3's SdP_swapAB with its dK / dV from registers):
  S^T = K_w Q_i^T, dP^T = V_w dO_i^T              [64 keys, 64 rows], both issued async, then S^T waited
  (Q_i, dO_i and their rows' lse and delta arrive by TMA in one stage of the producer's pipeline)
  P^T = exp2(S^T * scale * log2 e - lse_i * log2 e) (lse per column); dV_w += P^T dO_i issued with P^T in registers
  as the A operand; then dP^T waited, dS^T = P^T (dP^T - delta_i), dK_w += dS^T Q_i the same way, and dS^T stored
  to shared memory for the dQ products (which read it transposed).
With row-major tiles (calls with dropout: the forward's mask follows the [rows, keys] accumulators):
  S = Q_i K_w^T, dP = dO_i V_w^T                  [64 rows, 64 keys]
  P = exp2(S * scale * log2 e - lse_i * log2 e), dS = P (dP - delta_i); P and dS go to shared memory
  dV_w += P^T dO_i, dK_w += dS^T Q_i              (P^T, dS^T: transposed views of the shared tiles)
Either way dQ_i is split one of two ways:
  - head dim 128, by features: once both consumers' dS are there (ds_ready), consumer w computes
    dQ_i[:, 64w:64w+64] = dS_0 K_0[:, 64w:64w+64] + dS_1 K_1[:, 64w:64w+64] (both key halves), one block late
    (during block i + 1, dS double-buffered) so that neither consumer waits for the other's dS of the same block:
    their softmax phases drift apart and overlap each other's wgmmas;
  - head dim 64, by keys: consumer w computes every feature from its own keys, dS_w K_w, with no barrier
    between the consumers but twice the reductions.
  Each consumer scales its [64 rows, 64 features] product by the softmax scale and stores it to a shared fp32 tile;
  a one-warp writer partition of its own (_dq_writer, FA3's dQ writer) adds that to the fp32 dQ accumulator with
  one TMA reduction (cp.reduce.async.bulk.tensor .add; per element atomics would cost about half of the kernel's
  time) and hands the tile back once the reduction has read it, so the consumer neither issues nor waits for the
  reduction. The launcher converts the accumulator into dq. dK is scaled here. GQA: the loop runs over the group's
  query heads too (dK/dV summed in registers).

Ordered dQ (ORDERED, head dim 128; deterministic=True, ops/hopper.orders_dq): the reductions into each (query
block, feature half) come in one fixed order, so dQ is the same bits on every call. A zeroed int32 counter per tile
counts the reductions that have completed; the writer issues a reduction once the counter reads its rank
(_reduction_rank; the counter is read while the consumer finishes the product, and spun on only if the turn has not
come), and once the reduction has completed (cp.async.bulk.wait_group 0: its writes have landed) advances the
counter with a GPU-scope release: that fence costs the issuing warp over a microsecond under load, which the writer
pays after handing the tile back, off the consumer's loop. Without the causal mask the key
blocks' loops are a rotation, two query blocks apart, and under it they start at the diagonal, so each contributor
finds the one before it (a later key block) released: the later key blocks launch first and all of a head's key
blocks must be resident together (the launcher's groups of one head, at most one key block per SM).

Scope (ops/hopper.covers): dense and varlen bf16/fp16 calls, any window (bottom-right aligned; local ones not with
ORDERED), ALiBi, dropout (dense calls; the forward's mask), softcap (not with dropout); head dim 64 / 80 / 96 / 128
(narrower ones on these tiles). Keys past seqlen_k are masked out of P (their dK/dV rows are never stored; their K
rows read as zeros, but P would not be 0); query rows past seqlen_q read Q, dO, lse and delta as zeros (TMA fills
them), so P = 1 there but dS = 0 and every product they enter adds zeros (dQ rows past a dense call's seqlen_q are
clipped by the reduction; a varlen call's, the next sequence's rows in the accumulator, get zeros: _finish_dq).

Synchronisation: kv_ready (K and V landed), q_ready[s] (Q_i, dO_i, lse_i and delta_i of stage s landed), q_empty[s]
(both consumers are done with stage s, count 2), with the feature split ds_ready (both consumers' dS written, count
2) and ds_free (both consumers' dQ products of a block completed, count 2: its dS buffer may be rewritten), one of
each per dS buffer. A row-major consumer's P tile is read only by its own dV product, which it waits for before the
next iteration. dq_full[w] (consumer w's dQ tile staged) and dq_empty[w] (its writer's reduction has read it: the
consumer may stage the next block's).
"""

from triton._C.libtriton import gluon_ir, ir
from triton.experimental import gluon
from triton.experimental.gluon.language import _core as gl_core
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from .dropout import dropout_key, dropped, row_draws
from .common import accumulate_products, accumulate_register_products, allocate_chunks, arrive_after_wgmma, \
    backward_producer, chained_products, chunk_descriptors, chunks_width, entries_of, key_block_of_program, key_rows, \
    loop_position, masked_probabilities, matrices_of, query_block, store_key_rows, wait_accumulators, \
    zero_accumulators

if not hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce"):
    raise ImportError("this Triton's Gluon has no TMA reduction; the Triton backward runs instead")

KEYS_PER_CONSUMER = gl.constexpr(64)  # one wgmma M tile; a program covers 2 * KEYS_PER_CONSUMER keys


@gl_core.builtin
def _async_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add the shared tile src into global memory at coord through tensor_desc (cp.reduce.async.bulk.tensor, one
    bulk group like tma.async_copy_shared_to_global: tma.store_wait covers it). Gluon 3.6 builds the op
    (ttng.async_tma_reduce) but has no public function for it; this is that function."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _first_visit(n_block, n_iterations, rotate, STRIDE: gl.constexpr):
    """Where key block n_block's loop starts: at 0, or with `rotate` (ordered dQ without the causal mask) at position
    STRIDE * n_block where it has one (STRIDE: query blocks per key block, so that the programs of a head are
    spread over its query blocks as they are along the causal diagonal). Plain arithmetic: tests run it on ints."""
    first = STRIDE * n_block
    return first * (first < n_iterations) * rotate


@gluon.jit
def _reduction_rank(n_block, n_key_blocks, visit, m_block, seqlen_q, seqlen_k, causal, ROWS: gl.constexpr,
                    KEYS: gl.constexpr):
    """With ordered dQ, how many programs' reductions into query block m_block (loop position `visit`) come
    before key block n_block's. Without the causal mask every key block adds into every position, program n at
    loop step (visit - S n) mod P (_first_visit's rotation, S = KEYS // ROWS, P = max(positions, S * key blocks)):
    in that order a position's contributors are n = min(visit // S, N - 1), then n - 1, ..., cyclically, each S
    steps after the one before it. Under the causal mask (bottom-right aligned) the key blocks that see a row of
    m_block are 0 .. n_hi, and key block n reaches m_block (m_block - m_lo(n)) steps into its loop, S fewer for
    each later key block: they come from n_hi down to 0. Either way a contributor finds the one before it released
    (a reduction is released once its consumer starts the next block's dQ) without waiting, where no two key blocks
    start at the same query block. Plain arithmetic (tests run it on Python ints)."""
    if causal != 0:
        n_hi = ((m_block + 1) * ROWS - 1 + seqlen_k - seqlen_q) // KEYS
        n_hi = n_hi + (n_key_blocks - 1 - n_hi) * (n_key_blocks - 1 < n_hi)
        rank = n_hi - n_block
    else:
        first = visit // (KEYS // ROWS)
        first = first + (n_key_blocks - 1 - first) * (n_key_blocks - 1 < first)
        rank = (first - n_block + n_key_blocks) % n_key_blocks
    return rank


@gluon.jit
def _counter(counters, visit, blocks_per_head, m_block, n_query_blocks, half):
    """The counter of the dQ tile (query head of loop position `visit`, query block m_block, feature half) among
    counters: this program's (batch, kv head)'s, [group size, n_query_blocks, 2] int32."""
    return counters + ((visit // blocks_per_head) * n_query_blocks + m_block) * 2 + half


@gluon.jit
def _dq_writer(dq_tile, dq_full, dq_empty, dq_desc, batch, q_start, head_k, group_size, m_block_lo, blocks_per_head,
               n_iterations, first_visit, feature0, order):
    """One warp per consumer: adds each block's dQ product, staged by the consumer in dq_tile ([1, ROWS, 1, FEATURES]
    fp32, shared; full when dq_full completes), into the fp32 accumulator's features [feature0, + FEATURES) with one
    TMA reduction (cp.reduce.async.bulk.tensor .add, FA3's path; rows past seqlen_q are clipped) and hands the tile
    back (dq_empty) once the reduction has read it, so that neither the reduction's issue nor its wait is on the
    consumers' path. batch, q_start: the accumulator's batch coordinate and the sequence's first row in it (a varlen
    call's: 0 and its first row; a dense call's: its batch and 0). With ordered dQ (order: (counters of this program's
    (batch, kv head), key block, key blocks, query blocks, seqlen_q, seqlen_k, causal, KEYS); () otherwise) each
    reduction waits for its turn on its tile's counter (_reduction_rank), and once it has completed (cp.async.bulk.
    wait_group 0: its writes have landed) advances the counter with a GPU-scope release, whose fence takes the issuing
    warp over a microsecond under load: here it delays no consumer (the next block's tile is handed back before it)."""
    ROWS: gl.constexpr = dq_tile.shape[1]
    FEATURES: gl.constexpr = dq_tile.shape[3]
    for block in range(n_iterations):
        visit = loop_position(block, first_visit, n_iterations)
        head, m_start = query_block(visit, blocks_per_head, m_block_lo, head_k, group_size, ROWS)
        if len(order) > 0:
            m_block = m_start // ROWS
            counter = _counter(order[0], visit, blocks_per_head, m_block, order[3], feature0 // FEATURES)
            rank = _reduction_rank(order[1], order[2], visit, m_block, order[4], order[5], order[6], ROWS, order[7])
            # read while the consumer finishes the product: its latency is off the path when the turn has come
            seen = gl.load(counter, volatile=True)
        mbarrier.wait(dq_full, block & 1)
        if len(order) > 0:
            _wait_turn(counter, rank, seen)
        _async_reduce_add(dq_desc, [batch, q_start + m_start, head, feature0], dq_tile)
        tma.store_wait(0)
        mbarrier.arrive(dq_empty)
        if len(order) > 0:
            gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, 0;",
                                      "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.atomic_add(counter, 1, sem="release", scope="gpu")


@gluon.jit
def _wait_turn(counter, rank, seen):
    """Spin until `rank` reductions into this dQ tile have completed (its counter reads rank; `seen`: a value read
    earlier, which usually already does), then order the async-proxy reduction that follows after that read."""
    while seen != rank:
        seen = gl.load(counter, volatile=True)
    gl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _dq_product(ds_own, ds_lo, ds_hi, k_lo, k_hi, ds_ready, buffer, use, zero_dq, OVER_ALL_KEYS: gl.constexpr,
                KEY_MAJOR: gl.constexpr):
    """The unscaled dQ product [ROWS, FEATURES] (issued async) of the block whose dS tiles are in buffer `buffer` of
    the [2, ROWS, OWN] dS tiles ([2, OWN, ROWS] dS^T with KEY_MAJOR: read transposed), their `use`-th use: with the
    split by features (OVER_ALL_KEYS), once both consumers' dS are there, dS_0 K_0 + dS_1 K_1 (ds_lo, ds_hi)
    restricted to this consumer's features (k_lo, k_hi); with the split by keys, this consumer's dS (ds_own) times
    its K rows (k_lo)."""
    if OVER_ALL_KEYS:
        mbarrier.wait(ds_ready.index(buffer), use & 1)
        dq = warpgroup_mma(_ds_operand(ds_lo.index(buffer), KEY_MAJOR), k_lo, zero_dq, use_acc=False, is_async=True)
        dq = warpgroup_mma(_ds_operand(ds_hi.index(buffer), KEY_MAJOR), k_hi, dq, is_async=True)
    else:
        dq = warpgroup_mma(_ds_operand(ds_own.index(buffer), KEY_MAJOR), k_lo, zero_dq, use_acc=False,
                           is_async=True)
    return dq


@gluon.jit
def _ds_operand(ds_tile, KEY_MAJOR: gl.constexpr):
    """dS [ROWS, OWN] as a wgmma's A operand: the tile itself, or the transposed view of a dS^T tile."""
    if KEY_MAJOR:
        return ds_tile.permute((1, 0))
    else:
        return ds_tile


@gluon.jit
def _publish_ds(ds, ds_tile, ds_sync):
    """Store this consumer's dS (or dS^T) into its shared tile for the dQ products: after the tile's previous
    block's dQ products completed and, with ds_sync ((ds_free barrier, phase, whether to wait, ds_ready barrier);
    () with the split by keys), announced to the other consumer once every thread's store is visible to wgmma."""
    if len(ds_sync) > 0:
        mbarrier.wait(ds_sync[0], ds_sync[1], pred=ds_sync[2])
    ds_tile.store(ds)
    fence_async_shared()
    gl.thread_barrier()
    if len(ds_sync) > 0:
        mbarrier.arrive(ds_sync[3])


@gluon.jit
def _scores(s_left, s_right, dp_left, dp_right, lse_tile, KEY_AXIS: gl.constexpr, EARLY_LSE: gl.constexpr):
    """S = s_left s_right^T and dP = dp_left dp_right^T [M, N] (operands [M, WIDTH] / [N, WIDTH] per chunk, shared;
    M: s_left's rows) issued together, S waited for while dP's wgmmas (one per chunk) stay in flight, and log2(e)
    * lse along S's query axis (lse_tile: the rows' [1, ROWS] shared lse; KEY_AXIS: S's key axis, 1 for Q K^T, 0
    for K Q^T), loaded before S is waited for with EARLY_LSE (its latency hidden; calls with ALiBi load it after,
    which keeps their bias arithmetic from spilling). Returns (S, dP, lse_log2)."""
    M: gl.constexpr = s_left[0].shape[0]
    N: gl.constexpr = s_right[0].shape[0]
    ROWS: gl.constexpr = N if KEY_AXIS == 0 else M
    # [M, N]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    zero = gl.zeros([M, N], gl.float32, layout)
    s = chained_products(s_left, s_right, zero)
    dp = chained_products(dp_left, dp_right, zero)
    if EARLY_LSE:
        # [ROWS] loaded while S is computed, so that its latency is not added to the softmax's
        lse = lse_tile.reshape([ROWS]).load(gl.SliceLayout(KEY_AXIS, layout))
        s = warpgroup_mma_wait(len(dp_left), deps=(s, ))
    else:
        s = warpgroup_mma_wait(len(dp_left), deps=(s, ))
        lse = lse_tile.reshape([ROWS]).load(gl.SliceLayout(KEY_AXIS, layout))
    return s, dp, lse * 1.4426950408889634


@gluon.jit
def _row_major_block(q_tile, do_tile, k_own, v_own, statistics, p_tile, ds_tile, ds_sync, dk, dv, first_key, m_start,
                     seqlen_q, seqlen_k, qk_scale_log2, causal, window, alibi, softcap, draws):
    """One query block's dK / dV products (issued, not waited for) from row-major scores: S = Q K^T and dP = dO V^T
    [ROWS, OWN], P and dS through shared memory (p_tile [ROWS, OWN]; ds_tile, published by _publish_ds) as the
    transposed A operands of dV += P^T dO and dK += dS^T Q. statistics: the rows' ([1, ROWS] shared) lse and delta.
    draws: () or dropout's (key, stream, 1 / (1 - p)): the forward's mask (dropout.dropped) scales P for dV and dP
    for dS. alibi, softcap (not with dropout): masked_probabilities'; with softcap dS takes P (1 - tanh^2)."""
    ROWS: gl.constexpr = q_tile[0].shape[0]
    OWN: gl.constexpr = k_own[0].shape[0]
    dtype: gl.constexpr = k_own[0].dtype
    # [ROWS, OWN] S and dP (in flight); [ROWS] log2(e) * lse
    s, dp, lse_log2 = _scores(q_tile, k_own, do_tile, v_own, statistics[0], 1, len(alibi) == 0)
    s_layout: gl.constexpr = s.type.layout
    row_of_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    # [ROWS, OWN] P
    p, tanh_factor = masked_probabilities(s, lse_log2, qk_scale_log2, first_key, m_start, seqlen_q, seqlen_k,
                                          causal, window, 1, alibi, softcap)
    delta = statistics[1].reshape([ROWS]).load(row_of_s)
    if len(draws) > 0:
        gl.static_assert(len(softcap) == 0, "the Gluon backward takes softcap without dropout")
        # [ROWS, OWN] P where the forward kept it times 1 / (1 - p), 0 where it dropped it
        kept = dropped(p, first_key // OWN, row_draws(draws[0], draws[1], m_start + gl.arange(0, ROWS, row_of_s)),
                       gl.SliceLayout(0, s_layout)) * draws[2]
        # this consumer's previous dV product (the reader of p_tile) completed last iteration
        p_tile.store(kept.to(dtype))
        # [ROWS, OWN] P delta, so that only the kept P stays live across the wait
        p = p * gl.expand_dims(delta, 1)
        dp = warpgroup_mma_wait(0, deps=(dp, ))
        # [ROWS, OWN] dS = P (dP kept / (1 - p) - delta)
        ds = (kept * dp - p).to(dtype)
    else:
        p_tile.store(p.to(dtype))
        if len(softcap) > 0:
            # [ROWS, OWN] P (1 - tanh^2): the capped logits' derivative, for dS only
            p = p * tanh_factor
        dp = warpgroup_mma_wait(0, deps=(dp, ))
        ds = (p * (dp - gl.expand_dims(delta, 1))).to(dtype)
    _publish_ds(ds, ds_tile, ds_sync)
    dv = accumulate_products(p_tile.permute((1, 0)), do_tile, dv)
    dk = accumulate_products(ds_tile.permute((1, 0)), q_tile, dk)
    return dk, dv


@gluon.jit
def _key_major_block(q_tile, do_tile, k_own, v_own, statistics, ds_tile, ds_sync, dk, dv, first_key, m_start,
                     seqlen_q, seqlen_k, qk_scale_log2, causal, window, alibi, softcap):
    """One query block's dK / dV products (issued, not waited for) from key-major scores: S^T = K Q^T and dP^T =
    V dO^T [OWN, ROWS], so that P^T and dS^T are in registers as the A operands of dV += P^T dO and dK += dS^T Q
    (no P tile; the dV product is issued before dP is waited for); dS^T goes to ds_tile [OWN, ROWS] for the dQ
    products (_publish_ds). statistics: the rows' ([1, ROWS] shared) lse and delta, read per column. alibi, softcap:
    masked_probabilities' (with softcap dS takes P (1 - tanh^2))."""
    ROWS: gl.constexpr = q_tile[0].shape[0]
    dtype: gl.constexpr = k_own[0].dtype
    # delta loaded before dP is waited for where the dK / dV accumulators leave the registers for it (below head dim
    # 128: at 128 the consumers would spill)
    EARLY_DELTA: gl.constexpr = chunks_width(q_tile) < 128
    # [OWN, ROWS] S^T and dP^T (in flight); [ROWS] log2(e) * lse
    s_t, dp_t, lse_log2 = _scores(k_own, q_tile, v_own, do_tile, statistics[0], 0, len(alibi) == 0)
    column_of_t: gl.constexpr = gl.SliceLayout(0, s_t.type.layout)
    # [OWN, ROWS] P^T
    p_t, tanh_factor = masked_probabilities(s_t, lse_log2, qk_scale_log2, first_key, m_start, seqlen_q, seqlen_k,
                                            causal, window, 0, alibi, softcap)
    dv = accumulate_register_products(p_t.to(dtype), do_tile, dv)
    if len(softcap) > 0:
        # [OWN, ROWS] P^T (1 - tanh^2): the capped logits' derivative, for dS^T only
        p_t = p_t * tanh_factor
    # [ROWS] delta; the dV wgmmas (one per chunk) stay in flight
    if EARLY_DELTA:
        delta = statistics[1].reshape([ROWS]).load(column_of_t)
        dp_t = warpgroup_mma_wait(len(dv), deps=(dp_t, ))
    else:
        dp_t = warpgroup_mma_wait(len(dv), deps=(dp_t, ))
        delta = statistics[1].reshape([ROWS]).load(column_of_t)
    # [OWN, ROWS] dS^T
    ds_t = (p_t * (dp_t - gl.expand_dims(delta, 0))).to(dtype)
    dk = accumulate_register_products(ds_t, q_tile, dk)
    _publish_ds(ds_t, ds_tile, ds_sync)
    return dk, dv


@gluon.jit
def _finish_dq(block, ds_own, ds_lo, ds_hi, k_lo, k_hi, ds_ready, ds_free, zero_dq, dq_tile, dq_full, dq_empty,
               head_k, group_size, m_block_lo, blocks_per_head, n_iterations, first_visit, seqlen_q, softmax_scale,
               rows_masked, swapped_dq, OVER_ALL_KEYS: gl.constexpr, KEY_MAJOR: gl.constexpr):
    """Loop iteration `block`'s dQ: its product (_dq_product; waiting for it also completes every wgmma this
    consumer issued before it, as wgmma groups complete in order), then, with the split by features, its dS buffer
    released for block + 2 (ds_free), and the scaled product staged in dq_tile for this consumer's writer warp
    (_dq_writer), once the writer has handed back the tile of the block before (dq_empty). rows_masked (0, ) for a
    varlen call: a block that runs past the sequence's end adds zeros to the rows past it, which are the next
    sequence's in the accumulator (its dS rows there are 0, but 0 times a K row that is not finite is not).
    swapped_dq: _staging_order's."""
    ROWS: gl.constexpr = zero_dq.shape[0]
    FEATURES: gl.constexpr = zero_dq.shape[1]
    dq = _dq_product(ds_own, ds_lo, ds_hi, k_lo, k_hi, ds_ready, block % 2, block // 2, zero_dq, OVER_ALL_KEYS,
                     KEY_MAJOR)
    dq = warpgroup_mma_wait(0, deps=(dq, ))
    if OVER_ALL_KEYS:
        arrive_after_wgmma(ds_free.index(block % 2))
    if len(rows_masked) > 0:
        head, m_start = query_block(loop_position(block, first_visit, n_iterations), blocks_per_head, m_block_lo,
                                    head_k, group_size, ROWS)
        if m_start + ROWS > seqlen_q:
            # [ROWS] the block's rows in the sequence
            rows = m_start + gl.arange(0, ROWS, gl.SliceLayout(1, dq.type.layout))
            dq = gl.where(gl.expand_dims(rows < seqlen_q, 1), dq, 0.0)
    mbarrier.wait(dq_empty, (block - 1) & 1, pred=block > 0)
    dq_tile.reshape([ROWS, FEATURES]).store(_staging_order(dq * softmax_scale, swapped_dq))
    fence_async_shared()
    mbarrier.arrive(dq_full)


@gluon.jit
def _staging_order(dq, swapped_dq):
    """dq [ROWS, FEATURES] as staged for its reduction: with swapped_dq ((0, ): the launcher's SWAPPED_DQ) and 64
    features, column c at the column whose index has c's bits 2 and 4 swapped (the accumulator's 64-column groups
    hold that order; ops/hopper.unswapped_dq reads them back), so that its 64-bit shared stores are conflict-free: a
    store is served per half-warp, whose lanes hold 4 rows of 2 x 4 columns, and the 128-byte swizzle XORs a 16-byte
    chunk's index with its row, which puts rows r and r ^ 1 on the same banks in the plain order (two wavefronts
    where one does); swapped, the lane-held column bit (2) selects the chunk index's top bit. Registers are only
    relabeled (a permuted layout, no data moves)."""
    ROWS: gl.constexpr = dq.shape[0]
    FEATURES: gl.constexpr = dq.shape[1]
    if len(swapped_dq) > 0 and FEATURES == 64:
        # [ROWS, 2, 2, 2, 2, 2, 2]: column bits 5 .. 0, bits 4 and 2 swapped
        bits = gl.permute(gl.reshape(dq, [ROWS, 2, 2, 2, 2, 2, 2]), (0, 1, 4, 3, 2, 5, 6))
        dq = gl.reshape(bits, [ROWS, FEATURES])
    return dq


@gluon.jit
def _consumer(k_own, v_own, k_lo, k_hi, q_smem, do_smem, lse_smem, delta_smem, p_own, ds_own, ds_lo, ds_hi, dq_tile,
              kv_ready, q_ready, q_empty, ds_ready, ds_free, dq_full, dq_empty, DK, DV, stride_dk_b, stride_dk_n,
              stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h, batch, head_k, n_start, head_dim, aligned, k_start,
              rows_masked, swapped_dq, key0, group_size, m_block_lo, blocks_per_head, n_iterations, seqlen_q,
              seqlen_k, softmax_scale, qk_scale_log2, causal, first_visit, window, dropout, alibi, softcap):
    """One warpgroup: keys [n_start + key0, + OWN) of the block (k_own, v_own: their K and V rows [OWN, WIDTH] per
    chunk of the head dim; p_own: () with key-major scores, else (its [ROWS, OWN] P tile, ); ds_own: its two dS
    tiles in shared memory, [2, ROWS, OWN], or dS^T [2, OWN, ROWS] with key-major scores); dK / dV over every query
    block (an accumulator per chunk), and its share of each block's dQ (FEATURES columns): with the split by
    features dS (both halves: ds_lo, ds_hi) times the K rows of each half restricted to those features (k_lo, k_hi
    [OWN, FEATURES]); with the split by keys this consumer's dS times its K rows (k_lo [OWN, HEAD_DIM]; k_hi and
    ds_hi unused). q_smem, do_smem: [STAGES, 1, ROWS, 1, WIDTH] per chunk. Each block's scaled dQ product is staged
    in dq_tile ([1, ROWS, 1, FEATURES] fp32, shared; dq_full / dq_empty: its hand-over) for this consumer's writer
    warp (_dq_writer), which adds it into the accumulator. dropout: () or (RngState, keep_threshold, dropout_scale,
    query heads): the forward's mask (dropout.dropped) scales P for dV and dP for dS. alibi: () or (the slopes of
    the program's batch, pure-causal flag): each query block's logits get its head's ALiBi bias (common.alibi_bias).
    softcap: () or (softcap_in_scale, softcap_out_log2): capped logits (common.capped_logits).
    Varlen (rows_masked (0, ); () for a dense call): batch is the descriptors' coordinate 0, k_start the sequence's
    first key row, seqlen_q / seqlen_k its lengths (the Q / dO stages' rows past seqlen_q read zeros, lse and delta
    0, as a dense call's rows past its end do)."""
    STAGES: gl.constexpr = q_smem[0].shape[0]
    ROWS: gl.constexpr = q_smem[0].shape[2]
    HEAD_DIM: gl.constexpr = chunks_width(q_smem)
    OWN: gl.constexpr = k_own[0].shape[0]
    FEATURES: gl.constexpr = k_lo.shape[1]
    # dQ over every key of the block (features split between the consumers), or over this consumer's keys
    OVER_ALL_KEYS: gl.constexpr = FEATURES < HEAD_DIM
    # blocks between a block's dS and its dQ product
    LAG: gl.constexpr = 1 if OVER_ALL_KEYS else 0
    # scores K Q^T [OWN, ROWS] (P^T and dS^T feed dV and dK from registers), or Q K^T [ROWS, OWN] (P and dS go
    # through shared memory): p_own is () or the [ROWS, OWN] P tile
    KEY_MAJOR: gl.constexpr = len(p_own) == 0
    # [ROWS, FEATURES] dQ
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, FEATURES, 16])
    zero_dq = gl.zeros([ROWS, FEATURES], gl.float32, dq_layout)
    # [OWN, WIDTH] per chunk: dK, dV
    dk = zero_accumulators(OWN, k_own)
    dv = zero_accumulators(OWN, v_own)
    first_key = n_start + key0
    if len(dropout) > 0:
        gl.static_assert(not KEY_MAJOR, "the forward's dropout mask follows the row-major score tiles")
        # the key of the forward's mask, the stream of this program's (batch, query head), its scale
        dropout_draws = (dropout_key(dropout[0], dropout[1]), batch * dropout[3], dropout[2])
    else:
        dropout_draws = ()
    mbarrier.wait(kv_ready, 0)
    for i in range(n_iterations):
        stage = i % STAGES
        head, m_start = query_block(loop_position(i, first_visit, n_iterations), blocks_per_head, m_block_lo,
                                    head_k, group_size, ROWS)
        mbarrier.wait(q_ready.index(stage), (i // STAGES) & 1)
        # [ROWS, WIDTH] per chunk: Q_i, dO_i
        q_tile = matrices_of(entries_of(q_smem, stage))
        do_tile = matrices_of(entries_of(do_smem, stage))
        # [1, ROWS] the rows' lse and delta; rows past seqlen_q read 0 for both, as their Q and dO rows do, so that
        # every product they enter (dV, dK, and dQ rows the reduction clips) adds zeros
        statistics = (lse_smem.index(stage), delta_smem.index(stage))
        # dS buffer i % 2; its previous use (block i - 2) is free once the dQ products of that block completed;
        # with the split by features the other consumer waits for both dS of a block (ds_ready)
        buffer = i % 2
        if OVER_ALL_KEYS:
            ds_sync = (ds_free.index(buffer), ((i // 2) - 1) & 1, i >= 2, ds_ready.index(buffer))
        else:
            ds_sync = ()
        if len(alibi) > 0:
            # the block's head's slope in log2 units, and the pure-causal flag
            alibi_head = (gl.load(alibi[0] + head) * 1.4426950408889634, alibi[1])
        else:
            alibi_head = ()
        if KEY_MAJOR:
            dk, dv = _key_major_block(q_tile, do_tile, k_own, v_own, statistics, ds_own.index(buffer), ds_sync, dk,
                                      dv, first_key, m_start, seqlen_q, seqlen_k, qk_scale_log2, causal, window,
                                      alibi_head, softcap)
        else:
            if len(dropout) > 0:
                draws = (dropout_draws[0], dropout_draws[1] + head, dropout_draws[2])
            else:
                draws = ()
            dk, dv = _row_major_block(q_tile, do_tile, k_own, v_own, statistics, p_own[0], ds_own.index(buffer),
                                      ds_sync, dk, dv, first_key, m_start, seqlen_q, seqlen_k, qk_scale_log2, causal,
                                      window, alibi_head, softcap, draws)
        if i >= LAG:
            # block i - LAG's dQ: with the split by features one block late, as the other consumer wrote its dS a
            # block ago (not waiting for it lets the two consumers drift out of phase); its wait completes this
            # block's dV and dK products too
            _finish_dq(i - LAG, ds_own, ds_lo, ds_hi, k_lo, k_hi, ds_ready, ds_free, zero_dq, dq_tile, dq_full,
                       dq_empty, head_k, group_size, m_block_lo, blocks_per_head, n_iterations, first_visit, seqlen_q,
                       softmax_scale, rows_masked, swapped_dq, OVER_ALL_KEYS, KEY_MAJOR)
        dk, dv = wait_accumulators(dk, dv)
        arrive_after_wgmma(q_empty.index(stage))
    if OVER_ALL_KEYS:
        # the last block's dQ (its ds_free arrival has no waiter)
        if n_iterations > 0:
            _finish_dq(n_iterations - 1, ds_own, ds_lo, ds_hi, k_lo, k_hi, ds_ready, ds_free, zero_dq, dq_tile,
                       dq_full, dq_empty, head_k, group_size, m_block_lo, blocks_per_head, n_iterations, first_visit,
                       seqlen_q, softmax_scale, rows_masked, swapped_dq, OVER_ALL_KEYS, KEY_MAJOR)
    # [OWN, WIDTH] per chunk: this consumer's key rows
    column = 0
    for chunk in gl.static_range(len(dk)):
        store_key_rows(dk[chunk], dv[chunk], DK, DV, stride_dk_b, stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n,
                       stride_dv_h, batch, head_k, k_start + n_start + key0, column, k_start + seqlen_k, head_dim,
                       aligned, softmax_scale)
        column = column + dk[chunk].shape[1]


@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "head_dim", "heads_per_group", "window_left", "window_right",
                              "q_rows", "k_rows", "lse_row_stride", "delta_row_stride"])
def attn_bwd_hopper_kernel(k_desc, v_desc, q_desc, do_desc, dq_desc, k_desc2, v_desc2, q_desc2, do_desc2, dq_desc2,
                           lse_desc, delta_desc, DK, DV, dq_counters,
                           stride_dk_b, stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h,
                           num_heads_k, group_size, seqlen_q, seqlen_k, head_dim, heads_per_group, softmax_scale,
                           qk_scale_log2, window_left, window_right, dropout_args, alibi_args, softcap_args, varlen,
                           q_rows, k_rows, lse_row_stride, delta_row_stride, CAUSAL: gl.constexpr,
                           LOCAL: gl.constexpr, ORDERED: gl.constexpr, KEY_MAJOR: gl.constexpr,
                           ALIGNED_ROWS: gl.constexpr, SWAPPED_DQ: gl.constexpr, SOFTCAP: gl.constexpr,
                           STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """k_desc ... dq_desc: the descriptors of the first chunk of the head dim's tiles (column 0 on), k_desc2 ...
    dq_desc2 those of the second (from the first one's width on; configs.HOPPER_BWD_CHUNKS: 80 = 64 + 16, 96 = 64 +
    32), None where one chunk covers it: S and dP chain a wgmma per chunk, dK and dV keep an accumulator per chunk,
    and dQ is split by chunks, consumer w adding chunk w's features (dq_desc / dq_desc2). One chunk: head dim 128
    splits dQ by 64-feature halves (dq_desc's width), 64 by keys.
    One program per (128-key block, batch * kv head), key blocks in order (under a causal mask the blocks seen
    by the most query rows first), in launch-order groups of heads_per_group (batch, kv head) pairs. num_warps (4)
    is the first consumer's; the second consumer (4 warps, CONSUMER_REGS registers) and the producer (1 warp) are
    worker partitions, and so are the two dQ writers (1 warp each). ORDERED (head dim 128): every query
    block's dQ reductions come in one fixed order (_reduction_rank; dq_counters: zeroed int32, two per (batch, head,
    64-row query block), one per feature half), so dQ is the same bits every call; a key block's reductions wait for
    the next key block's, so those launch first (LAST_FIRST), and without the causal mask the first key block's for
    the last's (the loops are a rotation), so the launcher gives it launch-order groups of one head and at most one
    key block per SM (all of a head's key blocks resident together). LOCAL: a local window (window_left,
    window_right, normalized as kernels/common's): each key block loops over the query blocks whose windows meet it
    and masks both edges (common.masked_probabilities); not with ORDERED. dropout_args: (RngState, keep_threshold,
    dropout_scale), RngState None without dropout: the forward's mask (kernels/hopper/dropout.py) drops P and dP.
    alibi_args: (AlibiSlopes, stride_alibi_b, alibi_pure_causal), AlibiSlopes None without ALiBi (stride_alibi_b 0 for
    (H,) slopes): the logits get kernels/common.alibi_bias_log2's bias. softcap_args: (softcap_in_scale,
    softcap_out_log2), read with SOFTCAP (not with dropout): capped logits (ScoreParams.kernel_scores'), dS times
    1 - tanh^2. Varlen (varlen: (CuSeqlensQ, CuSeqlensK, Q, K,
    V, DOut, LSE, DELTA), None pointers for a dense call; not with ORDERED or dropout): q, k, v, dout, dq's accumulator,
    dk and dv are (1, T, H, D) to the descriptors (q_rows / k_rows: T of q / k), seqlen_q / seqlen_k the longest
    lengths; each program's sequence (common.key_block_of_program's bounds) gets its own descriptors, made by the
    producer (the partition whose TMA loads use them) over its rows only, so rows past it read zeros as a dense call's
    rows past its end do; dQ is reduced at the sequence's rows of the accumulator (rows past it add zeros), dK / dV
    stored at its key rows, and lse / delta copied by the producer from its rows of the (H, T) matrices LSE and DELTA
    (rows lse_row_stride / delta_row_stride apart; lse_desc and delta_desc then only type the stage buffers).
    ALIGNED_ROWS: DK and DV take 16-byte stores (common.store_rows' `aligned`). SWAPPED_DQ: dQ's 64-feature boxes
    enter the accumulator in _staging_order's order (ops/hopper.unswapped_dq reads it back)."""
    KEYS: gl.constexpr = k_desc.block_type.shape[1]
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = k_desc.dtype
    k_descs, v_descs = chunk_descriptors(k_desc, k_desc2), chunk_descriptors(v_desc, v_desc2)
    q_descs, do_descs = chunk_descriptors(q_desc, q_desc2), chunk_descriptors(do_desc, do_desc2)
    CHUNKED: gl.constexpr = len(k_descs) > 1
    # the local window, or () without one (a tuple's length reaches the partitions where a constexpr does not)
    if LOCAL:
        gl.static_assert(not ORDERED, "ordered dQ takes no local window")
        window = (window_left, window_right)
    else:
        window = ()
    if varlen[0] is not None:
        gl.static_assert(not ORDERED, "ordered dQ takes no varlen call")
        gl.static_assert(dropout_args[0] is None, "the Gluon backward takes no varlen call with dropout")
        seqs = (varlen[0], varlen[1], q_rows, k_rows)
    else:
        seqs = ()
    batch, head_k, n_start, m_block_lo, blocks_per_head, n_iterations, bounds = key_block_of_program(
        num_heads_k, group_size, seqlen_q, seqlen_k, heads_per_group, window, KEYS, ROWS, CAUSAL, ORDERED, seqs)
    q_start, seqlen_q, k_start, seqlen_k = bounds
    if len(seqs) > 0:
        # the producer makes the sequence's own descriptors (rows past it read zeros; common.backward_producer), at
        # the descriptors' batch coordinate 0; K and V load only where the block holds keys of it; (0, ): the
        # consumers' flag for rows past the sequence
        sequence = (varlen[2], varlen[5], varlen[3], varlen[4], q_start, seqlen_q, k_start, seqlen_k, varlen[6],
                    varlen[7], lse_row_stride, delta_row_stride)
        desc_batch = q_start * 0
        load_kv = (n_start < seqlen_k).to(gl.int32)
        rows_masked = (0, )
    else:
        sequence = ()
        desc_batch = batch
        load_kv = gl.to_tensor(1)
        rows_masked = ()
    # per chunk: [1, 1, KEYS, 1, WIDTH] K, V; [STAGES, 1, ROWS, 1, WIDTH] Q, dO
    k_smem = allocate_chunks(k_descs, 1)
    v_smem = allocate_chunks(v_descs, 1)
    q_smem = allocate_chunks(q_descs, STAGES)
    do_smem = allocate_chunks(do_descs, STAGES)
    HEAD_DIM: gl.constexpr = chunks_width(k_smem)
    OWN: gl.constexpr = KEYS // 2
    # [2, 2, ROWS, OWN] each consumer's dS tiles of two blocks in turn (a block's dQ product runs during the next
    # block), [2, 2, OWN, ROWS] dS^T with KEY_MAJOR; without it [2, ROWS, OWN] each consumer's P tile
    ds_shape: gl.constexpr = [OWN, ROWS] if KEY_MAJOR else [ROWS, OWN]
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(ds_shape, dtype)
    ds_smem = (gl.allocate_shared_memory(dtype, [2] + ds_shape, pds_layout),
               gl.allocate_shared_memory(dtype, [2] + ds_shape, pds_layout))
    if KEY_MAJOR:
        p_tiles = ((), ())
    else:
        p_smem = gl.allocate_shared_memory(dtype, [2, ROWS, OWN], pds_layout)
        p_tiles = ((p_smem.index(0), ), (p_smem.index(1), ))
    # [STAGES, 1, ROWS] log2(e) * lse and delta of the Q / dO stages' rows
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    # [1, ROWS, 1, FEATURES] each consumer's fp32 dQ product on its way to the accumulator (chunked: consumer w's
    # features are chunk w's)
    if CHUNKED:
        dq_tiles = (allocate_chunks((dq_desc, ), 1)[0].index(0), allocate_chunks((dq_desc2, ), 1)[0].index(0))
        dq_descs = (dq_desc, dq_desc2)
    else:
        dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
        dq_tiles = (dq_smem.index(0), dq_smem.index(1))
        dq_descs = (dq_desc, dq_desc)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for stage in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(stage), count=1)
        mbarrier.init(q_empty.index(stage), count=2)
    for buffer in gl.static_range(2):
        mbarrier.init(ds_ready.index(buffer), count=2)
        mbarrier.init(ds_free.index(buffer), count=2)
    # constexprs arrive in partitions as plain ints (Triton 3.6): the flag and key offsets travel as tensors
    causal = gl.to_tensor(CAUSAL).to(gl.int32)
    # dQ: by chunks where there are two, else head dim 128 split by features (64 each), head dim 64 by keys (dq_desc's
    # tile: [1, ROWS, 1, FEATURES])
    gl.static_assert(CHUNKED | (HEAD_DIM == 64) | (HEAD_DIM == 128),
                     "the Gluon backward takes head dim 64 or 128 or tiles of two chunks")
    FEATURES: gl.constexpr = dq_desc.block_type.shape[3]
    SPLIT_FEATURES: gl.constexpr = FEATURES < HEAD_DIM
    # [KEYS, WIDTH] per chunk: K and V of the block
    k_flat = matrices_of(entries_of(k_smem, 0))
    v_flat = matrices_of(entries_of(v_smem, 0))
    pointers = (DK, DV, stride_dk_b, stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h, desc_batch,
                head_k, n_start, head_dim, (0, ) if ALIGNED_ROWS else (), k_start, rows_masked,
                (0, ) if SWAPPED_DQ else ())
    if ORDERED:
        n_block = n_start // KEYS
        n_query_blocks = gl.cdiv(seqlen_q, ROWS)
        gl.static_assert(SPLIT_FEATURES & (not CHUNKED), "ordered dQ takes the split by features (head dim 128)")
        # the loop starts at position 2 n_block (not under the causal mask); the counters of this (batch, kv
        # head)'s query heads, and what the writers' _reduction_rank needs
        first_visit = _first_visit(n_block, n_iterations, 1 - causal, KEYS // ROWS)
        counters = dq_counters + (batch * num_heads_k + head_k) * (group_size * n_query_blocks * 2)
        order = (counters, n_block, gl.cdiv(seqlen_k, KEYS), n_query_blocks, seqlen_q, seqlen_k, causal, KEYS)
    else:
        first_visit = gl.to_tensor(0)
        order = ()
    loop = (group_size, m_block_lo, blocks_per_head, n_iterations, seqlen_q, seqlen_k, softmax_scale, qk_scale_log2,
            causal, first_visit, window)
    # dropout's (RngState, keep_threshold, dropout_scale, query heads), or ()
    if dropout_args[0] is not None:
        dropout = dropout_args + (num_heads_k * group_size, )
    else:
        dropout = ()
    # ALiBi's (slopes of this program's batch, pure-causal flag), or ()
    if alibi_args[0] is not None:
        alibi = (alibi_args[0] + batch.to(gl.int64) * alibi_args[1], alibi_args[2])
    else:
        alibi = ()
    # softcap's (softcap_in_scale, softcap_out_log2), or ()
    if SOFTCAP:
        softcap = softcap_args
    else:
        softcap = ()
    barriers = (kv_ready, q_ready, q_empty, ds_ready, ds_free)
    # each consumer's staged dQ tile full / handed back by its writer warp
    dq_full = (gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout()),
               gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout()))
    dq_empty = (gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout()),
                gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout()))
    for w in gl.static_range(2):
        mbarrier.init(dq_full[w], count=1)
        mbarrier.init(dq_empty[w], count=1)
    # [OWN, WIDTH] per chunk: each consumer's key half of K and V
    k_halves = (key_rows(k_flat, 0, OWN), key_rows(k_flat, OWN, OWN))
    v_halves = (key_rows(v_flat, 0, OWN), key_rows(v_flat, OWN, OWN))
    if CHUNKED:
        # consumer w: chunk w's features of K's two key halves
        first_dq = (k_halves[0][0], k_halves[1][0])
        second_dq = (k_halves[0][1], k_halves[1][1])
        second_feature = k_flat[0].shape[1]
    elif SPLIT_FEATURES:
        # consumer w: features [64w, 64w + 64) of K's two key halves
        first_dq = (k_halves[0][0].slice(0, FEATURES, dim=1), k_halves[1][0].slice(0, FEATURES, dim=1))
        second_dq = (k_halves[0][0].slice(FEATURES, FEATURES, dim=1), k_halves[1][0].slice(FEATURES, FEATURES, dim=1))
        second_feature = FEATURES
    else:
        first_dq = (k_halves[0][0], k_halves[0][0])
        second_dq = (k_halves[1][0], k_halves[1][0])
        second_feature = 0
    staged = (q_smem, do_smem, lse_smem, delta_smem)
    first = (k_halves[0], v_halves[0]) + first_dq + staged + (p_tiles[0], ds_smem[0]) + ds_smem + (
        dq_tiles[0], )
    second = (k_halves[1], v_halves[1]) + second_dq + staged + (p_tiles[1], ds_smem[1]) + ds_smem + (
        dq_tiles[1], )
    first = first + barriers + (dq_full[0], dq_empty[0]) + pointers + (gl.to_tensor(0), ) + loop + (
        dropout, alibi, softcap)
    second = second + barriers + (dq_full[1], dq_empty[1]) + pointers + (gl.to_tensor(OWN), ) + loop + (
        dropout, alibi, softcap)
    placement = (desc_batch, q_start, head_k, group_size, m_block_lo, blocks_per_head, n_iterations, first_visit)
    writers = ((dq_tiles[0], dq_full[0], dq_empty[0], dq_descs[0]) + placement + (gl.to_tensor(0), order),
               (dq_tiles[1], dq_full[1], dq_empty[1], dq_descs[1]) + placement + (gl.to_tensor(second_feature), order))
    producer = (k_descs, v_descs, q_descs, do_descs, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem,
                lse_smem, delta_smem, kv_ready, q_ready, q_empty, desc_batch, head_k, n_start,
                num_heads_k * group_size, group_size, m_block_lo, blocks_per_head, n_iterations, first_visit, q_start,
                load_kv, sequence)
    gl.warp_specialize([(_consumer, first), (_consumer, second), (backward_producer, producer),
                        (_dq_writer, writers[0]), (_dq_writer, writers[1])], [4, 1, 1, 1], [CONSUMER_REGS, 24, 24, 24])

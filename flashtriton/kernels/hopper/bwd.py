"""Backward dK / dV and dQ for Hopper (sm_90) at head dims 64 and 128 in Gluon, warp-specialized, FA3's division of
the work: one program per 128-key block, a one-warp TMA producer streaming Q / dO blocks of 64 rows, two consumer
warpgroups that each own 64 keys of the block (their dK, dV accumulators stay in registers for the whole loop) and
share the query blocks.

Per query block i (64 rows), consumer w (keys [64w, 64w + 64) of the block), every product an M = 64 wgmma:
  S = Q_i K_w^T, dP = dO_i V_w^T                  [64 rows, 64 keys], both issued async, then waited
  (Q_i, dO_i and their rows' lse and delta arrive by TMA in one stage of the producer's pipeline)
  P = exp2(S * scale * log2 e - lse_i * log2 e), dS = P (dP - delta_i); P and dS go to shared memory
  dV_w += P^T dO_i, dK_w += dS^T Q_i              (P^T, dS^T: transposed views of the shared tiles)
  dQ_i is split one of two ways:
  - head dim 128, by features: once both consumers' dS are there (ds_ready), consumer w computes
    dQ_i[:, 64w:64w+64] = dS_0 K_0[:, 64w:64w+64] + dS_1 K_1[:, 64w:64w+64] (both key halves), one block late
    (during block i + 1, dS double-buffered) so that neither consumer waits for the other's dS of the same block:
    their softmax phases drift apart and overlap each other's wgmmas;
  - head dim 64, by keys: consumer w computes every feature from its own keys, dS_w K_w, with no barrier
    between the consumers but twice the reductions.
  Each consumer scales its [64 rows, 64 features] product by the softmax scale, stores it to a shared fp32 tile and
  adds that to the fp32 dQ accumulator with one TMA reduction (cp.reduce.async.bulk.tensor .add, FA3's path; per
  element atomics would cost about half of the kernel's time). The launcher converts the accumulator into dq. dK is
  scaled here. GQA: the loop runs over the group's query heads too (dK/dV summed in registers).

Ordered dQ (ORDERED, head dim 128; deterministic=True, ops/hopper.orders_dq): the reductions into each (query
block, feature half) come in one fixed order, so dQ is the same bits on every call. A zeroed int32 counter per tile
counts the reductions that have completed; a reduction waits until it reads its rank (_reduction_rank; the counter
is read while the dQ product runs, and spun on only if the turn has not come). When a consumer starts its next
block's dQ it reports the previous reduction (cp.async.bulk.wait_group 0: its writes have landed) to a one-warp
releaser partition of its own (_releaser), which advances the counter with a GPU-scope release: that fence costs
the issuing warp over a microsecond under load, too much for the consumer's loop. Without the causal mask the key
blocks' loops are a rotation, two query blocks apart, and under it they start at the diagonal, so each contributor
finds the one before it (a later key block) released: the later key blocks launch first and all of a head's key
blocks must be resident together (the launcher's groups of one head, at most one key block per SM).

Scope (ops/hopper.covers): the forward's (dense bf16/fp16, any window, bottom-right aligned, local ones not with
ORDERED; no softcap, ALiBi or dropout), head dim 64 / 128 (narrower ones on these tiles). Keys past seqlen_k are masked
out of P (their dK/dV rows are never stored; their K rows read as zeros, but P would not be 0); query rows past seqlen_q
read Q, dO, lse and delta as zeros (TMA fills them), so P = 1 there but dS = 0 and every product they enter adds zeros
(dQ rows past a dense call's seqlen_q are clipped by the reduction; a varlen call's, the next sequence's rows in the
accumulator, get zeros: _finish_dq).

Synchronisation: kv_ready (K and V landed), q_ready[s] (Q_i, dO_i, lse_i and delta_i of stage s landed), q_empty[s]
(both consumers are done with stage s, count 2), with the feature split ds_ready (both consumers' dS written, count
2) and ds_free (both consumers' dQ products of a block completed, count 2: its dS buffer may be rewritten), one of
each per dS buffer. Each consumer's P tile is read only by its own dV product, which it waits for before the next
iteration; its dQ tile is rewritten after tma.store_wait(0) says the previous reduction has read it.
"""

from triton._C.libtriton import gluon_ir, ir
from triton.experimental import gluon
from triton.experimental.gluon.language import _core as gl_core
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from .common import arrive_after_wgmma, backward_producer, key_block_of_program, loop_position, masked_probabilities, \
    query_block, store_key_rows

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
def _report_reduction(reduced, freed, block):
    """Tell this consumer's releaser (_releaser) that block `block`'s dQ reduction has completed: cp.async.bulk.
    wait_group 0 waits for its global writes (tma.store_wait waits with .read, for its reads of shared memory only),
    the proxy fence orders them before the generic-proxy arrival, which a warpgroup barrier puts after every
    thread's wait (mbarrier.arrive). reduced / freed: [2, 1] barriers used by blocks in turn; the releaser must have
    taken block - 2's report first (freed), or a barrier would complete two phases before it looks."""
    mbarrier.wait(freed.index(block % 2), ((block // 2) - 1) & 1, pred=block >= 2)
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)
    mbarrier.arrive(reduced.index(block % 2))


@gluon.jit
def _releaser(reduced, freed, counters, half, first_visit, n_iterations, blocks_per_head, m_block_lo,
              n_query_blocks):
    """One warp per consumer with ordered dQ: as the consumer reports each block's reduction completed
    (_report_reduction), advance that tile's counter (a release at GPU scope: its fence waits for the reduction's
    writes to be visible everywhere, which takes the issuing warp over a microsecond under load; here it costs the
    consumers nothing) and hand the report barrier back (freed). counters: this program's (batch, kv head); half:
    the consumer's feature half."""
    for block in range(n_iterations):
        mbarrier.wait(reduced.index(block % 2), (block // 2) & 1)
        visit = loop_position(block, first_visit, n_iterations)
        counter = _counter(counters, visit, blocks_per_head, m_block_lo + visit % blocks_per_head, n_query_blocks, half)
        gl.atomic_add(counter, 1, sem="release", scope="gpu")
        mbarrier.arrive(freed.index(block % 2))


@gluon.jit
def _wait_turn(counter, rank, seen):
    """Spin until `rank` reductions into this dQ tile have completed (its counter reads rank; `seen`: a value read
    earlier, which usually already does), then order the async-proxy reduction that follows after that read."""
    while seen != rank:
        seen = gl.load(counter, volatile=True)
    gl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _dq_product(ds_own, ds_lo, ds_hi, k_lo, k_hi, ds_ready, buffer, use, zero_dq, OVER_ALL_KEYS: gl.constexpr):
    """The unscaled dQ product [ROWS, FEATURES] (issued async) of the block whose dS tiles are in buffer `buffer` of
    the [2, ROWS, OWN] dS tiles, their `use`-th use: with the split by features (OVER_ALL_KEYS), once both consumers'
    dS are there, dS_0 K_0 + dS_1 K_1 (ds_lo, ds_hi) restricted to this consumer's features (k_lo, k_hi); with the
    split by keys, this consumer's dS (ds_own) times its K rows (k_lo)."""
    if OVER_ALL_KEYS:
        mbarrier.wait(ds_ready.index(buffer), use & 1)
        dq = warpgroup_mma(ds_lo.index(buffer), k_lo, zero_dq, use_acc=False, is_async=True)
        dq = warpgroup_mma(ds_hi.index(buffer), k_hi, dq, is_async=True)
    else:
        dq = warpgroup_mma(ds_own.index(buffer), k_lo, zero_dq, use_acc=False, is_async=True)
    return dq


@gluon.jit
def _finish_dq(block, ds_own, ds_lo, ds_hi, k_lo, k_hi, ds_ready, ds_free, zero_dq, dq_desc, dq_tile, batch, q_start,
               head_k, group_size, m_block_lo, blocks_per_head, n_iterations, first_visit, seqlen_q, seqlen_k, causal,
               softmax_scale, feature0, order, rows_masked, OVER_ALL_KEYS: gl.constexpr):
    """Loop iteration `block`'s dQ: its product (_dq_product; waiting for it also completes every wgmma this
    consumer issued before it, as wgmma groups complete in order), then, with the split by features, its dS buffer
    released for block + 2 (ds_free), and the scaled product added to the accumulator (_add_dq). With ordered dQ
    (order: (counters of this program's (batch, kv head), key block, key blocks, query blocks, this consumer's
    reduced and freed barriers); empty otherwise) the previous block's reduction is reported completed while the
    products run (by then it has long completed), then this one waits for its turn (_reduction_rank) on its tile's
    counter. batch, q_start: the accumulator's batch coordinate and the sequence's first row in it (a varlen
    call's: 0 and its first row; a dense call's: its batch and 0). rows_masked (0, ) for a varlen call: a block that
    runs past the sequence's end adds zeros to the rows past it, which are the next sequence's in the accumulator
    (its dS rows there are 0, but its K rows need not be finite: another sequence's keys, 0 * inf or NaN)."""
    ROWS: gl.constexpr = zero_dq.shape[0]
    FEATURES: gl.constexpr = zero_dq.shape[1]
    KEYS: gl.constexpr = 2 * k_lo.shape[0]
    dq = _dq_product(ds_own, ds_lo, ds_hi, k_lo, k_hi, ds_ready, block % 2, block // 2, zero_dq, OVER_ALL_KEYS)
    visit = loop_position(block, first_visit, n_iterations)
    head, m_start = query_block(visit, blocks_per_head, m_block_lo, head_k, group_size, ROWS)
    turn = ()
    if len(order) > 0:
        m_block = m_start // ROWS
        counter = _counter(order[0], visit, blocks_per_head, m_block, order[3], feature0 // FEATURES)
        # read while the products complete: its latency is off the path when the turn has come
        turn = (counter, _reduction_rank(order[1], order[2], visit, m_block, seqlen_q, seqlen_k, causal, ROWS, KEYS),
                gl.load(counter, volatile=True))
        if block > 0:
            _report_reduction(order[4], order[5], block - 1)
    dq = warpgroup_mma_wait(0, deps=(dq, ))
    if OVER_ALL_KEYS:
        arrive_after_wgmma(ds_free.index(block % 2))
    if len(rows_masked) > 0:
        if m_start + ROWS > seqlen_q:
            # [ROWS] the block's rows in the sequence
            rows = m_start + gl.arange(0, ROWS, gl.SliceLayout(1, dq.type.layout))
            dq = gl.where(gl.expand_dims(rows < seqlen_q, 1), dq, 0.0)
    _add_dq(dq * softmax_scale, dq_desc, dq_tile, batch, q_start + m_start, head, feature0, turn)


@gluon.jit
def _add_dq(dq, dq_desc, dq_tile, batch, m_start, head, feature0, turn):
    """Add the (scaled) dQ product dq [ROWS, FEATURES] of query rows [m_start, + ROWS) of `head` into the fp32
    accumulator's features [feature0, + FEATURES): through dq_tile ([1, ROWS, 1, FEATURES], shared) by one TMA
    reduction, once the previous one has read dq_tile, and with ordered dQ (turn: (the tile's counter, this
    reduction's rank, a value of the counter read earlier); empty otherwise) once the reductions before it in the
    fixed order have completed. Rows past a dense call's seqlen_q are clipped by the reduction."""
    ROWS: gl.constexpr = dq.shape[0]
    FEATURES: gl.constexpr = dq.shape[1]
    tma.store_wait(0)
    dq_tile.reshape([ROWS, FEATURES]).store(dq)
    fence_async_shared()
    if len(turn) > 0:
        _wait_turn(turn[0], turn[1], turn[2])
    _async_reduce_add(dq_desc, [batch, m_start, head, feature0], dq_tile)


@gluon.jit
def _consumer(k_own, v_own, k_lo, k_hi, q_smem, do_smem, lse_smem, delta_smem, p_own, ds_own, ds_lo, ds_hi, dq_tile,
              kv_ready, q_ready, q_empty, ds_ready, ds_free, dq_desc, DK, DV, stride_dk_b,
              stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h, batch, head_k, n_start, head_dim,
              q_start, k_start, rows_masked, key0, feature0,
              group_size, m_block_lo, blocks_per_head, n_iterations, seqlen_q, seqlen_k, softmax_scale, qk_scale_log2,
              causal, first_visit, window, order):
    """One warpgroup: keys [n_start + key0, + OWN) of the block (k_own, v_own: their K and V rows [OWN, HEAD_DIM];
    p_own, ds_own: its [ROWS, OWN] P and dS tiles in shared memory); dK / dV over every query block, and the dQ
    features [feature0, + FEATURES) of each block: with the split by features dS (both halves: ds_lo, ds_hi) times
    the K rows of each half restricted to those features (k_lo, k_hi [OWN, FEATURES]); with the split by keys this
    consumer's dS times its K rows (k_lo [OWN, HEAD_DIM]; k_hi and ds_hi unused). Each block's dQ product goes
    through dq_tile ([1, ROWS, 1, FEATURES] fp32, shared) into the accumulator by a TMA reduction (dq_desc); with
    ordered dQ (`order`, see _finish_dq) in a fixed order, each reduction reported completed to this consumer's
    releaser partition while the next block's products run (the next contributor reduces into that query block at
    least a block later). Varlen (rows_masked (0, ); () for a dense call): batch is the descriptors' coordinate 0,
    q_start / k_start the sequence's first rows, seqlen_q / seqlen_k its lengths; the Q / dO stages' rows past
    seqlen_q (zeros: the producer's descriptors end at the sequence) get lse +inf and delta 0, as the lse / delta
    matrices hold the next sequence's rows there, so P and dS are 0 in those rows."""
    STAGES: gl.constexpr = q_smem.shape[0]
    ROWS: gl.constexpr = q_smem.shape[2]
    HEAD_DIM: gl.constexpr = q_smem.shape[4]
    OWN: gl.constexpr = k_own.shape[0]
    FEATURES: gl.constexpr = k_lo.shape[1]
    # dQ over every key of the block (features split between the consumers), or over this consumer's keys
    OVER_ALL_KEYS: gl.constexpr = FEATURES < HEAD_DIM
    # blocks between a block's dS and its dQ product
    LAG: gl.constexpr = 1 if OVER_ALL_KEYS else 0
    dtype: gl.constexpr = k_own.dtype
    # [ROWS, OWN] scores; [OWN, HEAD_DIM] dK / dV; [ROWS, FEATURES] dQ
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, OWN, 16])
    dkv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, FEATURES, 16])
    row_of_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    zero_s = gl.zeros([ROWS, OWN], gl.float32, s_layout)
    zero_dq = gl.zeros([ROWS, FEATURES], gl.float32, dq_layout)
    dk = gl.zeros([OWN, HEAD_DIM], gl.float32, dkv_layout)
    dv = gl.zeros([OWN, HEAD_DIM], gl.float32, dkv_layout)
    first_key = n_start + key0
    if len(order) > 0:
        gl.static_assert(OVER_ALL_KEYS, "ordered dQ takes the split by features (head dim 128)")
    mbarrier.wait(kv_ready, 0)
    for i in range(n_iterations):
        stage = i % STAGES
        head, m_start = query_block(loop_position(i, first_visit, n_iterations), blocks_per_head, m_block_lo,
                                    head_k, group_size, ROWS)
        mbarrier.wait(q_ready.index(stage), (i // STAGES) & 1)
        q_tile = q_smem.index(stage).reshape([ROWS, HEAD_DIM])
        do_tile = do_smem.index(stage).reshape([ROWS, HEAD_DIM])
        # [ROWS] log2(e) * lse and delta of the block's rows; rows past seqlen_q read 0 for both, as their Q and dO
        # rows do, so that every product they enter (dV, dK, and dQ rows the reduction clips) adds zeros
        lse_log2 = lse_smem.index(stage).reshape([ROWS]).load(row_of_s) * 1.4426950408889634
        delta = delta_smem.index(stage).reshape([ROWS]).load(row_of_s)
        if len(rows_masked) > 0:
            # [ROWS] the rows of the sequence
            in_sequence = m_start + gl.arange(0, ROWS, row_of_s) < seqlen_q
            lse_log2 = gl.where(in_sequence, lse_log2, float("inf"))
            delta = gl.where(in_sequence, delta, 0.0)
        s = warpgroup_mma(q_tile, k_own.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_tile, v_own.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s, ))
        # [ROWS, OWN] P
        p = masked_probabilities(s, lse_log2, qk_scale_log2, first_key, m_start, seqlen_q, seqlen_k, causal, window)
        # this consumer's previous dV product (the reader of p_own) completed last iteration
        p_own.store(p.to(dtype))
        dp = warpgroup_mma_wait(0, deps=(dp, ))
        # [ROWS, OWN] dS
        ds = (p * (dp - gl.expand_dims(delta, 1))).to(dtype)
        # dS buffer i % 2; its previous use (block i - 2) is free once the dQ products of that block completed
        buffer = i % 2
        if OVER_ALL_KEYS:
            mbarrier.wait(ds_free.index(buffer), ((i // 2) - 1) & 1, pred=i >= 2)
        ds_own.index(buffer).store(ds)
        fence_async_shared()
        gl.thread_barrier()
        if OVER_ALL_KEYS:
            mbarrier.arrive(ds_ready.index(buffer))
        dv = warpgroup_mma(p_own.permute((1, 0)), do_tile, dv, is_async=True)
        dk = warpgroup_mma(ds_own.index(buffer).permute((1, 0)), q_tile, dk, is_async=True)
        if i >= LAG:
            # block i - LAG's dQ: with the split by features one block late, as the other consumer wrote its dS a
            # block ago (not waiting for it lets the two consumers drift out of phase); its wait completes this
            # block's dV and dK products too
            _finish_dq(i - LAG, ds_own, ds_lo, ds_hi, k_lo, k_hi, ds_ready, ds_free, zero_dq, dq_desc, dq_tile, batch,
                       q_start, head_k, group_size, m_block_lo, blocks_per_head, n_iterations, first_visit, seqlen_q,
                       seqlen_k, causal, softmax_scale, feature0, order, rows_masked, OVER_ALL_KEYS)
        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
        arrive_after_wgmma(q_empty.index(stage))
    if OVER_ALL_KEYS:
        # the last block's dQ (its ds_free arrival has no waiter)
        if n_iterations > 0:
            _finish_dq(n_iterations - 1, ds_own, ds_lo, ds_hi, k_lo, k_hi, ds_ready, ds_free, zero_dq, dq_desc,
                       dq_tile, batch, q_start, head_k, group_size, m_block_lo, blocks_per_head, n_iterations,
                       first_visit, seqlen_q, seqlen_k, causal, softmax_scale, feature0, order, rows_masked,
                       OVER_ALL_KEYS)
            if len(order) > 0:
                _report_reduction(order[4], order[5], n_iterations - 1)
    # [OWN, HEAD_DIM] this consumer's key rows
    store_key_rows(dk, dv, DK, DV, stride_dk_b, stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h,
                   batch, head_k, k_start + n_start + key0, 0, k_start + seqlen_k, head_dim, softmax_scale)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "head_dim", "heads_per_group", "window_left", "window_right",
                              "q_rows", "k_rows", "lse_row_stride", "delta_row_stride"])
def attn_bwd_hopper_kernel(k_desc, v_desc, q_desc, do_desc, dq_desc, lse_desc, delta_desc, DK, DV, dq_counters,
                           stride_dk_b, stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h,
                           num_heads_k, group_size, seqlen_q, seqlen_k, head_dim, heads_per_group, softmax_scale,
                           qk_scale_log2, window_left, window_right, varlen, q_rows, k_rows, lse_row_stride,
                           delta_row_stride,
                           CAUSAL: gl.constexpr, LOCAL: gl.constexpr, ORDERED: gl.constexpr, STAGES: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """One program per (128-key block, batch * kv head), key blocks in order (under a causal mask the blocks seen
    by the most query rows first), in launch-order groups of heads_per_group (batch, kv head) pairs. num_warps (4)
    is the first consumer's; the second consumer (4 warps, CONSUMER_REGS registers) and the producer (1 warp) are
    worker partitions, and with ORDERED the two releasers (1 warp each). ORDERED (head dim 128): every query
    block's dQ reductions come in one fixed order (_reduction_rank; dq_counters: zeroed int32, two per (batch, head,
    64-row query block), one per feature half), so dQ is the same bits every call; a key block's reductions wait for
    the next key block's, so those launch first (LAST_FIRST), and without the causal mask the first key block's for
    the last's (the loops are a rotation), so the launcher gives it launch-order groups of one head and at most one
    key block per SM (all of a head's key blocks resident together). LOCAL: a local window (window_left,
    window_right, normalized as kernels/common's): each key block loops over the query blocks whose windows meet it
    and masks both edges (common.masked_probabilities); not with ORDERED. Varlen (varlen: (CuSeqlensQ, CuSeqlensK,
    Q, K, V, DOut, LSE, DELTA), None pointers for a dense call; not with ORDERED): q, k, v, dout, dq's accumulator,
    dk and dv are (1, T, H, D) to the descriptors (q_rows / k_rows: T of q / k), seqlen_q / seqlen_k the longest
    lengths; each program's sequence (common.key_block_of_program's bounds) gets its own Q, dO, K and V descriptors,
    made by the producer (the partition whose TMA loads use them) over its rows only, so rows past it read zeros as a
    dense call's rows past its end do; dQ is reduced at the sequence's rows of the accumulator (rows past it add
    zeros), dK / dV stored at its key rows, and lse / delta copied by the producer from its rows of the (H, T)
    matrices LSE and DELTA (rows lse_row_stride / delta_row_stride apart; lse_desc and delta_desc then only type
    the stage buffers)."""
    KEYS: gl.constexpr = k_desc.block_type.shape[1]
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[3]
    dtype: gl.constexpr = k_desc.dtype
    # the local window, or () without one (a tuple's length reaches the partitions where a constexpr does not)
    if LOCAL:
        gl.static_assert(not ORDERED, "ordered dQ takes no local window")
        window = (window_left, window_right)
    else:
        window = ()
    if varlen[0] is not None:
        gl.static_assert(not ORDERED, "ordered dQ takes no varlen call")
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
    # [1, KEYS, 1, HEAD_DIM] K, V; [STAGES, 1, ROWS, 1, HEAD_DIM] Q, dO; [KEYS, ROWS] dS^T
    k_smem = gl.allocate_shared_memory(dtype, [1, KEYS, 1, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, KEYS, 1, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, ROWS, 1, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, ROWS, 1, HEAD_DIM], do_desc.layout)
    OWN: gl.constexpr = KEYS // 2
    # [2, ROWS, OWN] each consumer's P tile; [2, 2, ROWS, OWN] its dS tiles of two blocks in turn (a block's dQ
    # product runs during the next block)
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, OWN], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [2, ROWS, OWN], pds_layout)
    ds_smem = (gl.allocate_shared_memory(dtype, [2, ROWS, OWN], pds_layout),
               gl.allocate_shared_memory(dtype, [2, ROWS, OWN], pds_layout))
    # [STAGES, 1, ROWS] log2(e) * lse and delta of the Q / dO stages' rows
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    # [2, 1, ROWS, 1, FEATURES] each consumer's fp32 dQ product on its way to the accumulator
    dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
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
    # dQ: head dim 128 split by features (64 each), head dim 64 split by keys (dq_desc's tile: [1, ROWS, 1, FEATURES])
    gl.static_assert((HEAD_DIM == 64) | (HEAD_DIM == 128), "the Gluon backward takes head dim 64 or 128")
    FEATURES: gl.constexpr = dq_desc.block_type.shape[3]
    SPLIT_FEATURES: gl.constexpr = FEATURES < HEAD_DIM
    # [KEYS, HEAD_DIM] K and V of the block
    k_flat = k_smem.reshape([KEYS, HEAD_DIM])
    v_flat = v_smem.reshape([KEYS, HEAD_DIM])
    pointers = (dq_desc, DK, DV, stride_dk_b, stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h,
                desc_batch, head_k, n_start, head_dim, q_start, k_start, rows_masked)
    if ORDERED:
        n_block = n_start // KEYS
        n_query_blocks = gl.cdiv(seqlen_q, ROWS)
        # the loop starts at position 2 n_block (not under the causal mask); the counters of this (batch, kv
        # head)'s query heads; each consumer's reduced / freed barriers (_report_reduction, _releaser)
        first_visit = _first_visit(n_block, n_iterations, 1 - causal, KEYS // ROWS)
        counters = dq_counters + (batch * num_heads_k + head_k) * (group_size * n_query_blocks * 2)
        reduced = (gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()),
                   gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()))
        freed = (gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()),
                 gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()))
        for w in gl.static_range(2):
            for buffer in gl.static_range(2):
                mbarrier.init(reduced[w].index(buffer), count=1)
                mbarrier.init(freed[w].index(buffer), count=1)
        common = (counters, n_block, gl.cdiv(seqlen_k, KEYS), n_query_blocks)
        order_of = (common + (reduced[0], freed[0]), common + (reduced[1], freed[1]))
    else:
        first_visit = gl.to_tensor(0)
        order_of = ((), ())
    loop = (group_size, m_block_lo, blocks_per_head, n_iterations, seqlen_q, seqlen_k, softmax_scale, qk_scale_log2,
            causal, first_visit, window)
    barriers = (kv_ready, q_ready, q_empty, ds_ready, ds_free)
    k_halves = (k_flat.slice(0, OWN, dim=0), k_flat.slice(OWN, OWN, dim=0))
    v_halves = (v_flat.slice(0, OWN, dim=0), v_flat.slice(OWN, OWN, dim=0))
    if SPLIT_FEATURES:
        # consumer w: features [64w, 64w + 64) of K's two key halves
        first_dq = (k_halves[0].slice(0, FEATURES, dim=1), k_halves[1].slice(0, FEATURES, dim=1))
        second_dq = (k_halves[0].slice(FEATURES, FEATURES, dim=1), k_halves[1].slice(FEATURES, FEATURES, dim=1))
        second_feature = FEATURES
    else:
        first_dq = (k_halves[0], k_halves[0])
        second_dq = (k_halves[1], k_halves[1])
        second_feature = 0
    staged = (q_smem, do_smem, lse_smem, delta_smem)
    first = (k_halves[0], v_halves[0]) + first_dq + staged + (p_smem.index(0), ds_smem[0]) + ds_smem + (
        dq_smem.index(0), )
    second = (k_halves[1], v_halves[1]) + second_dq + staged + (p_smem.index(1), ds_smem[1]) + ds_smem + (
        dq_smem.index(1), )
    first = first + barriers + pointers + (gl.to_tensor(0), gl.to_tensor(0)) + loop + (order_of[0], )
    second = second + barriers + pointers + (gl.to_tensor(OWN), gl.to_tensor(second_feature)) + loop + (order_of[1], )
    producer = (k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, (q_smem, ), (do_smem, ),
                lse_smem, delta_smem, kv_ready, q_ready, q_empty, desc_batch, head_k, n_start, num_heads_k * group_size,
                group_size, m_block_lo, blocks_per_head, n_iterations, first_visit, q_start, load_kv, sequence)
    if ORDERED:
        placement = (first_visit, n_iterations, blocks_per_head, m_block_lo, n_query_blocks)
        gl.warp_specialize([(_consumer, first), (_consumer, second), (backward_producer, producer),
                            (_releaser, (reduced[0], freed[0], counters, gl.to_tensor(0)) + placement),
                            (_releaser, (reduced[1], freed[1], counters, gl.to_tensor(1)) + placement)],
                           [4, 1, 1, 1], [CONSUMER_REGS, 24, 24, 24])
    else:
        gl.warp_specialize([(_consumer, first), (_consumer, second), (backward_producer, producer)], [4, 1],
                           [CONSUMER_REGS, 24])

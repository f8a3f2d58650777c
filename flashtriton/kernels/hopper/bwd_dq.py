"""Backward dQ for Hopper (sm_90) at head dim 192 in Gluon, warp-specialized: the kernel that follows bwd_d256.py's
dK / dV kernel there (instead of the Triton dQ kernel, whose tiles are 256 wide at 192). One program per query tile
of two consumer warpgroups of 64 rows (a forward tile: schedule.tile_work gives its key blocks), a one-warp TMA
producer loading the tile's Q, dO, lse and delta once and streaming K / V blocks; no accumulator in global memory,
no reductions: each program owns its rows, so the result is deterministic.

Per key block j (KEYS keys, visited from the last down), consumer w, rows [64 w, 64 w + 64) of the tile:
  S = Q_w K_j^T, dP = dO_w V_j^T     [64 rows, KEYS] one wgmma per column chunk of the head dim (128 + 64; V's
                                     own, 128, for dP), chained
  P = exp2(S log2(e) scale - lse log2(e)) masked (common.masked_probabilities), dS = P (dP - delta)
  dQ_w += dS K_j                     [64 rows, WIDTH] per chunk, dS from registers as the A operand
K_j's stage goes back to the producer once the next block's S wgmma completed (wgmmas complete in order, so the dQ
product that read K_j did too): dQ_j runs under the issue of S_{j+1} and dP_{j+1}. dQ is stored, times the softmax
scale, in rows below seqlen_q and columns below the head dim.

Shared memory (bf16, head dim 192, KEYS 64, 2 stages): K, V [64, 192] per stage 48 KB x 2; Q, dO [64, 192] per
consumer 96 KB; lse / delta 1 KB; the layout conversion of the dQ store.

Scope, masking and rows past seqlen_q: as bwd_d256.py (ops/hopper.covers decides; ops/hopper.dq_kernel_runs).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma_wait

from .common import accumulate_register_products, allocate_chunks, arrive_after_wgmma, chained_products, \
    chunk_descriptors, chunks_bytes, copy_pieces, entries_of, grouped_tile_of, masked_probabilities, matrices_of, \
    store_rows, wait_products, zero_accumulators
from .schedule import tile_work

CONSUMER_ROWS = gl.constexpr(64)  # query rows per consumer warpgroup: the M of every wgmma


@gluon.jit
def _producer(q_descs, do_descs, k_descs, v_descs, lse_desc, delta_desc, q_pieces, do_pieces, k_pieces, v_pieces,
              lse_smem, delta_smem, q_ready, kv_ready, kv_empty, batch, head, head_k, row, m_start, end_block,
              count):
    """One warp: both consumers' Q, dO rows and their log2(e) * lse and delta once (q_ready), then K and V of key
    blocks end_block - 1, end_block - 2, ... (count of them) into stage j % STAGES (kv_ready / kv_empty). q_pieces /
    do_pieces: [2, 1, ROWS, 1, WIDTH] per chunk (one entry per consumer); k_pieces / v_pieces [STAGES, 1, KEYS, 1,
    WIDTH] per chunk; row: the tile's (batch, head) row of the (B * H, Sq) statistics."""
    ROWS: gl.constexpr = q_pieces[0].shape[2]
    STAGES: gl.constexpr = k_pieces[0].shape[0]
    KEYS: gl.constexpr = k_pieces[0].shape[2]
    mbarrier.expect(q_ready, 2 * (chunks_bytes(q_pieces) + chunks_bytes(do_pieces)) + 2 * 2 * ROWS * 4)
    for consumer in gl.static_range(2):
        first = m_start + consumer * ROWS
        copy_pieces(q_descs, entries_of(q_pieces, consumer), batch, first, head, q_ready)
        copy_pieces(do_descs, entries_of(do_pieces, consumer), batch, first, head, q_ready)
        tma.async_copy_global_to_shared(lse_desc, [row, first], q_ready, lse_smem.index(consumer))
        tma.async_copy_global_to_shared(delta_desc, [row, first], q_ready, delta_smem.index(consumer))
    for j in range(count):
        stage = j % STAGES
        mbarrier.wait(kv_empty.index(stage), ((j // STAGES) - 1) & 1, pred=j >= STAGES)
        n_start = (end_block - 1 - j) * KEYS
        mbarrier.expect(kv_ready.index(stage), chunks_bytes(k_pieces) + chunks_bytes(v_pieces))
        copy_pieces(k_descs, entries_of(k_pieces, stage), batch, n_start, head_k, kv_ready.index(stage))
        copy_pieces(v_descs, entries_of(v_pieces, stage), batch, n_start, head_k, kv_ready.index(stage))


@gluon.jit
def _consumer(q_own, do_own, lse_own, delta_own, k_pieces, v_pieces, q_ready, kv_ready, kv_empty, DQ, stride_dq_b,
              stride_dq_m, stride_dq_h, batch, head, m_start, end_block, count, seqlen_q, seqlen_k, head_dim, aligned,
              softmax_scale, qk_scale_log2, causal, window):
    """One warpgroup: dQ of query rows [m_start, + ROWS) (q_own / do_own: their [1, ROWS, 1, WIDTH] tiles per chunk;
    lse_own / delta_own: [1, ROWS]) over key blocks end_block - 1 down to end_block - count."""
    ROWS: gl.constexpr = q_own[0].shape[1]
    STAGES: gl.constexpr = k_pieces[0].shape[0]
    KEYS: gl.constexpr = k_pieces[0].shape[2]
    CHUNKS: gl.constexpr = len(k_pieces)
    V_CHUNKS: gl.constexpr = len(v_pieces)
    dtype: gl.constexpr = q_own[0].dtype
    # [ROWS, KEYS] scores
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, KEYS, 16])
    row_of_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    zero_s = gl.zeros([ROWS, KEYS], gl.float32, s_layout)
    # [ROWS, WIDTH] per chunk of the head dim
    dq = zero_accumulators(ROWS, k_pieces)
    mbarrier.wait(q_ready, 0)
    # [ROWS, WIDTH] per chunk: Q and dO of the consumer's rows
    q_parts = matrices_of(q_own)
    do_parts = matrices_of(do_own)
    # [ROWS] log2(e) * lse and delta (0 for rows past seqlen_q, like their Q and dO rows)
    lse_log2 = lse_own.reshape([ROWS]).load(row_of_s) * 1.4426950408889634
    delta = delta_own.reshape([ROWS]).load(row_of_s)
    for j in range(count):
        stage = j % STAGES
        n_start = (end_block - 1 - j) * KEYS
        mbarrier.wait(kv_ready.index(stage), (j // STAGES) & 1)
        # [KEYS, WIDTH] per chunk: K_j and V_j
        k_parts = matrices_of(entries_of(k_pieces, stage))
        v_parts = matrices_of(entries_of(v_pieces, stage))
        s = chained_products(q_parts, k_parts, zero_s)
        dp = chained_products(do_parts, v_parts, zero_s)
        # in flight: the previous block's dQ products, then S, then dP: S waited for, the dQ products before it too
        s = warpgroup_mma_wait(V_CHUNKS, deps=(s, ))
        arrive_after_wgmma(kv_empty.index((j + STAGES - 1) % STAGES), pred=j >= 1)
        # [ROWS, KEYS] P
        p, _ = masked_probabilities(s, lse_log2, qk_scale_log2, n_start, m_start, seqlen_q, seqlen_k, causal,
                                    window, 1, (), ())
        dp = warpgroup_mma_wait(0, deps=(dp, ))
        # [ROWS, KEYS] dS
        ds = (p * (dp - gl.expand_dims(delta, 1))).to(dtype)
        dq = accumulate_register_products(ds, k_parts, dq)
    dq = wait_products(dq)
    column = 0
    for chunk in gl.static_range(CHUNKS):
        store_rows(dq[chunk] * softmax_scale, DQ, stride_dq_b, stride_dq_m, stride_dq_h, batch, head, m_start,
                   column, seqlen_q, head_dim, aligned)
        column = column + k_pieces[chunk].shape[4]


@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "head_dim", "heads_per_group", "window_left", "window_right"])
def attn_bwd_hopper_dq_kernel(q_desc, do_desc, k_desc, v_desc, q_desc2, do_desc2, k_desc2, v_desc2, lse_desc,
                              delta_desc, DQ, stride_dq_b, stride_dq_m, stride_dq_h, num_heads, group_size, seqlen_q,
                              seqlen_k, head_dim, heads_per_group, softmax_scale, qk_scale_log2, window_left,
                              window_right, CAUSAL: gl.constexpr, LOCAL: gl.constexpr, ALIGNED_ROWS: gl.constexpr,
                              STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """One program per (query tile of 2 x 64 rows, batch * head), tiles numbered longest first in launch-order
    groups of heads_per_group (batch, head) pairs (kernels/common.grouped_tile_of). Every descriptor pair moves the
    first and the second column chunk of its head dim (configs.HOPPER_BWD_CHUNKS; the second None for one chunk), Q /
    K by q's, dO / V by v's (V's own head dim: MLA-style (192, 128)): Q / dO [1, 64, 1, WIDTH], K / V [1, KEYS, 1,
    WIDTH]; lse_desc / delta_desc the (B * H, Sq) statistics in [1, 64] blocks. num_warps (4) is the first
    consumer's; the second consumer (4 warps, CONSUMER_REGS registers) and the producer (1 warp) are worker
    partitions. ALIGNED_ROWS: DQ takes 16-byte stores (common.store_rows' `aligned`)."""
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    KEYS: gl.constexpr = k_desc.block_type.shape[1]
    gl.static_assert(ROWS == CONSUMER_ROWS, "64 query rows per consumer")
    # the local window, or () without one (a tuple's length reaches the partitions)
    if LOCAL:
        window = (window_left, window_right)
    else:
        window = ()
    # constexprs arrive in partitions as plain ints (Triton 3.6): the flag travels as a tensor
    causal = gl.to_tensor(CAUSAL).to(gl.int32)
    num_tiles = gl.cdiv(seqlen_q, 2 * ROWS)
    tile, batch_head = grouped_tile_of(gl.program_id(0), num_tiles, gl.num_programs(0) // num_tiles, heads_per_group)
    batch, head, m_start, end_block, count, _ = tile_work(tile, batch_head, num_tiles, num_heads, seqlen_q, seqlen_k,
                                                          causal, window, (), 2 * ROWS, KEYS)
    head_k = head // group_size
    # Q, dO: [2, 1, ROWS, 1, WIDTH] per chunk (an entry per consumer); K, V: [STAGES, 1, KEYS, 1, WIDTH] per chunk
    q_descs, do_descs = chunk_descriptors(q_desc, q_desc2), chunk_descriptors(do_desc, do_desc2)
    k_descs, v_descs = chunk_descriptors(k_desc, k_desc2), chunk_descriptors(v_desc, v_desc2)
    q_pieces = allocate_chunks(q_descs, 2)
    do_pieces = allocate_chunks(do_descs, 2)
    k_pieces = allocate_chunks(k_descs, STAGES)
    v_pieces = allocate_chunks(v_descs, STAGES)
    # [2, 1, ROWS] lse and delta, an entry per consumer
    lse_smem = gl.allocate_shared_memory(gl.float32, [2] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [2] + delta_desc.block_type.shape, delta_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for stage in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(stage), count=1)
        mbarrier.init(kv_empty.index(stage), count=2)
    limits = (seqlen_q, seqlen_k, head_dim, (0, ) if ALIGNED_ROWS else (), softmax_scale, qk_scale_log2, causal,
              window)
    shared = (k_pieces, v_pieces, q_ready, kv_ready, kv_empty, DQ, stride_dq_b, stride_dq_m, stride_dq_h, batch, head)
    gl.warp_specialize([
        (_consumer, (entries_of(q_pieces, 0), entries_of(do_pieces, 0), lse_smem.index(0), delta_smem.index(0))
         + shared + (m_start, end_block, count) + limits),
        (_consumer, (entries_of(q_pieces, 1), entries_of(do_pieces, 1), lse_smem.index(1), delta_smem.index(1))
         + shared + (m_start + ROWS, end_block, count) + limits),
        (_producer, (q_descs, do_descs, k_descs, v_descs, lse_desc, delta_desc, q_pieces, do_pieces, k_pieces,
                     v_pieces, lse_smem, delta_smem, q_ready, kv_ready, kv_empty, batch, head, head_k,
                     batch * num_heads + head, m_start, end_block, count)),
    ], [4, 1], [CONSUMER_REGS, 24])

"""Backward dK/dV (and dQ) for Hopper (sm_90) in Gluon, warp-specialized, FA3's layout of the work: one program
per 128-key block, a one-warp TMA producer streaming Q / dO blocks, two consumer warpgroups that each own 64
keys of the block (their dK, dV accumulators stay in registers for the whole loop) and share the query blocks.
Query rows per block: 32 (configs.HOPPER_BWD; 64 spill).

Per query block i (configs.HopperBwdConfig.query_rows rows), consumer w (keys [64w, 64w + 64) of the block), with
S^T, P^T, dS^T of shape [64 keys, rows]:
  S^T = K_w Q_i^T, dP^T = V_w dO_i^T          (both issued async, then waited)
  P^T = exp2(S^T * scale * log2 e - lse_i * log2 e), dS^T = P^T (dP^T - delta_i)
  dV_w += P^T dO_i, dK_w += dS^T Q_i
  dS^T goes to shared memory, both consumers' key rows stacked: [128 keys, rows]. dQ^T (wgmma needs 64 rows in M:
  the head-dim features, so the query block may be 32 rows), added into the fp32 dQ accumulator with (vectorized)
  atomics, is split one of two ways:
  - head dim 128, by features: once both halves of dS^T are there (ds_ready), consumer w computes
    dQ_i^T[64w:64w+64, :] = K[:, 64w:64w+64]^T dS^T over every key of the block;
  - head dim 64, by keys: consumer w computes all 64 features over its own keys, K_w^T dS_w^T, with no barrier
    between the consumers but twice the atomics.
The launcher scales the accumulator by the softmax scale into dq (as kernels/bwd.py's DQ_ATOMIC path), dK is
scaled here. GQA: the loop runs over the group's query heads too (dK/dV summed in registers).

Scope (ops/hopper_bwd.covers): what ops/hopper_fwd covers (dense bf16/fp16, no window or the causal one, bottom-right
aligned, no softcap, ALiBi or dropout), head dim 64 / 128. Keys past seqlen_k are masked out of dS (their dK/dV rows
are never stored; their K rows read as zeros, but P would not be 0); query rows past seqlen_q get lse +inf, hence P = 0.

Synchronisation: kv_ready (K and V landed), q_ready[s] (Q_i and dO_i of stage s landed), q_empty[s] (both consumers
are done with stage s, count 2), with the feature split ds_ready (both halves of dS^T written, count 2), ds_free
(both consumers' dQ
products of the iteration completed, count 2: the next iteration may overwrite dS^T). One dS^T buffer: Triton 3.6
fails to slice a 3-D shared allocation (two buffers) along its second dimension.

Not yet run on a GPU (written and compiled offline for sm_90, 2026-11-30): off by default (configs.HOPPER_BWD_ALLOWED).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from .common import grouped_tile_and_batch_head

KEYS_PER_CONSUMER = gl.constexpr(64)  # one wgmma M tile; a program covers 2 * KEYS_PER_CONSUMER keys
_tile_and_batch_head = gluon.jit(grouped_tile_and_batch_head.fn)


@gluon.jit
def _query_block(iteration, blocks_per_head, m_block_lo, head_k, group_size, ROWS: gl.constexpr):
    """(query head, first row) of loop iteration `iteration`: the group's heads in turn, each over its blocks of
    ROWS rows."""
    head = head_k * group_size + iteration // blocks_per_head
    return head, (m_block_lo + iteration % blocks_per_head) * ROWS


@gluon.jit
def _producer(k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_ready, q_ready, q_empty, batch,
              head_k, n_start, group_size, m_block_lo, blocks_per_head, n_iterations):
    """One warp: the key block's K and V once, then Q_i and dO_i of every iteration into stage i % STAGES."""
    STAGES: gl.constexpr = q_smem.shape[0]
    KEYS: gl.constexpr = k_smem.shape[1]
    ROWS: gl.constexpr = q_smem.shape[2]
    HEAD_DIM: gl.constexpr = k_smem.shape[3]
    element_bytes: gl.constexpr = k_desc.dtype.primitive_bitwidth // 8
    mbarrier.expect(kv_ready, 2 * KEYS * HEAD_DIM * element_bytes)
    tma.async_copy_global_to_shared(k_desc, [batch, n_start, head_k, 0], kv_ready, k_smem)
    tma.async_copy_global_to_shared(v_desc, [batch, n_start, head_k, 0], kv_ready, v_smem)
    for i in range(n_iterations):
        stage = i % STAGES
        mbarrier.wait(q_empty.index(stage), ((i // STAGES) - 1) & 1, pred=i >= STAGES)
        head, m_start = _query_block(i, blocks_per_head, m_block_lo, head_k, group_size, ROWS)
        mbarrier.expect(q_ready.index(stage), 2 * ROWS * HEAD_DIM * element_bytes)
        tma.async_copy_global_to_shared(q_desc, [batch, m_start, head, 0], q_ready.index(stage), q_smem.index(stage))
        tma.async_copy_global_to_shared(do_desc, [batch, m_start, head, 0], q_ready.index(stage),
                                        do_smem.index(stage))


@gluon.jit
def _consumer(k_own, v_own, k_features, q_smem, do_smem, ds_smem, ds_own, kv_ready, q_ready, q_empty, ds_ready,
              ds_free, Lse,
              Delta, DQAccum, DK, DV, stride_lse_b, stride_lse_h, stride_dqa_b, stride_dqa_m, stride_dqa_h, stride_dk_b,
              stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h, batch, head_k, n_start, key0,
              feature0, group_size, m_block_lo, blocks_per_head, n_iterations, seqlen_q, seqlen_k, softmax_scale, qk_scale_log2,
              causal):
    """One warpgroup: keys [n_start + key0, + OWN) of the block (k_own, v_own: their K and V rows [OWN, HEAD_DIM];
    ds_own: its key rows of the dS^T buffer, [OWN, ROWS]); dK / dV over every query block, and the dQ features
    [feature0, feature0 + FEATURES) of each block (k_features: those columns of K for every key, [KEYS, FEATURES],
    or for the split by keys this consumer's K rows, [OWN, HEAD_DIM])."""
    STAGES: gl.constexpr = q_smem.shape[0]
    ROWS: gl.constexpr = q_smem.shape[2]
    HEAD_DIM: gl.constexpr = q_smem.shape[4]
    OWN: gl.constexpr = k_own.shape[0]
    FEATURES: gl.constexpr = k_features.shape[1]
    # dQ^T over every key of the block (features split between the consumers), or over this consumer's keys
    OVER_ALL_KEYS: gl.constexpr = k_features.shape[0] == ds_smem.shape[0]
    dtype: gl.constexpr = k_own.dtype
    # [OWN keys, ROWS] transposed scores; [OWN, HEAD_DIM] dK / dV; [FEATURES, ROWS] of dQ^T
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, ROWS, 16])
    dkv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, ROWS, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dkv_layout, k_width=2)
    key_of_st: gl.constexpr = gl.SliceLayout(1, st_layout)
    row_of_st: gl.constexpr = gl.SliceLayout(0, st_layout)
    zero_st = gl.zeros([OWN, ROWS], gl.float32, st_layout)
    zero_dq = gl.zeros([FEATURES, ROWS], gl.float32, dq_layout)
    dk = gl.zeros([OWN, HEAD_DIM], gl.float32, dkv_layout)
    dv = gl.zeros([OWN, HEAD_DIM], gl.float32, dkv_layout)
    # [OWN] this consumer's keys
    offs_n = n_start + key0 + gl.arange(0, OWN, key_of_st)
    key_in = offs_n < seqlen_k
    last_key = n_start + key0 + OWN - 1
    # [FEATURES, ROWS] dQ^T tile coordinates: features, query rows
    dq_features = feature0 + gl.arange(0, FEATURES, gl.SliceLayout(1, dq_layout))
    dq_rows = gl.arange(0, ROWS, gl.SliceLayout(0, dq_layout))
    mbarrier.wait(kv_ready, 0)
    for i in range(n_iterations):
        stage = i % STAGES
        head, m_start = _query_block(i, blocks_per_head, m_block_lo, head_k, group_size, ROWS)
        # [ROWS] query rows of the block; rows past seqlen_q get lse +inf (P = 0) and delta 0
        offs_m = m_start + gl.arange(0, ROWS, row_of_st)
        row_in = offs_m < seqlen_q
        row_base = batch.to(gl.int64) * stride_lse_b + head.to(gl.int64) * stride_lse_h + m_start
        lse_log2 = gl.load((Lse + row_base) + gl.arange(0, ROWS, row_of_st), mask=row_in,
                           other=float("inf")) * 1.4426950408889634
        delta = gl.load((Delta + row_base) + gl.arange(0, ROWS, row_of_st), mask=row_in, other=0.0)
        mbarrier.wait(q_ready.index(stage), (i // STAGES) & 1)
        q_tile = q_smem.index(stage).reshape([ROWS, HEAD_DIM])
        do_tile = do_smem.index(stage).reshape([ROWS, HEAD_DIM])
        st = warpgroup_mma(k_own, q_tile.permute((1, 0)), zero_st, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_own, do_tile.permute((1, 0)), zero_st, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=(st, ))
        # [OWN, ROWS] P^T; masked where a key is past seqlen_k or, causal, after the row's last key
        pt = gl.exp2(st * qk_scale_log2 - gl.expand_dims(lse_log2, 0))
        if (last_key >= seqlen_k) | ((causal != 0) & (last_key > m_start + (seqlen_k - seqlen_q))):
            visible = gl.expand_dims(key_in, 1) & gl.expand_dims(row_in, 0)
            if causal != 0:
                visible = visible & (gl.expand_dims(offs_n, 1) <= gl.expand_dims(offs_m + (seqlen_k - seqlen_q), 0))
            pt = gl.where(visible, pt, 0.0)
        dpt = warpgroup_mma_wait(0, deps=(dpt, ))
        # [OWN, ROWS] dS^T
        dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_tile, dv, is_async=True)
        dk = warpgroup_mma(gl.convert_layout(dst, a_layout), q_tile, dk, is_async=True)
        if OVER_ALL_KEYS:
            # dS^T [KEYS, ROWS]: once both consumers' dQ products of the previous block are done, this consumer's key
            # rows, then both halves' arrival
            mbarrier.wait(ds_free, (i - 1) & 1, pred=i > 0)
            ds_own.store(dst)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ds_ready)
            # dK / dV of this block done (their register operands free) while the other consumer writes its half
            dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
            mbarrier.arrive(q_empty.index(stage))
            mbarrier.wait(ds_ready, i & 1)
            # [FEATURES, ROWS] dQ_i^T's features [feature0, + FEATURES) from every key of the block (unscaled)
            dq = warpgroup_mma(k_features.permute((1, 0)), ds_smem, zero_dq, use_acc=False)
            mbarrier.arrive(ds_free)
        else:
            # dS^T [OWN, ROWS] of this consumer's keys (its previous dQ product, synchronous, is done)
            ds_own.store(dst)
            fence_async_shared()
            gl.thread_barrier()
            dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
            mbarrier.arrive(q_empty.index(stage))
            # [FEATURES, ROWS] every feature of dQ_i^T from this consumer's keys (unscaled)
            dq = warpgroup_mma(k_features.permute((1, 0)), ds_own, zero_dq, use_acc=False)
        # a 64-bit base per (batch, head), 32-bit offsets inside it (ops/hopper_bwd.covers keeps a batch's rows
        # below 2^31 elements), computed here so that they are not hoisted out of the loop as 64-bit registers;
        # DQAccum has its rows padded to whole blocks, so no mask (rows past seqlen_q add zeros: their P is 0)
        dq_head = DQAccum + (batch.to(gl.int64) * stride_dqa_b + head.to(gl.int64) * stride_dqa_h)
        dq_offsets = gl.expand_dims(dq_features, 1) + gl.expand_dims((m_start + dq_rows) * stride_dqa_m, 0)
        gl.atomic_add(dq_head + dq_offsets, dq, sem="relaxed")
    # [OWN, HEAD_DIM] stores of this consumer's key rows below seqlen_k
    rows = n_start + key0 + gl.arange(0, OWN, gl.SliceLayout(1, dkv_layout))
    features = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, dkv_layout))
    store_mask = gl.expand_dims(rows < seqlen_k, 1)
    dk_ptrs = (DK + batch.to(gl.int64) * stride_dk_b + head_k.to(gl.int64) * stride_dk_h
               + gl.expand_dims(rows.to(gl.int64) * stride_dk_n, 1) + gl.expand_dims(features, 0))
    dv_ptrs = (DV + batch.to(gl.int64) * stride_dv_b + head_k.to(gl.int64) * stride_dv_h
               + gl.expand_dims(rows.to(gl.int64) * stride_dv_n, 1) + gl.expand_dims(features, 0))
    gl.store(dk_ptrs, (dk * softmax_scale).to(dtype), mask=store_mask)
    gl.store(dv_ptrs, dv.to(dtype), mask=store_mask)


@gluon.jit(do_not_specialize=["stride_lse_b", "stride_lse_h", "seqlen_q", "seqlen_k", "heads_per_group"])
def attn_bwd_hopper_kernel(k_desc, v_desc, q_desc, do_desc, Lse, Delta, DQAccum, DK, DV,
                           stride_lse_b, stride_lse_h, stride_dqa_b, stride_dqa_m, stride_dqa_h,
                           stride_dk_b, stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h,
                           num_heads_k, group_size, seqlen_q, seqlen_k, heads_per_group, softmax_scale, qk_scale_log2,
                           CAUSAL: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           num_warps: gl.constexpr):
    """One program per (128-key block, batch * kv head), key blocks in order (under a causal mask the blocks seen
    by the most query rows first), in launch-order groups of heads_per_group (batch, kv head) pairs. num_warps (4)
    is the first consumer's; the second consumer (4 warps, CONSUMER_REGS registers) and the producer (1 warp) are
    worker partitions."""
    KEYS: gl.constexpr = k_desc.block_type.shape[1]
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[3]
    dtype: gl.constexpr = k_desc.dtype
    n_block, batch_head = _tile_and_batch_head(gl.cdiv(seqlen_k, KEYS), heads_per_group)
    batch = batch_head // num_heads_k
    head_k = batch_head % num_heads_k
    n_start = n_block * KEYS
    # query blocks that see a key of this block: all, or under the causal mask (bottom-right aligned) the rows
    # from n_start - (seqlen_k - seqlen_q) on
    m_block_lo = 0
    if CAUSAL:
        m_block_lo = gl.maximum(n_start - (seqlen_k - seqlen_q), 0) // ROWS
    blocks_per_head = gl.cdiv(seqlen_q, ROWS) - m_block_lo
    n_iterations = group_size * blocks_per_head
    # [1, KEYS, 1, HEAD_DIM] K, V; [STAGES, 1, ROWS, 1, HEAD_DIM] Q, dO; [KEYS, ROWS] dS^T
    k_smem = gl.allocate_shared_memory(dtype, [1, KEYS, 1, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, KEYS, 1, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, ROWS, 1, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, ROWS, 1, HEAD_DIM], do_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [KEYS, ROWS], gl.NVMMASharedLayout.get_default_for([KEYS, ROWS], dtype))
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for stage in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(stage), count=1)
        mbarrier.init(q_empty.index(stage), count=2)
    mbarrier.init(ds_ready, count=2)
    mbarrier.init(ds_free, count=2)
    # constexprs arrive in partitions as plain ints (Triton 3.6): the flag and key offsets travel as tensors
    causal = gl.to_tensor(CAUSAL).to(gl.int32)
    OWN: gl.constexpr = KEYS // 2
    # dQ^T as M = 64 wgmmas: head dim 128 split by features (64 each), head dim 64 split by keys
    gl.static_assert((HEAD_DIM == 64) | (HEAD_DIM == 128), "the Gluon backward takes head dim 64 or 128")
    SPLIT_FEATURES: gl.constexpr = HEAD_DIM == 128
    FEATURES: gl.constexpr = HEAD_DIM // 2 if SPLIT_FEATURES else HEAD_DIM
    # [KEYS, HEAD_DIM] K and V of the block
    k_flat = k_smem.reshape([KEYS, HEAD_DIM])
    v_flat = v_smem.reshape([KEYS, HEAD_DIM])
    pointers = (Lse, Delta, DQAccum, DK, DV, stride_lse_b, stride_lse_h, stride_dqa_b, stride_dqa_m, stride_dqa_h,
                stride_dk_b, stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h, batch, head_k, n_start)
    loop = (group_size, m_block_lo, blocks_per_head, n_iterations, seqlen_q, seqlen_k, softmax_scale, qk_scale_log2,
            causal)
    barriers = (kv_ready, q_ready, q_empty, ds_ready, ds_free)
    if SPLIT_FEATURES:
        features = (k_flat.slice(0, FEATURES, dim=1), k_flat.slice(FEATURES, FEATURES, dim=1))
        second_feature = FEATURES
    else:
        features = (k_flat.slice(0, OWN, dim=0), k_flat.slice(OWN, OWN, dim=0))
        second_feature = 0
    first = (k_flat.slice(0, OWN, dim=0), v_flat.slice(0, OWN, dim=0), features[0], q_smem, do_smem, ds_smem,
             ds_smem.slice(0, OWN, dim=0))
    second = (k_flat.slice(OWN, OWN, dim=0), v_flat.slice(OWN, OWN, dim=0), features[1], q_smem, do_smem, ds_smem,
              ds_smem.slice(OWN, OWN, dim=0))
    gl.warp_specialize([
        (_consumer, first + barriers + pointers + (gl.to_tensor(0), gl.to_tensor(0)) + loop),
        (_consumer, second + barriers + pointers + (gl.to_tensor(OWN), gl.to_tensor(second_feature)) + loop),
        (_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_ready, q_ready, q_empty,
                     batch, head_k, n_start, group_size, m_block_lo, blocks_per_head, n_iterations)),
    ], [4, 1], [CONSUMER_REGS, 24])

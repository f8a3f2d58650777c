"""Backward dK/dV (and dQ) for Hopper (sm_90) at head dim 256 in Gluon, warp-specialized: the division of
kernels/bwd_hopper.py (one program per key block, a one-warp TMA producer streaming Q / dO blocks of 64 rows, two
consumer warpgroups) cut to fit 256 features into shared memory.

Per query block i (64 rows), for a block of 64 keys, consumer w:
  S_w = Q_i K_w^T, dP_w = dO_i V_w^T over its 32 keys [32w, 32w + 32)  [64 rows, 32 keys], M = 64 wgmmas over
  the two feature halves of Q_i / dO_i
  P_w, dS_w as in kernels/bwd_hopper.py, stored into its 32-key half of the [64 rows, 64 keys] P and dS tiles
  then, once both halves are there (pds_ready), over its 128 features [128w, 128w + 128):
  dV_w += P^T dO_i[:, feats], dK_w += dS^T Q_i[:, feats]      [64 keys, 128 features] accumulators in registers
  dQ_i[:, feats]^T = K[:, feats]^T dS^T in four [64 features, 32 rows] pieces, each added to the fp32 accumulator
  by a TMA reduction through a [32 rows, 64 features] fp32 tile
Every product needs both consumers' P / dS halves, so the consumers run in phase (pds_ready, then pds_free once
both are done reading P and dS); the one-block lag of kernels/bwd_hopper.py would need a third Q / dO stage.

Shared memory (bf16): K, V [64, 256] 64 KB; Q, dO in feature halves [64, 128] x 2 stages 128 KB (one allocation per
half: a slice of a staged buffer along its last dimension does not compile in Triton 3.6); P, dS [64, 64] 16 KB;
two dQ tiles 16 KB; lse / delta 1 KB: 231120 bytes of the 232448 a program may have (offline compile).

Measured (H200, 2026-12-01, benchmarks/bench_hopper_bwd.py, 4x4096x8x256 bf16): 284 / 240 TF/s non-causal /
causal against 190 / 166 for the Triton backward (kernels/bwd.py) and 255 / 232 for FA2 (SDPA FLASH).

Scope, masking and rows past seqlen_q: as kernels/bwd_hopper.py (ops/hopper_bwd decides).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from .bwd_hopper import _async_reduce_add, _query_block
from .common import grouped_tile_of

KEYS_PER_PROGRAM = gl.constexpr(64)  # the M of the dK / dV wgmmas; each consumer's S / dP covers half of them
_grouped_tile_of = gluon.jit(grouped_tile_of.fn)


@gluon.jit
def _add_dq_pieces(k_feat, ds_smem, dq_tile, dq_desc, batch, m_start, head, feature0, softmax_scale):
    """dQ_i[:, feature0 + 64 fj : + 64][32 rj : + 32]^T = K[:, features]^T dS[32 rj : + 32]^T, scaled, for this
    consumer's features (k_feat [KEYS, FEAT]: K's columns; ds_smem [ROWS, KEYS]), each piece added to the fp32 dQ
    accumulator by a TMA reduction (dq_desc) through the staging tile dq_tile [1, DQ_ROWS, 1, DQ_FEAT]."""
    ROWS: gl.constexpr = ds_smem.shape[0]
    FEAT: gl.constexpr = k_feat.shape[1]
    DQ_ROWS: gl.constexpr = dq_tile.shape[1]    # 32
    DQ_FEAT: gl.constexpr = dq_tile.shape[3]    # 64
    # [DQ_FEAT, DQ_ROWS] a piece of dQ^T, and its view of the staging tile
    dqt_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, DQ_ROWS, 16])
    zero_dqt = gl.zeros([DQ_FEAT, DQ_ROWS], gl.float32, dqt_layout)
    dq_stage = dq_tile.reshape([DQ_ROWS, DQ_FEAT]).permute((1, 0))
    for fj in gl.static_range(FEAT // DQ_FEAT):
        for rj in gl.static_range(ROWS // DQ_ROWS):
            dqt = warpgroup_mma(k_feat.slice(fj * DQ_FEAT, DQ_FEAT, dim=1).permute((1, 0)),
                                ds_smem.slice(rj * DQ_ROWS, DQ_ROWS, dim=0).permute((1, 0)), zero_dqt,
                                use_acc=False, is_async=True)
            dqt = warpgroup_mma_wait(0, deps=(dqt, ))
            # the previous piece's reduction has read the tile
            tma.store_wait(0)
            dq_stage.store(dqt * softmax_scale)
            fence_async_shared()
            _async_reduce_add(dq_desc, [batch, m_start + rj * DQ_ROWS, head, feature0 + fj * DQ_FEAT], dq_tile)


@gluon.jit
def _consumer(k_own, v_own, k_feat, q_own, do_own, q_lo, q_hi, do_lo, do_hi, lse_smem, delta_smem, p_smem, ds_smem,
              p_own, ds_own, dq_out, kv_ready, q_ready, q_empty, pds_ready, pds_free, DK, DV, stride_dk_b,
              stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h, batch, head_k, n_start, key0, feature0,
              group_size, m_block_lo, blocks_per_head, n_iterations, seqlen_q, seqlen_k, softmax_scale, qk_scale_log2,
              causal):
    """One warpgroup: S / dP of keys [n_start + key0, + OWN) (k_own, v_own [OWN, HEAD_DIM]; p_own, ds_own: its
    [ROWS, OWN] halves of the P and dS tiles), dK / dV / dQ of features [feature0, + FEAT) (k_feat [KEYS, FEAT]: K's
    columns; q_own, do_own: the staged Q / dO halves holding them). q_lo / q_hi, do_lo / do_hi: both feature halves
    of every Q / dO stage ([STAGES, 1, ROWS, 1, FEAT]); dq_out: ((the fp32 tile [1, DQ_ROWS, 1, DQ_FEAT] that stages
    each dQ piece for its TMA reduction, dq_desc), ) or, for dK and dV only, () (the launcher runs a dQ kernel of its
    own; constexprs do not reach partitions in Triton 3.6, a tuple's length does)."""
    STAGES: gl.constexpr = q_lo.shape[0]
    ROWS: gl.constexpr = q_lo.shape[2]
    OWN: gl.constexpr = k_own.shape[0]          # 32 keys: this consumer's S / dP columns
    KEYS: gl.constexpr = k_feat.shape[0]        # 64 keys of the block
    FEAT: gl.constexpr = k_feat.shape[1]        # 128 features: this consumer's dK / dV / dQ columns
    dtype: gl.constexpr = k_own.dtype
    # [ROWS, OWN] scores; [KEYS, FEAT] dK / dV
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, OWN, 16])
    dkv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, FEAT, 16])
    row_of_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    key_of_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    zero_s = gl.zeros([ROWS, OWN], gl.float32, s_layout)
    dk = gl.zeros([KEYS, FEAT], gl.float32, dkv_layout)
    dv = gl.zeros([KEYS, FEAT], gl.float32, dkv_layout)
    last_key = n_start + key0 + OWN - 1
    mbarrier.wait(kv_ready, 0)
    for i in range(n_iterations):
        stage = i % STAGES
        head, m_start = _query_block(i, blocks_per_head, m_block_lo, head_k, group_size, ROWS)
        # [ROWS] query rows of the block
        offs_m = m_start + gl.arange(0, ROWS, row_of_s)
        mbarrier.wait(q_ready.index(stage), (i // STAGES) & 1)
        # [ROWS, FEAT] feature halves of Q_i and dO_i
        q_tile_lo = q_lo.index(stage).reshape([ROWS, FEAT])
        q_tile_hi = q_hi.index(stage).reshape([ROWS, FEAT])
        do_tile_lo = do_lo.index(stage).reshape([ROWS, FEAT])
        do_tile_hi = do_hi.index(stage).reshape([ROWS, FEAT])
        # [ROWS] log2(e) * lse and delta (0 for rows past seqlen_q, like their Q and dO rows)
        lse_log2 = lse_smem.index(stage).reshape([ROWS]).load(row_of_s) * 1.4426950408889634
        delta = delta_smem.index(stage).reshape([ROWS]).load(row_of_s)
        s = warpgroup_mma(q_tile_lo, k_own.slice(0, FEAT, dim=1).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
        s = warpgroup_mma(q_tile_hi, k_own.slice(FEAT, FEAT, dim=1).permute((1, 0)), s, is_async=True)
        dp = warpgroup_mma(do_tile_lo, v_own.slice(0, FEAT, dim=1).permute((1, 0)), zero_s, use_acc=False,
                           is_async=True)
        dp = warpgroup_mma(do_tile_hi, v_own.slice(FEAT, FEAT, dim=1).permute((1, 0)), dp, is_async=True)
        s = warpgroup_mma_wait(2, deps=(s, ))
        # [ROWS, OWN] P; masked where a key is past seqlen_k or, causal, after the row's last key
        p = gl.exp2(s * qk_scale_log2 - gl.expand_dims(lse_log2, 1))
        if (last_key >= seqlen_k) | ((causal != 0) & (last_key > m_start + (seqlen_k - seqlen_q))):
            # [OWN] this consumer's keys
            offs_n = n_start + key0 + gl.arange(0, OWN, key_of_s)
            visible = gl.expand_dims(offs_n < seqlen_k, 0) & gl.expand_dims(offs_m < seqlen_q, 1)
            if causal != 0:
                visible = visible & (gl.expand_dims(offs_n, 0) <= gl.expand_dims(offs_m + (seqlen_k - seqlen_q), 1))
            p = gl.where(visible, p, 0.0)
        # both consumers' products of the previous block (readers of P and dS) completed
        mbarrier.wait(pds_free, (i - 1) & 1, pred=i >= 1)
        p_own.store(p.to(dtype))
        dp = warpgroup_mma_wait(0, deps=(dp, ))
        # [ROWS, OWN] dS
        ds = (p * (dp - gl.expand_dims(delta, 1))).to(dtype)
        ds_own.store(ds)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(pds_ready)
        # both halves of P and dS are there
        mbarrier.wait(pds_ready, i & 1)
        # [ROWS, FEAT] this consumer's features of Q_i and dO_i
        q_half = q_own.index(stage).reshape([ROWS, FEAT])
        do_half = do_own.index(stage).reshape([ROWS, FEAT])
        dv = warpgroup_mma(p_smem.permute((1, 0)), do_half, dv, is_async=True)
        dk = warpgroup_mma(ds_smem.permute((1, 0)), q_half, dk, is_async=True)
        for with_dq in gl.static_range(len(dq_out)):
            # the pieces' waits (wgmma groups complete in order) cover dV and dK too
            _add_dq_pieces(k_feat, ds_smem, dq_out[with_dq][0], dq_out[with_dq][1], batch, m_start, head, feature0,
                           softmax_scale)
        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
        # every read of P and dS (dV, dK and the dQ pieces) completed
        mbarrier.arrive(pds_free)
        mbarrier.arrive(q_empty.index(stage))
    # [KEYS, FEAT] stores of this consumer's features of the key rows below seqlen_k
    rows = n_start + gl.arange(0, KEYS, gl.SliceLayout(1, dkv_layout))
    features = feature0 + gl.arange(0, FEAT, gl.SliceLayout(0, dkv_layout))
    store_mask = gl.expand_dims(rows < seqlen_k, 1)
    dk_ptrs = (DK + batch.to(gl.int64) * stride_dk_b + head_k.to(gl.int64) * stride_dk_h
               + gl.expand_dims(rows.to(gl.int64) * stride_dk_n, 1) + gl.expand_dims(features, 0))
    dv_ptrs = (DV + batch.to(gl.int64) * stride_dv_b + head_k.to(gl.int64) * stride_dv_h
               + gl.expand_dims(rows.to(gl.int64) * stride_dv_n, 1) + gl.expand_dims(features, 0))
    gl.store(dk_ptrs, (dk * softmax_scale).to(dtype), mask=store_mask)
    gl.store(dv_ptrs, dv.to(dtype), mask=store_mask)
    tma.store_wait(0)


@gluon.jit
def _producer(k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_lo, q_hi, do_lo, do_hi,
                 lse_smem, delta_smem, kv_ready, q_ready, q_empty, batch, head_k, n_start, num_heads, group_size,
                 m_block_lo, blocks_per_head, n_iterations):
    """One warp: the key block's K and V once, then both feature halves of Q_i and dO_i and their rows' lse and
    delta of every iteration into stage i % STAGES."""
    STAGES: gl.constexpr = q_lo.shape[0]
    KEYS: gl.constexpr = k_smem.shape[1]
    ROWS: gl.constexpr = q_lo.shape[2]
    FEAT: gl.constexpr = q_lo.shape[4]
    HEAD_DIM: gl.constexpr = k_smem.shape[3]
    element_bytes: gl.constexpr = k_desc.dtype.primitive_bitwidth // 8
    mbarrier.expect(kv_ready, 2 * KEYS * HEAD_DIM * element_bytes)
    tma.async_copy_global_to_shared(k_desc, [batch, n_start, head_k, 0], kv_ready, k_smem)
    tma.async_copy_global_to_shared(v_desc, [batch, n_start, head_k, 0], kv_ready, v_smem)
    for i in range(n_iterations):
        stage = i % STAGES
        mbarrier.wait(q_empty.index(stage), ((i // STAGES) - 1) & 1, pred=i >= STAGES)
        head, m_start = _query_block(i, blocks_per_head, m_block_lo, head_k, group_size, ROWS)
        ready = q_ready.index(stage)
        mbarrier.expect(ready, 4 * ROWS * FEAT * element_bytes + 2 * ROWS * 4)
        tma.async_copy_global_to_shared(q_desc, [batch, m_start, head, 0], ready, q_lo.index(stage))
        tma.async_copy_global_to_shared(q_desc, [batch, m_start, head, FEAT], ready, q_hi.index(stage))
        tma.async_copy_global_to_shared(do_desc, [batch, m_start, head, 0], ready, do_lo.index(stage))
        tma.async_copy_global_to_shared(do_desc, [batch, m_start, head, FEAT], ready, do_hi.index(stage))
        row = batch * num_heads + head
        tma.async_copy_global_to_shared(lse_desc, [row, m_start], ready, lse_smem.index(stage))
        tma.async_copy_global_to_shared(delta_desc, [row, m_start], ready, delta_smem.index(stage))


@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "heads_per_group"])
def attn_bwd_hopper_d256_kernel(k_desc, v_desc, q_desc, do_desc, dq_desc, lse_desc, delta_desc, DK, DV,
                                stride_dk_b, stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h,
                                num_heads_k, group_size, seqlen_q, seqlen_k, heads_per_group, softmax_scale,
                                qk_scale_log2, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                                CONSUMER_REGS: gl.constexpr, DQ: gl.constexpr, num_warps: gl.constexpr):
    """One program per (64-key block, batch * kv head), in kernels/bwd_hopper.py's order and launch-order groups.
    q_desc / do_desc move [1, ROWS, 1, HEAD_DIM / 2] feature halves, dq_desc [1, 32, 1, 64] fp32 pieces (DQ; without
    DQ the kernel computes dK and dV only and dq_desc is None). num_warps (4) is the first consumer's; the second
    consumer (4 warps, CONSUMER_REGS registers) and the producer (1 warp) are worker partitions."""
    KEYS: gl.constexpr = k_desc.block_type.shape[1]
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[3]
    FEAT: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = k_desc.dtype
    n_key_blocks = gl.cdiv(seqlen_k, KEYS)
    n_block, batch_head = _grouped_tile_of(gl.program_id(0), n_key_blocks, gl.num_programs(0) // n_key_blocks,
                                           heads_per_group)
    batch = batch_head // num_heads_k
    head_k = batch_head % num_heads_k
    n_start = n_block * KEYS
    m_block_lo = 0
    if CAUSAL:
        m_block_lo = gl.maximum(n_start - (seqlen_k - seqlen_q), 0) // ROWS
    blocks_per_head = gl.cdiv(seqlen_q, ROWS) - m_block_lo
    n_iterations = group_size * blocks_per_head
    # [1, KEYS, 1, HEAD_DIM] K, V
    k_smem = gl.allocate_shared_memory(dtype, [1, KEYS, 1, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, KEYS, 1, HEAD_DIM], v_desc.layout)
    # [STAGES, 1, ROWS, 1, FEAT] feature halves of the Q / dO stages
    q_lo = gl.allocate_shared_memory(dtype, [STAGES, 1, ROWS, 1, FEAT], q_desc.layout)
    q_hi = gl.allocate_shared_memory(dtype, [STAGES, 1, ROWS, 1, FEAT], q_desc.layout)
    do_lo = gl.allocate_shared_memory(dtype, [STAGES, 1, ROWS, 1, FEAT], do_desc.layout)
    do_hi = gl.allocate_shared_memory(dtype, [STAGES, 1, ROWS, 1, FEAT], do_desc.layout)
    # [ROWS, KEYS] P and dS, each consumer writing its OWN-key half: a 64-byte swizzle makes that half (32 keys,
    # 64 bytes) a whole swizzle atom
    pds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    p_smem = gl.allocate_shared_memory(dtype, [ROWS, KEYS], pds_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [ROWS, KEYS], pds_layout)
    # [STAGES, 1, ROWS] log2(e) * lse and delta; [2, 1, 32, 1, 64] each consumer's fp32 dQ piece
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    if DQ:
        dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
        dq_tiles = (((dq_smem.index(0), dq_desc), ), ((dq_smem.index(1), dq_desc), ))
    else:
        dq_tiles = ((), ())
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    pds_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    pds_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for stage in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(stage), count=1)
        mbarrier.init(q_empty.index(stage), count=2)
    mbarrier.init(pds_ready, count=2)
    mbarrier.init(pds_free, count=2)
    # constexprs arrive in partitions as plain ints (Triton 3.6): the flag and offsets travel as tensors
    causal = gl.to_tensor(CAUSAL).to(gl.int32)
    OWN: gl.constexpr = KEYS // 2
    k_flat = k_smem.reshape([KEYS, HEAD_DIM])
    v_flat = v_smem.reshape([KEYS, HEAD_DIM])
    pointers = (DK, DV, stride_dk_b, stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h, batch,
                head_k, n_start)
    loop = (group_size, m_block_lo, blocks_per_head, n_iterations, seqlen_q, seqlen_k, softmax_scale, qk_scale_log2,
            causal)
    barriers = (kv_ready, q_ready, q_empty, pds_ready, pds_free)
    staged = (q_lo, q_hi, do_lo, do_hi, lse_smem, delta_smem, p_smem, ds_smem)
    # consumer w: keys [OWN w, + OWN) for S / dP, features [FEAT w, + FEAT) for dK / dV / dQ
    first = (k_flat.slice(0, OWN, dim=0), v_flat.slice(0, OWN, dim=0), k_flat.slice(0, FEAT, dim=1), q_lo,
             do_lo) + staged + (p_smem.slice(0, OWN, dim=1), ds_smem.slice(0, OWN, dim=1), dq_tiles[0])
    second = (k_flat.slice(OWN, OWN, dim=0), v_flat.slice(OWN, OWN, dim=0), k_flat.slice(FEAT, FEAT, dim=1), q_hi,
              do_hi) + staged + (p_smem.slice(OWN, OWN, dim=1), ds_smem.slice(OWN, OWN, dim=1), dq_tiles[1])
    gl.warp_specialize([
        (_consumer, first + barriers + pointers + (gl.to_tensor(0), gl.to_tensor(0)) + loop),
        (_consumer, second + barriers + pointers + (gl.to_tensor(OWN), gl.to_tensor(FEAT)) + loop),
        (_producer, (k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_lo, q_hi, do_lo,
                     do_hi, lse_smem, delta_smem, kv_ready, q_ready, q_empty, batch, head_k, n_start,
                     num_heads_k * group_size, group_size, m_block_lo, blocks_per_head, n_iterations)),
    ], [4, 1], [CONSUMER_REGS, 24])

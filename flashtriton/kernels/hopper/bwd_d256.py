"""Backward dK/dV for Hopper (sm_90) at head dims 192 and 256 in Gluon, warp-specialized: bwd.py's division (one program
per key block, a one-warp TMA producer streaming Q / dO blocks of 64 rows, two consumer warpgroups) cut to fit 256
features into shared memory. dQ is not computed here: backend.launch_bwd runs a dQ kernel after this one (at 192
the Gluon one, bwd_dq.py; at 256 the Triton one, kernels/bwd.py), so there is no fp32 accumulator and no reduction,
and the result is deterministic (TMA reductions of dQ in this kernel cost it more than the separate Triton dQ kernel
does).

Per query block i (64 rows), for a block of 64 keys, consumer w:
  S_w = Q_i K_w^T, dP_w = dO_i V_w^T over its 32 keys [32w, 32w + 32)  [64 rows, 32 keys], M = 64 wgmmas over
  the two feature halves of Q_i / dO_i
  P_w, dS_w as in bwd.py, stored into its 32-key half of the [64 rows, 64 keys] P and dS tiles
  then, once both halves are there (pds_ready), over its feature part (the first 128 features, or the rest):
  dV_w += P^T dO_i[:, feats], dK_w += dS^T Q_i[:, feats]      [64 keys, 128 (or 64) features] accumulators in registers
At head dim 256 the feature parts are two 128-wide halves of Q / dO (one descriptor) and of the whole K / V tiles; at
192 (configs.HOPPER_BWD_CHUNKS: 128 + 64) they are the column chunks of every tensor, each with descriptors and
allocations of its own (Gluon's shared layouts take power-of-two widths), and consumer 1 owns the 64-wide one. V's
head dim takes its own form (MLA-style (192, 128) or (256, 128): V whole, dO in halves of 64), so a consumer's dK and
dV parts may differ in width.
Every product needs both consumers' P / dS halves, so the consumers run in phase (pds_ready, then pds_free once
both are done reading P and dS).

Shared memory (bf16): K, V [64, 256] 64 KB; Q, dO in feature halves [64, 128] x 2 stages 128 KB (one allocation per
half: a slice of a staged buffer along its last dimension does not compile in Triton 3.6); P, dS [64, 64] 16 KB;
lse / delta 1 KB; the layout conversion of the dK / dV stores 16 KB: 230480 bytes of the 232448 a program may have
(offline compile).

Scope, masking and rows past seqlen_q: as bwd.py (ops/hopper.covers decides).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_wait

from .common import allocate_chunks, arrive_after_wgmma, backward_producer, chained_products, chunk_descriptors, \
    entries_of, key_block_of_program, key_rows, masked_probabilities, matrices_of, query_block, store_rows

KEYS_PER_PROGRAM = gl.constexpr(64)  # the M of the dK / dV wgmmas; each consumer's S / dP covers half of them


@gluon.jit
def _feature_parts(chunks, FEAT: gl.constexpr):
    """K or V of the block ([KEYS, WIDTH] per chunk) as the two feature parts the consumers' Q / dO parts match:
    whole rows (256 wide, or V's 128) cut into FEAT-wide halves, or the two chunks themselves."""
    if len(chunks) == 1:
        return (chunks[0].slice(0, FEAT, dim=1), chunks[0].slice(FEAT, FEAT, dim=1))
    else:
        return chunks


@gluon.jit
def _feature_descriptors(first, second):
    """The two feature parts' descriptors of Q or dO: the two column chunks', or (second None) the one descriptor
    whose box is half of the row, twice."""
    if second is None:
        return (first, first)
    else:
        return (first, second)


@gluon.jit
def _consumer(k_own, v_own, q_own, do_own, q_lo, q_hi, do_lo, do_hi, lse_smem, delta_smem, p_smem, ds_smem,
              p_own, ds_own, kv_ready, q_ready, q_empty, pds_ready, pds_free, DK, DV, stride_dk_b,
              stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h, batch, head_k, n_start, head_dim,
              head_dim_v, aligned, key0, feature_k0, feature_v0, group_size, m_block_lo, blocks_per_head,
              n_iterations, seqlen_q, seqlen_k, softmax_scale, qk_scale_log2, causal, window):
    """One warpgroup: S / dP of keys [n_start + key0, + OWN) (k_own, v_own: their rows [OWN, WIDTH] of each feature
    part; p_own, ds_own: its [ROWS, OWN] halves of the P and dS tiles), dK of features [feature_k0, + FEAT_K) and dV
    of features [feature_v0, + FEAT_V) (q_own, do_own: the staged Q / dO part holding them). q_lo / q_hi, do_lo / do_hi: both feature parts of every Q / dO
    stage ([STAGES, 1, ROWS, 1, WIDTH])."""
    STAGES: gl.constexpr = q_lo.shape[0]
    ROWS: gl.constexpr = q_lo.shape[2]
    OWN: gl.constexpr = k_own[0].shape[0]       # 32 keys: this consumer's S / dP columns
    KEYS: gl.constexpr = 2 * OWN                # 64 keys of the block
    FEAT_K: gl.constexpr = q_own.shape[4]       # 128 or 64 features: this consumer's dK columns
    FEAT_V: gl.constexpr = do_own.shape[4]      # 128 or 64 features: its dV columns (V's head dim may differ)
    dtype: gl.constexpr = k_own[0].dtype
    # [ROWS, OWN] scores; [KEYS, FEAT_K] dK, [KEYS, FEAT_V] dV
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, OWN, 16])
    dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, FEAT_K, 16])
    dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, FEAT_V, 16])
    row_of_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    zero_s = gl.zeros([ROWS, OWN], gl.float32, s_layout)
    dk = gl.zeros([KEYS, FEAT_K], gl.float32, dk_layout)
    dv = gl.zeros([KEYS, FEAT_V], gl.float32, dv_layout)
    mbarrier.wait(kv_ready, 0)
    for i in range(n_iterations):
        stage = i % STAGES
        head, m_start = query_block(i, blocks_per_head, m_block_lo, head_k, group_size, ROWS)
        mbarrier.wait(q_ready.index(stage), (i // STAGES) & 1)
        # [ROWS, WIDTH] per feature part: Q_i and dO_i
        q_parts = matrices_of((q_lo.index(stage), q_hi.index(stage)))
        do_parts = matrices_of((do_lo.index(stage), do_hi.index(stage)))
        # [ROWS] log2(e) * lse and delta (0 for rows past seqlen_q, like their Q and dO rows)
        lse_log2 = lse_smem.index(stage).reshape([ROWS]).load(row_of_s) * 1.4426950408889634
        delta = delta_smem.index(stage).reshape([ROWS]).load(row_of_s)
        s = chained_products(q_parts, k_own, zero_s)
        dp = chained_products(do_parts, v_own, zero_s)
        s = warpgroup_mma_wait(2, deps=(s, ))
        # [ROWS, OWN] P
        p, _ = masked_probabilities(s, lse_log2, qk_scale_log2, n_start + key0, m_start, seqlen_q, seqlen_k, causal,
                                    window, 1, (), ())
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
        # [ROWS, FEAT_K] and [ROWS, FEAT_V]: this consumer's features of Q_i and dO_i
        q_half = q_own.index(stage).reshape([ROWS, FEAT_K])
        do_half = do_own.index(stage).reshape([ROWS, FEAT_V])
        dv = warpgroup_mma(p_smem.permute((1, 0)), do_half, dv, is_async=True)
        dk = warpgroup_mma(ds_smem.permute((1, 0)), q_half, dk, is_async=True)
        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
        # every read of P and dS (both consumers' dV and dK products) completed
        arrive_after_wgmma(pds_free)
        arrive_after_wgmma(q_empty.index(stage))
    # [KEYS, FEAT_K] and [KEYS, FEAT_V]: this consumer's features of the key rows
    store_rows(dk * softmax_scale, DK, stride_dk_b, stride_dk_n, stride_dk_h, batch, head_k, n_start, feature_k0,
               seqlen_k, head_dim, aligned)
    store_rows(dv, DV, stride_dv_b, stride_dv_n, stride_dv_h, batch, head_k, n_start, feature_v0, seqlen_k,
               head_dim_v, aligned)


@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "head_dim", "head_dim_v", "heads_per_group", "window_left",
                               "window_right"])
def attn_bwd_hopper_d256_kernel(k_desc, v_desc, q_desc, do_desc, k_desc2, v_desc2, q_desc2, do_desc2, lse_desc,
                                delta_desc, DK, DV,
                                stride_dk_b, stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h,
                                num_heads_k, group_size, seqlen_q, seqlen_k, head_dim, head_dim_v, heads_per_group,
                                softmax_scale, qk_scale_log2, window_left, window_right, CAUSAL: gl.constexpr,
                                LOCAL: gl.constexpr, ALIGNED_ROWS: gl.constexpr, STAGES: gl.constexpr,
                                CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """One program per (64-key block, batch * kv head), in bwd.py's order and launch-order groups (LOCAL: bwd.py's).
    Q / K and dO / V each take one of two forms by their tiles' head dim: one chunk (k_desc2 / q_desc2, or v_desc2 /
    do_desc2, None), whose K (V) descriptor moves whole [1, KEYS, 1, WIDTH] rows and whose Q (dO) descriptor
    [1, ROWS, 1, WIDTH / 2] feature halves (256: halves of 128; V's own 128: halves of 64), or two column chunks
    (192: 128 + 64), every descriptor pair moving one each. head_dim and head_dim_v bound the dK and dV stores;
    ALIGNED_ROWS: both take 16-byte stores (common.store_rows' `aligned`).
    num_warps (4) is the first consumer's; the second consumer (4 warps, CONSUMER_REGS registers) and the producer
    (1 warp, common.backward_producer) are worker partitions."""
    KEYS: gl.constexpr = k_desc.block_type.shape[1]
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    # the first consumer's dK and dV features (the second's start there)
    FEAT_K: gl.constexpr = q_desc.block_type.shape[3]
    FEAT_V: gl.constexpr = do_desc.block_type.shape[3]
    dtype: gl.constexpr = k_desc.dtype
    # the local window, or () without one (a tuple's length reaches the partitions)
    if LOCAL:
        window = (window_left, window_right)
    else:
        window = ()
    batch, head_k, n_start, m_block_lo, blocks_per_head, n_iterations, _ = key_block_of_program(
        num_heads_k, group_size, seqlen_q, seqlen_k, heads_per_group, window, KEYS, ROWS, CAUSAL, False, ())
    # K, V: [1, 1, KEYS, 1, WIDTH] per descriptor (whole rows, or the two chunks); Q, dO: [STAGES, 1, ROWS, 1, WIDTH]
    # per feature part
    k_descs, v_descs = chunk_descriptors(k_desc, k_desc2), chunk_descriptors(v_desc, v_desc2)
    q_descs, do_descs = _feature_descriptors(q_desc, q_desc2), _feature_descriptors(do_desc, do_desc2)
    k_smem = allocate_chunks(k_descs, 1)
    v_smem = allocate_chunks(v_descs, 1)
    q_lo, q_hi = allocate_chunks(q_descs, STAGES)
    do_lo, do_hi = allocate_chunks(do_descs, STAGES)
    # [ROWS, KEYS] P and dS, each consumer writing its OWN-key half: a 64-byte swizzle makes that half (32 keys,
    # 64 bytes) a whole swizzle atom
    pds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    p_smem = gl.allocate_shared_memory(dtype, [ROWS, KEYS], pds_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [ROWS, KEYS], pds_layout)
    # [STAGES, 1, ROWS] lse and delta
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
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
    # [KEYS, WIDTH] per feature part: K and V of the block
    k_parts = _feature_parts(matrices_of(entries_of(k_smem, 0)), FEAT_K)
    v_parts = _feature_parts(matrices_of(entries_of(v_smem, 0)), FEAT_V)
    pointers = (DK, DV, stride_dk_b, stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h, batch,
                head_k, n_start, head_dim, head_dim_v, (0, ) if ALIGNED_ROWS else ())
    loop = (group_size, m_block_lo, blocks_per_head, n_iterations, seqlen_q, seqlen_k, softmax_scale, qk_scale_log2,
            causal, window)
    barriers = (kv_ready, q_ready, q_empty, pds_ready, pds_free)
    staged = (q_lo, q_hi, do_lo, do_hi, lse_smem, delta_smem, p_smem, ds_smem)
    # consumer w: keys [OWN w, + OWN) for S / dP, feature part w for dK / dV
    first = (key_rows(k_parts, 0, OWN), key_rows(v_parts, 0, OWN), q_lo, do_lo) + staged + (
        p_smem.slice(0, OWN, dim=1), ds_smem.slice(0, OWN, dim=1))
    second = (key_rows(k_parts, OWN, OWN), key_rows(v_parts, OWN, OWN), q_hi, do_hi) + staged + (
        p_smem.slice(OWN, OWN, dim=1), ds_smem.slice(OWN, OWN, dim=1))
    gl.warp_specialize([
        (_consumer, first + barriers + pointers + (gl.to_tensor(0), gl.to_tensor(0), gl.to_tensor(0)) + loop),
        (_consumer, second + barriers + pointers + (gl.to_tensor(OWN), gl.to_tensor(FEAT_K), gl.to_tensor(FEAT_V))
         + loop),
        (backward_producer, (k_descs, v_descs, q_descs, do_descs, lse_desc, delta_desc,
                             k_smem, v_smem, (q_lo, q_hi), (do_lo, do_hi), lse_smem, delta_smem, kv_ready,
                             q_ready, q_empty, batch, head_k, n_start, num_heads_k * group_size, group_size,
                             m_block_lo, blocks_per_head, n_iterations, gl.to_tensor(0), gl.to_tensor(0),
                             gl.to_tensor(1), ())),
    ], [4, 1], [CONSUMER_REGS, 24])

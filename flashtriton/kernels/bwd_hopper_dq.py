"""Backward dQ for Hopper (sm_90) in Gluon, warp-specialized, for the head dims where the Gluon dK / dV kernel
leaves dQ to a kernel of its own (head dim 256: kernels/bwd_hopper_d256.py). Query-stationary, like the forward: one
program per 128-row tile of a (batch, head), two consumer warpgroups of 64 rows each, a one-warp TMA producer that
loads both consumers' Q and dO rows once and streams K / V blocks through STAGES stages (both consumers share them).

Per key block j (BLOCK_N keys), consumer c (rows [m_start + 64 c, + 64)):
  S = Q K_j^T, dP = dO V_j^T                     [64 rows, BLOCK_N keys], issued together, async
  P = exp2(S * scale * log2 e - lse * log2 e), masked (kernels/bwd_hopper._masked_probabilities),
  dS = P (dP - delta)
  dQ += dS K_j                                   [64 rows, HEAD_DIM] fp32 in registers; dS is the wgmma's A operand
                                                 from registers, so it never goes to shared memory
The dQ product of block j is issued with block j + 1's S and dP and runs while block j + 1's P and dS are computed;
K_j's stage is released once that product completed, V_j's once dP_j did. At the end dQ * softmax_scale goes to the
consumer's Q tile (no wgmma reads it any more) and out by TMA (rows past seqlen_q clipped). No atomics:
deterministic.

Rows past seqlen_q read Q, dO as zeros and lse, delta as 0: P = 1 there but dS = 0. Keys past seqlen_k are masked
(their K rows read as zeros). Scope: what ops/hopper_bwd covers, at the head dims configs.HOPPER_DQ lists.

Shared memory at head dim 256 with 32-key blocks in 2 stages: Q, dO 2 x [64, 256] each (128 KB), K, V 2 x [32, 256]
each (64 KB): 192 KB.

Measured (H200, 2026-12-01, 4x4096x8x256 backward with the Gluon dK / dV kernel): 307.7 / 325.3 TF/s non-causal /
causal against 358.4 / 330.9 with the Triton dQ kernel, so off by default (configs.HOPPER_DQ_ALLOWED). Suspects, not
measured: the 32-key S and dP wgmmas (N = 32), the in-order waits of every block, consumers not in ping-pong.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from .bwd_hopper import _masked_probabilities
from .fwd_hopper import _load_key_block, _tile_work

ROWS_PER_CONSUMER = gl.constexpr(64)  # one wgmma M tile; a program covers 2 * ROWS_PER_CONSUMER query rows


@gluon.jit
def _tile_of_program(num_heads, group_size, seqlen_q, seqlen_k, causal, TILE_ROWS: gl.constexpr,
                     BLOCK_N: gl.constexpr):
    """(batch, head, kv head, first row, key blocks) of this program: tiles of TILE_ROWS query rows numbered longest
    first (kernels/fwd_hopper._tile_work: under the causal mask the last rows first, at least one key block), every
    (batch, head) of a tile rank before the next rank."""
    num_tiles = gl.cdiv(seqlen_q, TILE_ROWS)
    batch_heads = gl.num_programs(0) // num_tiles
    batch, head, m_start, n_blocks = _tile_work(gl.program_id(0) // batch_heads, gl.program_id(0) % batch_heads,
                                                num_tiles, num_heads, seqlen_q, seqlen_k, causal, TILE_ROWS, BLOCK_N)
    return batch, head, head // group_size, m_start, n_blocks


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qdo_ready, k_ready, v_ready,
              k_empty, v_empty, batch, head, head_k, m_start, n_blocks):
    """One warp: both consumers' Q and dO rows once (qdo_ready), then K and V of every key block j into stage
    j % STAGES once both consumers released that stage's previous K (resp. V)."""
    ROWS: gl.constexpr = q_smem.shape[2]
    HEAD_DIM: gl.constexpr = k_smem.shape[4]
    element_bytes: gl.constexpr = k_desc.dtype.primitive_bitwidth // 8
    mbarrier.expect(qdo_ready, 4 * ROWS * HEAD_DIM * element_bytes)
    for consumer in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [batch, m_start + consumer * ROWS, head, 0], qdo_ready,
                                        q_smem.index(consumer))
        tma.async_copy_global_to_shared(do_desc, [batch, m_start + consumer * ROWS, head, 0], qdo_ready,
                                        do_smem.index(consumer))
    for j in range(n_blocks):
        _load_key_block(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, j, batch, j, head_k)


@gluon.jit
def _consumer(q_tile, do_tile, k_smem, v_smem, qdo_ready, k_ready, v_ready, k_empty, v_empty, dq_desc, Lse, Delta,
              stride_lse_b, stride_lse_h, stride_delta_b, stride_delta_h, batch, head, row0, n_blocks, seqlen_q,
              seqlen_k, softmax_scale, qk_scale_log2, causal):
    """One warpgroup: dQ of query rows [row0, + ROWS) (q_tile, do_tile [1, ROWS, 1, HEAD_DIM], shared) over the
    program's key blocks, stored through q_tile by TMA (dq_desc)."""
    ROWS: gl.constexpr = q_tile.shape[1]
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[2]
    HEAD_DIM: gl.constexpr = k_smem.shape[4]
    dtype: gl.constexpr = q_tile.dtype
    # [ROWS, BLOCK_N] scores; [ROWS, HEAD_DIM] dQ; dS as the A operand of the dQ wgmma
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    ds_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    row_of_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    # [ROWS] this consumer's rows; their log2(e) * lse and delta (0 past seqlen_q)
    offs_m = row0 + gl.arange(0, ROWS, row_of_s)
    row_in = offs_m < seqlen_q
    lse_log2 = gl.load(Lse + batch.to(gl.int64) * stride_lse_b + head.to(gl.int64) * stride_lse_h + offs_m,
                       mask=row_in, other=0.0) * 1.4426950408889634
    delta = gl.load(Delta + batch.to(gl.int64) * stride_delta_b + head.to(gl.int64) * stride_delta_h + offs_m,
                    mask=row_in, other=0.0)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, dq_layout)
    # [ROWS, BLOCK_N] the previous block's dS as the dQ wgmma's A operand (zeros before block 0: that first product
    # adds nothing, and saves a branch around a wgmma)
    ds_previous = gl.convert_layout(zero_s.to(dtype), ds_operand)
    q = q_tile.reshape([ROWS, HEAD_DIM])
    do = do_tile.reshape([ROWS, HEAD_DIM])
    mbarrier.wait(qdo_ready, 0)
    for j in range(n_blocks):
        stage = j % STAGES
        previous = (j + STAGES - 1) % STAGES
        mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(stage), (j // STAGES) & 1)
        # [BLOCK_N, HEAD_DIM] K_j, V_j
        k_block = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
        v_block = v_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
        s = warpgroup_mma(q, k_block.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp = warpgroup_mma(do, v_block.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        # block j - 1's dQ product (block 0: K_0 times zeros) runs while block j's P and dS are computed
        k_previous = gl.where(j > 0, previous, stage)
        dq = warpgroup_mma(ds_previous, k_smem.index(k_previous).reshape([BLOCK_N, HEAD_DIM]), dq, is_async=True)
        s = warpgroup_mma_wait(2, deps=(s, ))
        # [ROWS, BLOCK_N] P, dS
        p = _masked_probabilities(s, lse_log2, qk_scale_log2, j * BLOCK_N, row0, seqlen_q, seqlen_k, causal)
        dp = warpgroup_mma_wait(1, deps=(dp, ))
        mbarrier.arrive(v_empty.index(stage))
        ds_previous = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(dtype), ds_operand)
        dq = warpgroup_mma_wait(0, deps=(dq, ))
        mbarrier.arrive(k_empty.index(previous), pred=j > 0)
    # the last block's dQ product
    last = (n_blocks - 1) % STAGES
    dq = warpgroup_mma(ds_previous, k_smem.index(last).reshape([BLOCK_N, HEAD_DIM]), dq, is_async=True)
    dq = warpgroup_mma_wait(0, deps=(dq, ))
    # every wgmma that read q_tile completed: it stages dQ for the TMA store
    q_tile.reshape([ROWS, HEAD_DIM]).store((dq * softmax_scale).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [batch, row0, head, 0], q_tile)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["stride_lse_b", "stride_lse_h", "stride_delta_b", "stride_delta_h", "seqlen_q",
                              "seqlen_k"])
def attn_bwd_hopper_dq_kernel(q_desc, do_desc, k_desc, v_desc, dq_desc, Lse, Delta, stride_lse_b, stride_lse_h,
                              stride_delta_b, stride_delta_h, num_heads, group_size, seqlen_q, seqlen_k,
                              softmax_scale, qk_scale_log2, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """One program per (128-row query tile, batch * head), grid num_tiles * batch * heads (_tile_of_program).
    q_desc, do_desc, dq_desc move [1, ROWS, 1, HEAD_DIM] tiles, k_desc, v_desc [1, BLOCK_N, 1, HEAD_DIM]; lse and
    delta (fp32, rows contiguous) are read with their (batch, head) strides. num_warps (4) is the first consumer's;
    the second consumer (4 warps, CONSUMER_REGS registers) and the producer (1 warp) are worker partitions."""
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    # constexprs arrive in partitions as plain ints (Triton 3.6): the flag travels as a tensor
    causal = gl.to_tensor(CAUSAL).to(gl.int32)
    batch, head, head_k, m_start, n_blocks = _tile_of_program(num_heads, group_size, seqlen_q, seqlen_k, causal,
                                                              2 * ROWS, BLOCK_N)
    # [2, 1, ROWS, 1, HEAD_DIM] the consumers' Q (then dQ) and dO rows; [STAGES, 1, BLOCK_N, 1, HEAD_DIM] K, V
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, ROWS, 1, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, 1, ROWS, 1, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    qdo_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(qdo_ready, count=1)
    for stage in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(stage), count=1)
        mbarrier.init(v_ready.index(stage), count=1)
        mbarrier.init(k_empty.index(stage), count=2)
        mbarrier.init(v_empty.index(stage), count=2)
    stages = (k_smem, v_smem, qdo_ready, k_ready, v_ready, k_empty, v_empty, dq_desc, Lse, Delta, stride_lse_b,
              stride_lse_h, stride_delta_b, stride_delta_h, batch, head)
    loop = (n_blocks, seqlen_q, seqlen_k, softmax_scale, qk_scale_log2, causal)
    gl.warp_specialize([
        (_consumer, (q_smem.index(0), do_smem.index(0)) + stages + (m_start, ) + loop),
        (_consumer, (q_smem.index(1), do_smem.index(1)) + stages + (m_start + ROWS, ) + loop),
        (_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qdo_ready, k_ready, v_ready,
                     k_empty, v_empty, batch, head, head_k, m_start, n_blocks)),
    ], [4, 1], [CONSUMER_REGS, 24])

"""Probe (docs/perf-notes.md, sixth session): a Hopper attention forward in Gluon WITHOUT warp specialization,
with and without in-warpgroup overlap (Q.K^T of key block j+1 issued before the softmax of block j), timed in one
process against flashtriton and SDPA (flash, cuDNN). Dense (B, S, H, D) bf16, S a multiple of the tiles, no
masking beyond causal. The measured answer: the overlap gives nothing here (the per-iteration CTA barrier keeps
both warpgroups in lock step); the library's Hopper forward is warp-specialized instead (kernels/fwd_hopper.py).

    python benchmarks/probe_gluon_overlap.py                       # needs an sm_90 GPU
    FLASHTRITON_GLUON=0 python benchmarks/probe_gluon_overlap.py   # the flashtriton column on the Triton kernel,
                                                                   # as in the notes' table
"""

import json

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_init, warpgroup_mma_wait

import flashtriton
from flashtriton.bench import BASELINE_SHAPES
from flashtriton.ops.hopper_fwd import tile_descriptor


@gluon.jit
def _online_softmax(s, m_i, l_i, qk_scale_log2, s_layout: gl.constexpr):
    """p [BLOCK_M, BLOCK_N] (fp32), new max, new row sum, alpha [BLOCK_M] of one key block's raw scores s."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale_log2)
    p = gl.exp2(s * qk_scale_log2 - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _causal_mask(s, n_block, m_start, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """s with keys after each row's own position set to -inf (blocks that reach past the tile's first row)."""
    if (n_block + 1) * BLOCK_N - 1 > m_start:
        offs_m = m_start + gl.arange(0, BLOCK_M, gl.SliceLayout(1, s_layout))
        offs_n = n_block * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
        s = gl.where(gl.expand_dims(offs_n, 0) <= gl.expand_dims(offs_m, 1), s, float("-inf"))
    return s


@gluon.jit
def gluon_attn_fwd(q_desc, k_desc, v_desc, o_desc, Lse, seqlen, num_heads, qk_scale_log2,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                   STAGES: gl.constexpr, OVERLAP: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    num_m = gl.num_programs(0)
    m_block = num_m - 1 - gl.program_id(0)
    batch_head = gl.program_id(1)
    batch = batch_head // num_heads
    head = batch_head % num_heads
    m_start = m_block * BLOCK_M

    q_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_M, 1, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    if CAUSAL:
        n_blocks = gl.cdiv(gl.minimum(m_start + BLOCK_M, seqlen), BLOCK_N)
    else:
        n_blocks = seqlen // BLOCK_N
    kv_bytes: gl.constexpr = BLOCK_N * HEAD_DIM * 2

    mbarrier.expect(q_bar, BLOCK_M * HEAD_DIM * 2)
    tma.async_copy_global_to_shared(q_desc, [batch, m_start, head, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        mbarrier.expect(k_bars.index(i), kv_bytes, pred=i < n_blocks)
        tma.async_copy_global_to_shared(k_desc, [batch, i * BLOCK_N, head, 0], k_bars.index(i), k_smem.index(i),
                                        pred=i < n_blocks)
    mbarrier.expect(v_bars.index(0), kv_bytes)
    tma.async_copy_global_to_shared(v_desc, [batch, 0, head, 0], v_bars.index(0), v_smem.index(0))

    q = q_smem.reshape([BLOCK_M, HEAD_DIM])
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s, use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))

    acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    for j in range(0, n_blocks - 1):
        # issue S_{j+1} = Q K_{j+1}^T; it runs while this block's softmax does
        k_next = (j + 1) % STAGES
        mbarrier.wait(k_bars.index(k_next), ((j + 1) // STAGES) & 1)
        s_next = warpgroup_mma(q, k_smem.index(k_next).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                               use_acc=False, is_async=True)
        if not OVERLAP:
            s_next = warpgroup_mma_wait(0, deps=(s_next, ))
        if CAUSAL:
            s = _causal_mask(s, j, m_start, BLOCK_M, BLOCK_N, s_layout)
        p, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, qk_scale_log2, s_layout)
        # P_{j-1} V_{j-1} done (S_{j+1} may still run); then every warp has released K_j and V_{j-1}
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        gl.thread_barrier()
        refill_k = j + STAGES < n_blocks
        k_free = j % STAGES
        mbarrier.expect(k_bars.index(k_free), kv_bytes, pred=refill_k)
        tma.async_copy_global_to_shared(k_desc, [batch, (j + STAGES) * BLOCK_N, head, 0], k_bars.index(k_free),
                                        k_smem.index(k_free), pred=refill_k)
        v_free = (j + 1) % STAGES
        mbarrier.expect(v_bars.index(v_free), kv_bytes)
        tma.async_copy_global_to_shared(v_desc, [batch, (j + 1) * BLOCK_N, head, 0], v_bars.index(v_free),
                                        v_smem.index(v_free))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        v_stage = j % STAGES
        mbarrier.wait(v_bars.index(v_stage), (j // STAGES) & 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout),
                            v_smem.index(v_stage).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_next, ))
    # last key block (the diagonal one under a causal mask)
    j = n_blocks - 1
    if CAUSAL:
        s = _causal_mask(s, j, m_start, BLOCK_M, BLOCK_N, s_layout)
    p, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, qk_scale_log2, s_layout)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    v_stage = j % STAGES
    mbarrier.wait(v_bars.index(v_stage), (j // STAGES) & 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(v_stage).reshape([BLOCK_N, HEAD_DIM]),
                        acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))
    out = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    rows = m_start + gl.arange(0, BLOCK_M, row_s)
    gl.store(Lse + batch_head.to(gl.int64) * seqlen + rows, lse)
    q_smem.reshape([BLOCK_M, HEAD_DIM]).store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [batch, m_start, head, 0], q_smem)
    tma.store_wait(0)


def gluon_attention(q, k, v, causal, block_m=128, block_n=128, stages=2, num_warps=8, overlap=True):
    batch, seqlen, heads, dim = q.shape
    assert seqlen % block_m == 0 and seqlen % block_n == 0
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seqlen, device=q.device, dtype=torch.float32)
    scale_log2 = dim ** -0.5 * 1.4426950408889634
    grid = (seqlen // block_m, batch * heads)
    gluon_attn_fwd[grid](tile_descriptor(q, block_m), tile_descriptor(k, block_n), tile_descriptor(v, block_n),
                         tile_descriptor(out, block_m), lse, seqlen, heads, scale_log2, block_m, block_n, dim, causal,
                         stages, overlap, num_warps=num_warps)
    return out, lse


# (BLOCK_M, BLOCK_N, stages, warps) per head dim: 8 warps = two warpgroups in one partition; 4 warps with 64-row
# tiles leave room for two programs per SM
CONFIGS = {64: [(128, 64, 3, 8), (64, 128, 2, 4), (64, 64, 3, 4)],
           128: [(128, 128, 2, 8), (64, 64, 2, 4), (64, 64, 3, 4), (64, 128, 2, 4)],
           256: [(128, 64, 2, 8), (64, 64, 2, 4), (64, 32, 3, 4)]}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def sdpa(q, k, v, causal, backend):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=causal).transpose(1, 2)


def main():
    """One JSON line per (shape, causal): TF/s of flashtriton, SDPA flash / cuDNN and every probe variant, and each
    variant's max error against an fp32 reference (out / LSE against flashtriton's)."""
    torch.manual_seed(0)
    for batch, seqlen, heads, dim in BASELINE_SHAPES:
        for causal in (False, True):
            q, k, v = (torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * batch * heads * seqlen * seqlen * dim / (2 if causal else 1)
            ref = sdpa(q.float(), k.float(), v.float(), causal, SDPBackend.EFFICIENT_ATTENTION)
            row = {"shape": [batch, seqlen, heads, dim], "causal": causal}
            with torch.no_grad():
                _, ref_lse, _ = flashtriton.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
                row["flashtriton"] = flops / bench(lambda: flashtriton.flash_attn_func(q, k, v, causal=causal)) / 1e9
                for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                                      ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
                    row[name] = flops / bench(lambda: sdpa(q, k, v, causal, backend)) / 1e9
                for block_m, block_n, stages, warps in CONFIGS[dim]:
                    for overlap in (True, False):
                        name = f"gluon {block_m}x{block_n} w{warps} s{stages}{'' if overlap else ' no-overlap'}"
                        run = lambda: gluon_attention(q, k, v, causal, block_m, block_n, stages, warps, overlap)
                        out, lse = run()
                        errors = float((out - ref).abs().max()), float((lse - ref_lse).abs().max())
                        row[name] = {"tflops": flops / bench(run) / 1e9, "max_err": errors}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

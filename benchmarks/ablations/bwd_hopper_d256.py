"""Suspects of the d256 Gluon backward (kernels/bwd_hopper_d256.py), for benchmarks/ablate_kernel.py:

    python benchmarks/ablate_kernel.py --variants benchmarks/ablations/bwd_hopper_d256.py --shapes 4

Each variant removes one suspect (its gradients are wrong; the timing says what the suspect costs). Written in the
tenth session after the kernel's first GPU run (284 / 240 TF/s at 4x4096x8x256); not run yet.
"""

MODULE = "flashtriton/kernels/bwd_hopper_d256.py"
TARGET = "flashtriton.ops.hopper_bwd:attn_bwd_hopper_d256_kernel"
KERNEL = "attn_bwd_hopper_d256_kernel"

_REDUCTION = "_async_reduce_add(dq_desc, [batch, m_start + rj * DQ_ROWS, head, feature0 + fj * DQ_FEAT], dq_tile)"
_STAGING = "                tma.store_wait(0)\n                dq_stage.store(dqt * softmax_scale)\n"

VARIANTS = {
    # the four TMA reductions per consumer and iteration (the tile is still written)
    "no dQ reductions": [(_REDUCTION, "pass")],
    # the reductions and the staging of each piece in shared memory (each waits for the previous reduction); the
    # dQ products are then dead code, which the compiler may drop too: read it as "no dQ at all"
    "no dQ staging": [(_REDUCTION, "pass"), (_STAGING, "")],
    # the consumers' in-phase wait for the other half of P and dS (reads a half-written tile)
    "no pds_ready wait": [("        mbarrier.wait(pds_ready, i & 1)\n", "")],
}

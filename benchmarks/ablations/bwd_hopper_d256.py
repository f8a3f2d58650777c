"""Suspects of the d256 Gluon backward (kernels/bwd_hopper_d256.py), for benchmarks/ablate_kernel.py:

    python benchmarks/ablate_kernel.py --variants benchmarks/ablations/bwd_hopper_d256.py --shapes 4

Each variant removes one suspect (its gradients are wrong; the timing says what the suspect costs). First run
(H200, eleventh session, 4x4096x8x256 backward TF/s non-causal / causal): as is 285 / 251; no dQ reductions 437 /
357; no dQ staging either (the kernel without dQ) 595 / 531; no pds_ready wait 341 / 301; the dQ pieces
software-pipelined (piece k + 1's wgmma during piece k's staging, a change with equal gradients) 281 / 248. So dQ
is the cost. Second run: no wait for the reduction's read 285 (as is 284, no dQ reductions 440): the reductions
themselves cost, not their serialization; the kernel without dQ followed by the Triton dQ kernel is now the
default at head dim 256 (configs.HopperBwdConfig.dq_kernel; 351 / 328). The ablation runs on the kernel with dQ
(SETUP).
"""

import dataclasses

MODULE = "flashtriton/kernels/bwd_hopper_d256.py"
TARGET = "flashtriton.ops.hopper_bwd:attn_bwd_hopper_d256_kernel"
KERNEL = "attn_bwd_hopper_d256_kernel"

_REDUCTION = "_async_reduce_add(dq_desc, [batch, m_start + rj * DQ_ROWS, head, feature0 + fj * DQ_FEAT], dq_tile)"
_READ_WAIT = "            tma.store_wait(0)\n            dq_stage.store(dqt * softmax_scale)\n"

VARIANTS = {
    # the four TMA reductions per consumer and iteration (the tile is still written)
    "no dQ reductions": [(_REDUCTION, "pass")],
    # the wait before each piece's staging for the previous reduction to have read the tile (a race: the timing
    # says what the serialization of the pieces costs, against "no dQ reductions")
    "no wait for the reduction's read": [(_READ_WAIT, "            dq_stage.store(dqt * softmax_scale)\n")],
    # the consumers' in-phase wait for the other half of P and dS (reads a half-written tile)
    "no pds_ready wait": [("        mbarrier.wait(pds_ready, i & 1)\n", "")],
}


def SETUP(configs):  # noqa: N802 (the name ablate_kernel.py looks for)
    """The kernel with its dQ reductions: the path these variants edit."""
    configs.HOPPER_BWD[256] = dataclasses.replace(configs.HOPPER_BWD[256], dq_kernel=False)

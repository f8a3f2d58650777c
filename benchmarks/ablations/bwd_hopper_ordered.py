"""What the ordered dQ of deterministic=True costs where (kernels/bwd_hopper.py, ORDERED), for
benchmarks/ablate_kernel.py:

    python benchmarks/ablate_kernel.py --variants benchmarks/ablations/bwd_hopper_ordered.py --shapes 0,1,2 \\
        --timing kernels
    python benchmarks/ablate_kernel.py --variants benchmarks/ablations/bwd_hopper_ordered.py --offline

Twelfth session (H200, kernel time, same process, default / ordered TF/s): 16x1024 431 / 387, causal 314 / 257;
4x4096 537 / 493, 496 / 398; 1x16384 542 / 497, 548 / 456: the causal rows pay 17-20% (issue #7's budget is
15%), the others 8-10%. Offline the ordered causal consumers spill more (stack 200 bytes against 144 unordered).
Each variant below changes one suspect (results stay correct sums; only their order may vary):
- "no spin": a reduction never waits for its turn (the price of the waits themselves);
- "causal: longest key block first": the default launch order (key block 0, seen by the most rows, first)
  instead of the later key blocks first (a contributor's predecessor is a later key block, so with the longest
  first the waits follow the later blocks' start);
- "relaxed release": the releaser's counter update without the GPU-scope fence (the fence now runs in the
  releaser warp; this says whether it still costs the consumers anything).
Thirteenth session (--shapes 0,1, kernel time, as is / variant): no spin 387 / 398, 261 / 280, 495 / 492, 397 /
433: the waits are about 8% of the causal rows and nothing without the mask; longest key block first 386, 257,
488, 398 (no better); the old arrivals 389, 259, 495, 400 (level).
"""

MODULE = "flashtriton/kernels/bwd_hopper.py"
TARGET = "flashtriton.ops.hopper_bwd:attn_bwd_hopper_kernel"
KERNEL = "attn_bwd_hopper_kernel"
CALL = dict(deterministic=True)
OFFLINE = dict(kind="bwd-hopper", head_dim=128, ordered=True)

VARIANTS = {
    # as in ablations/bwd_hopper.py: the arrivals of the kernel before the thirteenth session
    "arrivals after BAR.SYNC": [("arrive_after_wgmma(", "mbarrier.arrive(")],
    "no spin": [("""    while seen != rank:
        seen = gl.load(counter, volatile=True)
""", "")],
    "causal: longest key block first": [(
        "num_heads_k, group_size, seqlen_q, seqlen_k, heads_per_group, KEYS, ROWS, CAUSAL, ORDERED)",
        "num_heads_k, group_size, seqlen_q, seqlen_k, heads_per_group, KEYS, ROWS, CAUSAL, ORDERED and not CAUSAL)")],
    "relaxed release": [('gl.atomic_add(counter, 1, sem="release", scope="gpu")',
                         'gl.atomic_add(counter, 1, sem="relaxed", scope="gpu")')],
}

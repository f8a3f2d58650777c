"""A / B of the d64 / d128 Gluon backward (kernels/bwd_hopper.py) against its previous epilogue and mask, for
benchmarks/ablate_kernel.py:

    python benchmarks/ablate_kernel.py --variants benchmarks/ablations/bwd_hopper.py --shapes 0,1,3

Eleventh session: ncu on the 16x1024 causal backward counted 50% excessive global sectors (the dK / dV stores
straight from the wgmma layout) and the offline SASS showed 41 / 29 spilled loads in the causal consumers' loops
(key vectors held across the loop for the mask). "as is" stores dK / dV in 16-byte pieces through a layout
conversion and masks with one comparison per element against each row's last key; each variant restores one of the
previous versions (same gradients).
Thirteenth session: "arrivals after BAR.SYNC" (the old ds_free / q_empty arrivals) level within ±3% (kernel time,
--shapes 0,1,3: 432 / 431, 315 / 316, 521 / 536, 494 / 488, 386 / 385, 363 / 367 old / new).
"""

MODULE = "flashtriton/kernels/bwd_hopper.py"
TARGET = "flashtriton.ops.hopper_bwd:attn_bwd_hopper_kernel"
KERNEL = "attn_bwd_hopper_kernel"
OFFLINE = dict(kind="bwd-hopper", head_dim=128)

_STORE_EDITS = [
    ("gl.store(dk_ptrs, gl.convert_layout((dk * softmax_scale).to(dtype), layout), mask=store_mask)",
     "gl.store(dk_ptrs, (dk * softmax_scale).to(dtype), mask=store_mask)"),
    ("gl.store(dv_ptrs, gl.convert_layout(dv.to(dtype), layout), mask=store_mask)",
     "gl.store(dv_ptrs, dv.to(dtype), mask=store_mask)"),
    ("rows = first_row + gl.arange(0, KEY_ROWS, gl.SliceLayout(1, layout))",
     "rows = first_row + gl.arange(0, KEY_ROWS, gl.SliceLayout(1, dk.type.layout))"),
    ("features = feature0 + gl.arange(0, FEATURES, gl.SliceLayout(0, layout))",
     "features = feature0 + gl.arange(0, FEATURES, gl.SliceLayout(0, dk.type.layout))"),
]
_MASK_EDITS = [
    ("""    first_key = n_start + key0
    if len(order) > 0:
        gl.static_assert(OVER_ALL_KEYS, "ordered dQ takes the split by features (head dim 128)")
    mbarrier.wait(kv_ready, 0)
    for i in range(n_iterations):
        stage = i % STAGES
        head, m_start = _query_block(_visit(i, first_visit, n_iterations), blocks_per_head, m_block_lo, head_k,
                                     group_size, ROWS)
""", """    first_key = n_start + key0
    if len(order) > 0:
        gl.static_assert(OVER_ALL_KEYS, "ordered dQ takes the split by features (head dim 128)")
    offs_n = n_start + key0 + gl.arange(0, OWN, gl.SliceLayout(0, s_layout))
    key_in = offs_n < seqlen_k
    last_key = n_start + key0 + OWN - 1
    mbarrier.wait(kv_ready, 0)
    for i in range(n_iterations):
        stage = i % STAGES
        head, m_start = _query_block(_visit(i, first_visit, n_iterations), blocks_per_head, m_block_lo, head_k,
                                     group_size, ROWS)
        offs_m = m_start + gl.arange(0, ROWS, row_of_s)
"""),
    ("""        p = _masked_probabilities(s, lse_log2, qk_scale_log2, first_key, m_start, seqlen_q, seqlen_k, causal)
""", """        p = gl.exp2(s * qk_scale_log2 - gl.expand_dims(lse_log2, 1))
        if (last_key >= seqlen_k) | ((causal != 0) & (last_key > m_start + (seqlen_k - seqlen_q))):
            visible = gl.expand_dims(key_in, 0) & gl.expand_dims(offs_m < seqlen_q, 1)
            if causal != 0:
                visible = visible & (gl.expand_dims(offs_n, 0) <= gl.expand_dims(offs_m + (seqlen_k - seqlen_q), 1))
            p = gl.where(visible, p, 0.0)
"""),
]

# nineteenth session (prepared, compiled offline): the causal mask compared by column residues, as in
# ablations/fwd_hopper.py: key % 8 <= row's last key - key // 8 * 8, so the block's key columns (hoisted out of the
# consumers' loop by LLVM) need not stay in registers across it. Offline at d128 causal: 42 / 18 local-memory
# accesses in the two consumers' loops -> 24 / 15 (non-causal: 21 / 6), stack 144 -> 112 bytes, loops 713 / 685 ->
# 671 / 624 instructions; d64 causal has no spills either way (loop 459 -> 485). Twentieth session (kernel time, --rounds
# 2, as is / variant): 16x1024 causal 313.6 / 319.3, 4x4096 causal 495.2 / 484.2 (+-2%), d64 causal 364.2 / 364.3:
# not taken.
_MASK_BY_COLUMN_RESIDUE = [
    ("""        visible = (gl.expand_dims(gl.arange(0, KEYS, gl.SliceLayout(0, s.type.layout)), 0)
                   <= gl.expand_dims(row_last, 1))""", """        keys = gl.arange(0, KEYS, gl.SliceLayout(0, s.type.layout))
        visible = gl.expand_dims(keys % 8, 0) <= gl.expand_dims(row_last, 1) - gl.expand_dims(keys // 8 * 8, 0)""")]

VARIANTS = {
    # the consumers' ds_free / q_empty arrivals as mbarrier.arrive, each after a warpgroup BAR.SYNC (the kernel
    # before the thirteenth session; kernels/hopper_sync.arrive_after_wgmma); same results bit for bit
    "arrivals after BAR.SYNC": [("arrive_after_wgmma(", "mbarrier.arrive(")],
    "stores from the wgmma layout": _STORE_EDITS,
    "key vectors held across the loop": _MASK_EDITS,
    "both (the previous kernel)": _STORE_EDITS + _MASK_EDITS,
    "causal mask by column residues": _MASK_BY_COLUMN_RESIDUE,
}

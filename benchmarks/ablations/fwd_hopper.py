"""Suspects of the Gluon Hopper forward's per-tile cost (kernels/fwd_hopper.py), for benchmarks/ablate_kernel.py:

    python benchmarks/ablate_kernel.py --variants benchmarks/ablations/fwd_hopper.py --mode fwd --shapes 0,1

At 16x1024 (8 key blocks per 128-row tile) the forward reads 0.93x cuDNN, at 1x16384 (128 blocks) 1.01x: what a
tile costs besides its key blocks is the suspect. Each variant removes one piece of the tile's epilogue (its output
is wrong; the timing says what the piece costs), or switches the consumers' ping-pong off (configs.HopperFwdConfig).
"one release per key block" (prepared in the twelfth session, compiled offline only) prices the consumers'
per-block barriers (ncu: 41% of the forward's stall cycles at barriers). First run (eleventh session, H200, 16x1024x16x128 forward TF/s non-causal / causal; ping-pong then off by default):
as is 538 / 412, no LSE store 569 / 352, no O store 564 / 435, no stores 569 / 324, ping-pong on 547 / 428 (the
causal rows are host-bound at this size: ~160 us of GPU time per call).
Thirteenth session (kernel time, --shapes 0,1,2,3,4, docs/perf-notes.md): "arrivals after BAR.SYNC" (the old
arrivals) 0-4% slower at d128, level at d64 / d256; "one release per key block" -15 to -25%; "no output rescale" +1
to +6%; "rescale skip (max lagging)" -2 to -7%; "ping-pong on" at d64 / d256 -2 to -4%.
"""

MODULE = "flashtriton/kernels/fwd_hopper.py"
TARGET = "flashtriton.ops.hopper_fwd:attn_fwd_hopper_kernel"
KERNEL = "attn_fwd_hopper_kernel"
OFFLINE = dict(kind="fwd-hopper", head_dim=128)

_LSE_STORE = "gl.store(Lse + lse_row_base + offs_m, lse, mask=offs_m < seqlen_q)"
_O_STORE = "tma.async_copy_shared_to_global(o_desc, [batch, row0, head, 0], o_tile)"
_PINGPONG = "    if PINGPONG:\n        # one allocation each"

_EXP2_ON_FMA = """@gluon.jit
def _exp2_on_fma(x):
    # 2^x for x <= 0 on the FMA and integer pipes (no MUFU, no conversions): x = j + f with j = round(x) (adding
    # 1.5 * 2^23 leaves j in the low mantissa bits) and f in [-0.5, 0.5], 2^f by a degree-3 polynomial (relative
    # error 2.1e-4), j shifted into the exponent bits; below 2^-126 (and -inf: masked keys, rows without keys) 0
    clamped = gl.maximum(x, -126.0)
    shifted = clamped + 12582912.0
    frac = clamped - (shifted - 12582912.0)
    poly = ((0.05484627802025906 * frac + 0.24180230420460921) * frac + 0.6932480584853659) * frac + 0.9999888786075574
    bits = poly.to(gl.int32, bitcast=True) + (shifted.to(gl.int32, bitcast=True) << 23)
    return gl.where(x < -126.0, 0.0, bits.to(gl.float32, bitcast=True))


@gluon.jit
def _exp2_half_on_fma(x):
    # x [ROWS, N]: the even columns by MUFU (gl.exp2), the odd ones on the FMA pipe (each thread holds column pairs)
    ROWS: gl.constexpr = x.shape[0]
    N: gl.constexpr = x.shape[1]
    even, odd = gl.split(x.reshape([ROWS, N // 2, 2]))
    # the same registers as x's layout (a linear layout equal to it): the conversion moves nothing
    return gl.convert_layout(gl.join(gl.exp2(even), _exp2_on_fma(odd)).reshape([ROWS, N]), x.type.layout)


@gluon.jit
def _exp2_quarter_on_fma(x):
    # x [ROWS, N]: three columns in four by MUFU, one on the FMA pipe (the odd columns split once more by pairs)
    ROWS: gl.constexpr = x.shape[0]
    N: gl.constexpr = x.shape[1]
    even, odd = gl.split(x.reshape([ROWS, N // 2, 2]))
    # odd's columns: bits 0-1 across lanes, bit 2 in registers: split by bit 2 (moved last)
    odd_lo, odd_hi = gl.split(gl.permute(odd.reshape([ROWS, N // 16, 2, 4]), (0, 1, 3, 2)))
    odd = gl.permute(gl.join(gl.exp2(odd_lo), _exp2_on_fma(odd_hi)), (0, 1, 3, 2)).reshape([ROWS, N // 2])
    # both halves in one layout object again (they hold the same registers), then x's
    odd = gl.convert_layout(odd, even.type.layout)
    return gl.convert_layout(gl.join(gl.exp2(even), odd).reshape([ROWS, N]), x.type.layout)


"""

VARIANTS = {
    # the LSE rows' global stores
    "no LSE store": [(_LSE_STORE, "pass")],
    # O's TMA store (the tile is still normalized and written to shared memory)
    "no O store": [(_O_STORE, "pass")],
    # both: the tile's results never leave the program
    "no stores": [(_LSE_STORE, "pass"), (_O_STORE, "pass")],
    # the consumers' ping-pong off whatever configs.HOPPER_FWD says (on at d128)
    "ping-pong off": [(_PINGPONG, "    if False:\n        # one allocation each")],
    # and on whatever it says (off at d64 and d256: 2-5% lower by wall clock in the eleventh session, before the
    # arrivals lost their BAR.SYNC)
    "ping-pong on": [(_PINGPONG, "    if True:\n        # one allocation each")],
    # the consumers' arrivals as mbarrier.arrive, each after a warpgroup BAR.SYNC (the kernel before the thirteenth
    # session: four per key block; kernels/hopper_sync.arrive_after_wgmma); same results bit for bit
    "arrivals after BAR.SYNC": [("arrive_after_wgmma(", "mbarrier.arrive(")],
    # the output's rescale by alpha skipped (wrong results): what an exact rescale skip (max lagging, FA4's
    # threshold) could save at most
    "no output rescale": [("acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)", "acc = acc")],
    # FA4's exact rescale skip: a row's max moves only when a block raises it by more than 8 (log2 units; the
    # probabilities stay below 2^8 against the lagging max, and O, the row sum and the LSE share that base), and
    # the output is rescaled only when some row of the warpgroup moved (a warpgroup-wide min of alpha: a
    # cross-warp reduction through shared memory per block)
    "rescale skip (max lagging)": [
        ("    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale_log2)\n",
         "    m_block = gl.max(s, 1) * qk_scale_log2\n    m_new = gl.where(m_block > m_i + 8.0, m_block, m_i)\n"),
        ("        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)",
         "        if gl.min(alpha, 0) < 1.0:\n            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)")],
    # half of each block's exp2 on the FMA pipe instead of MUFU (FA4's emulation on Blackwell): the odd columns by
    # 2^round(x) * p(x - round(x)), p of degree 3 (relative error 2.1e-4, below bf16's rounding of P); the offline
    # SASS put the softmax's 64 MUFU.EX2 per thread and block at ~52% of the block's tensor-core time per SM
    # (MUFU 66 -> 34, FFMA 66 -> 162, FADD 68 -> 164 per iteration; no shuffles or shared memory added)
    "half the exp2 on FMA": [
        ("    p = gl.exp2(s * qk_scale_log2 - gl.expand_dims(pivot, 1))\n",
         "    p = _exp2_half_on_fma(s * qk_scale_log2 - gl.expand_dims(pivot, 1))\n"),
        ("@gluon.jit\ndef _softmax_block(", _EXP2_ON_FMA + "@gluon.jit\ndef _softmax_block(")],
    # one release per key block: K's stage is handed back with V's (after P V), not after S, so each consumer
    # iteration has one mbarrier arrival fewer, and the producer loads K of
    # load l only once V of load l - STAGES is released (correct results; prefetch one wgmma later)
    # the same with one column in four on the FMA pipe (MUFU does three quarters)
    "a quarter of the exp2 on FMA": [
        ("    p = gl.exp2(s * qk_scale_log2 - gl.expand_dims(pivot, 1))\n",
         "    p = _exp2_quarter_on_fma(s * qk_scale_log2 - gl.expand_dims(pivot, 1))\n"),
        ("@gluon.jit\ndef _softmax_block(", _EXP2_ON_FMA + "@gluon.jit\ndef _softmax_block(")],
    "one release per key block": [("arrive_after_wgmma(k_empty.index(stage))", "pass"),
                                  ("mbarrier.wait(k_empty.index(stage), previous_use_phase, pred=load >= STAGES)",
                                   "mbarrier.wait(v_empty.index(stage), previous_use_phase, pred=load >= STAGES)")],
}

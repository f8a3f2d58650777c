"""Suspects of the Gluon Hopper forward's per-tile cost (kernels/fwd_hopper.py), for benchmarks/ablate_kernel.py:

    python benchmarks/ablate_kernel.py --variants benchmarks/ablations/fwd_hopper.py --mode fwd --shapes 0,1

At 16x1024 (8 key blocks per 128-row tile) the forward reads 0.93x cuDNN, at 1x16384 (128 blocks) 1.01x: what a
tile costs besides its key blocks is the suspect. Each variant removes one piece of the tile's epilogue (its output
is wrong; the timing says what the piece costs), or switches the consumers' ping-pong off (configs.HopperFwdConfig).
"one release per key block" (prepared in the twelfth session, compiled offline only) prices the consumers'
per-block barriers (ncu: 41% of the forward's stall cycles at barriers). First run (eleventh session, H200,
16x1024x16x128 forward TF/s non-causal / causal; ping-pong then off by default):
as is 538 / 412, no LSE store 569 / 352, no O store 564 / 435, no stores 569 / 324, ping-pong on 547 / 428 (the
causal rows are host-bound at this size: ~160 us of GPU time per call).
Thirteenth session (kernel time, --shapes 0,1,2,3,4, docs/perf-notes.md): "arrivals after BAR.SYNC" (the old
arrivals) 0-4% slower at d128, level at d64 / d256; "one release per key block" -15 to -25%; "no output rescale" +1
to +6%; "rescale skip (max lagging)" -2 to -7%; "ping-pong on" at d64 / d256 -2 to -4%.
Fourteenth session: "P V waited before the softmax" (the kernel before `a536212`) 3-9% slower at d128 4x4096 /
1x16384, level at 16x1024 and d256, 1.5-3.5% faster at d64 only where the fence is on ("schedule fence"); "no
schedule fence" at d128 level to -3%; "no opaque P copy" and "ping-pong off" at d128 within noise (docs/perf-notes.md).
Fifteenth session: the never-executed fence and the in-order loops slower everywhere; the A-1 rescale skip decided
per warp by a vote kept at d128 (kernels/fwd_hopper._rescale; "no rescale skip" / "rescale skip everywhere" price
it); "three consumers at d64" prepared (compiled offline), not yet run.
Sixteenth session (two processes, kernel time, TF/s as is / variant): three consumers at d64 (192-row tiles) 468, 440
/ 514, 511 non-causal and 435, 430 / 429, 429 causal; the skip with the fence at d256 710, 707 / 757, 754 and 677,
675 / 699, 697 (with ping-pong instead 689, 689 and 683, 683; the skip alone 708, 705 and 696, 696); the skip with
the fence at d64 450, 447 and 415, 414. Both winners are now the table (configs.HOPPER_FWD: consumers=3 at d64, the
skip and the fence at d256); "two consumers at d64" and "d256 without skip and fence" price them against the kernel.
A second call (two processes; the "as is" reading at d64 came out 475, 487 against 514-520 for variants that leave
d64 as it is, a first-slot artifact seen before at d64): d64 non-causal two consumers 471, 460; causal two consumers
440, 438 against three 430-433 (and 429 in the first call), so the table keeps two for causal d64 ("three consumers
at d64 causal" prices it); with three consumers the fence is level non-causal (513, 510) and -4% causal (416, 415),
the skip -2 to +1% (and -5% at 1x16384 in one round: a d128 row it does not touch, so noise).
Seventeenth session: whole-module comparisons (ablate_kernel.py --sources) of a streamed consumer (ef78638, ad3b8b8:
-3 to -6% at d128 / d64) and of two Q buffers (4d1ae1c: level); the reciprocal epilogue +0.5 to +1.3% at d128
(docs/perf-notes.md). Prepared for the next run (compiled offline only): "one program per tile at d128", "64-key
blocks in 4 stages at d128", "5 KB of unexecuted code in the key-block loop", "no mask code in the key-block loop",
"full blocks in a loop without mask code".
Eighteenth session (kernel time; --rounds 3 with the module itself again as an A/A pair, which read within 0.5%):
the loop without mask code +1.3% at 16x1024 and +4.8% at d64 non-causal (level at 4x4096); the split loops -0.2 to
-2.5%; 5 KB of unexecuted code in the loop -2 to -4% at d64 / 1x16384 (one round). The kernel now visits key blocks
last first, so non-causal loops need no mask code ("mask code in the non-causal loop" prices that). Prepared for
the next run (compiled offline only): "non-causal mask without the row condition".
Nineteenth session (kernel time, --rounds 3): "non-causal mask without the row condition" level on every row
(602.9 / 602.2 at 16x1024, 537.8 / 540.6 at d64: 144-200 instructions less code outside the loop buy nothing);
"mask code in the non-causal loop" -0.9% at 16x1024, -4.3% at d64 again. A kernel without a seam between tiles (f7cdc32,
by --sources: the next tile's first S with this one's last P V) 2-10% slower; "Q tiles double-buffered" (again,
after session 17's level reading) +1.7% / +2.1% at 16x1024 in one call, level / +2.3% in the next, long d128 rows
-3.8% to +0.7%, d64 non-causal -5.2%: not kept (docs/perf-notes.md). A second warpgroup barrier per key block:
0-1.3% slower. Prepared for the next run (compiled offline): "causal mask by column residues" (no column registers
held across the loop), FA4's d64 causal shape with and without it ("three consumers at d64 causal per tile ...") and
"one program per tile at d64 causal".
Twentieth session (kernel time, --rounds 3, as is / variant): the causal mask by column residues +4.3% at d256
causal (685.1 / 714.7), +1.1% at 16x1024 causal, +0.2% / +1.8% at 4x4096 / 1x16384 causal, -3.9% at d64 causal (442.3
/ 425.2): in the table at d128 and d256 (configs.HopperFwdConfig.mask_by_residues; "causal mask by plain columns"
prices it). FA4's d64 causal shape 415.0-415.3, one program per tile at d64 causal 409.0: slower. The row max as a
tree (kernels/fwd_hopper._row_max) +0.8% at 16x1024, -5% / -6% at d64: at d128 non-causal only ("row max in one chain",
"row max as a tree everywhere"); the producer's first K ahead of Q +0.9% / +2.9% at 16x1024 ("Q before the first K"
restores the old order); Q tiles double-buffered on top of it -3.7% to +2.7% (noise at d128, -3.7% d64 non-causal).
Twenty-first session: "Q tiles double-buffered" retired (four readings since session 17, none kept; its edits are in
git history before the tail split, which rewrote the tile loops they patched).
Twenty-fourth session: the chain +1.1% / +2.2% / +2.6% at d128 non-causal, so no entry keeps the tree ("row max as a
tree at d128" replaces "row max in one chain"); three consumers at d64 causal by column residues -1.3%, the epilogue's
row work under the last P V -0.8% to +2% (+-2%): neither taken.
"""

MODULE = "flashtriton/kernels/fwd_hopper.py"
TARGET = "flashtriton.ops.hopper_fwd:attn_fwd_hopper_kernel"
KERNEL = "attn_fwd_hopper_kernel"
OFFLINE = dict(kind="fwd-hopper", head_dim=128)

_LSE_STORE = "gl.store(Lse + lse_row_base + offs_m, lse, mask=offs_m < seqlen_q)"
_O_STORE = "tma.async_copy_shared_to_global(o_desc, [batch, row0, head, 0], o_tile)"
_PINGPONG = "    if PINGPONG:\n        # one allocation each"
_HOLD = "    if HOLD_SCHEDULE:\n        fences = (0, )"

_NEVER_EXECUTED_FENCE = [
    ("def _hold_schedule(fences):", "def _hold_schedule(fences, row_sum):"),
    ('gl.inline_asm_elementwise("fence.acq_rel.cta;\\n\\tmov.u32 $0, 0;", "=r", [], dtype=gl.int32',
     'gl.inline_asm_elementwise("{ .reg .pred %never; setp.lt.f32 %never, $1, 0f00000000; @%never fence.acq_rel.cta; '
     '}\\n\\tmov.u32 $0, 0;", "=r,r", [row_sum], dtype=gl.int32'),
    ("        _hold_schedule(fences)\n", "        _hold_schedule(fences, l_i)\n")]

# the key-block loop in order: P_{j-1} V_{j-1} completes before S_j is issued (no softmax under P V), which frees the
# registers of one P and lets d256 take 128-key blocks (offline: 144 bytes of stack, against 416 with the overlap)
_ISSUE_S = """        s = warpgroup_mma(q, k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s, """
_ISSUE_PV = "        acc = warpgroup_mma(p, v_smem.index(previous).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)\n"
_IN_ORDER = [
    (_ISSUE_S, _ISSUE_PV + "        acc = warpgroup_mma_wait(0, deps=(acc, ))\n"
     "        arrive_after_wgmma(v_empty.index(previous))\n" + _ISSUE_S),
    ("is_async=True)\n" + _ISSUE_PV, "is_async=True)\n"),
    ("        s = warpgroup_mma_wait(1, deps=(s, ))\n", "        s = warpgroup_mma_wait(0, deps=(s, ))\n"),
    ("        _hold_schedule(fences)\n        acc = warpgroup_mma_wait(0, deps=(acc, ))\n"
     "        arrive_after_wgmma(v_empty.index(previous))\n", "")]



# the program's tile i uses Q slot (i % Q_BUFFERS) * CONSUMERS + consumer, whose barriers count its own uses
def _both(head_dim: int, **fields) -> dict:
    """CONFIGS entries changing configs.HOPPER_FWD's causal and non-causal entry of a head dim alike."""
    return {(head_dim, False): fields, (head_dim, True): fields}


# d256 with cuDNN's 128-key blocks: one K / V stage (192 KB with O staged in Q); the rescale skip's variants; the
# consumer counts at d64
# FA4's d64 causal shape: three consumers (192-row tiles, 160 registers each) on one program per tile
_FA4_D64_CAUSAL = {"HOPPER_FWD": {(64, True): dict(consumers=3, consumer_regs=160, persistent=False)}}

CONFIGS = {"in-order with 128-key blocks at d256": {"HOPPER_FWD": _both(256, block_n=128, stages=1)},
           "no rescale skip": {"HOPPER_FWD": {**_both(128, rescale_threshold=0.0),
                                              **_both(256, rescale_threshold=0.0)}},
           "rescale skip everywhere": {"HOPPER_FWD": _both(64, rescale_threshold=8.0)},
           "two consumers at d64": {"HOPPER_FWD": {(64, False): dict(consumers=2, consumer_regs=232)}},
           "three consumers at d64 causal": {"HOPPER_FWD": {(64, True): dict(consumers=3, consumer_regs=160)}},
           "d256 without skip and fence": {"HOPPER_FWD": _both(256, rescale_threshold=0.0, hold_schedule=False)},
           "schedule fence at d64": {"HOPPER_FWD": _both(64, hold_schedule=True)},
           "rescale skip and fence at d64": {"HOPPER_FWD": _both(64, rescale_threshold=8.0, hold_schedule=True)},
           "one program per tile at d128": {"HOPPER_FWD": _both(128, persistent=False)},
           "64-key blocks in 4 stages at d128": {"HOPPER_FWD": _both(128, block_n=64, stages=4)},
           "three stages at d64": {"HOPPER_FWD": _both(64, stages=3)},
           "persistent grid at d256": {"HOPPER_FWD": _both(256, persistent=True)},
           "three consumers at d64 causal per tile": _FA4_D64_CAUSAL,
           "one program per tile at d64 causal": {"HOPPER_FWD": {(64, True): dict(persistent=False)}},
           "three consumers at d64 causal per tile by column residues": {
               "HOPPER_FWD": {(64, True): dict(consumers=3, consumer_regs=160, persistent=False,
                                               mask_by_residues=True)}},
           "causal mask by plain columns": {"HOPPER_FWD": {(128, True): dict(mask_by_residues=False),
                                                           (256, True): dict(mask_by_residues=False)}},
           "causal mask by column residues at d64": {"HOPPER_FWD": {(64, True): dict(mask_by_residues=True)}},
           "three consumers at d64 causal by column residues": {
               "HOPPER_FWD": {(64, True): dict(consumers=3, consumer_regs=160, mask_by_residues=True)}},
           "row max as a tree at d128": {"HOPPER_FWD": {(128, False): dict(row_max_tree=True)}},
           "tail not split": {"HOPPER_FWD": {key: dict(split_tail=False) for key in ((128, False), (256, False))}},
           "tail split by 4 blocks at least": {"HOPPER_FWD": {key: dict(tail_min_blocks=4) for key in
                                                               ((128, False), (256, False))}},
           "tail split at d128 causal": {"HOPPER_FWD": {(128, True): dict(split_tail=True)}},
           "tail split at d64": {"HOPPER_FWD": {key: dict(split_tail=True) for key in ((64, False), (64, True))}},
           "row max as a tree everywhere": {"HOPPER_FWD": {key: dict(row_max_tree=True) for key in
                                                           ((64, False), (64, True), (128, False), (128, True),
                                                            (256, False), (256, True))}}}

# dead code in the key-block loop: a block of fused multiply-adds on the row sums behind a branch that is never taken
# (a row sum is never negative), so each key block executes two instructions more while the loop's code grows by
# `count` instructions (16 bytes each) per consumer: does the loop's size alone cost time (instruction fetch)?
def _unexecuted_code(count: int) -> list:
    body = "\\n".join(["fma.rn.f32 $0, $0, $0, $0;"] * count)
    asm = ('"{ .reg .pred %neg; mov.b32 $0, $2; mov.b32 $1, $3; setp.lt.f32 %neg, $2, 0f00000000;\\n'
           '@!%neg bra.uni done_${:uid};\\n' + body + '\\ndone_${:uid}: }"')
    return [("        acc = _rescale(acc, gl.convert_layout(alpha, row_o), lag)\n",
             "        acc = _rescale(acc, gl.convert_layout(alpha, row_o), lag)\n"
             f"        l_i = gl.inline_asm_elementwise({asm}, \"=f,=f,f,f\", [l_i], dtype=gl.float32, is_pure=True, "
             "pack=2)\n")]


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
    # arrivals lost their BAR.SYNC), where there are two consumers to take turns (not d64 non-causal's three)
    "ping-pong on": [(_PINGPONG, "    if CONSUMERS == 2:\n        # one allocation each")],
    # the consumers' arrivals as mbarrier.arrive, each after a warpgroup BAR.SYNC (the kernel before the thirteenth
    # session: four per key block; kernels/hopper_sync.arrive_after_wgmma); same results bit for bit
    "arrivals after BAR.SYNC": [("arrive_after_wgmma(", "mbarrier.arrive(")],
    # the output's rescale by alpha skipped (wrong results): what an exact rescale skip (max lagging, FA4's
    # threshold) could save at most
    "no output rescale": [("        acc = _rescale(acc, gl.convert_layout(alpha, row_o), lag)", "        acc = acc")],
    # the A-1 rescale skip with its warp vote (kernels/fwd_hopper._rescale) off where configs.HOPPER_FWD has it (d128,
    # d256), or on everywhere (CONFIGS). Its first form, a warpgroup-wide min of alpha (a reduction through shared
    # memory per block), measured 2-7% slower on every row (thirteenth session)
    "no rescale skip": [],
    "rescale skip everywhere": [],
    # the tables before the sixteenth session at d64 (two consumers) and d256 (no skip, no fence), three consumers
    # for causal d64; the fence, and the fence with the skip, at d64 (CONFIGS)
    "two consumers at d64": [],
    "three consumers at d64 causal": [],
    "d256 without skip and fence": [],
    "schedule fence at d64": [],
    "rescale skip and fence at d64": [],
    # prepared in the seventeenth session for 16x1024 (the row short of cuDNN; compiled offline only): the grid of
    # one program per tile at d128 (the persistent grid won 502 -> 536 TF/s there in the eighth session, before
    # ping-pong, the fence and the skip), and 64-key blocks in four stages at d128 (half the softmax registers per
    # block, twice the barrier traffic per FLOP)
    "one program per tile at d128": [],
    # eighteenth session: K / V stages and the grid where shared memory leaves room for them (d64: 32 KB a stage;
    # d256: one program per tile so far, 1024 tiles on 132 SMs at 4x4096x8)
    "three stages at d64": [],
    "persistent grid at d256": [],
    "64-key blocks in 4 stages at d128": [],
    # the loop's code 5 KB (320 instructions) larger per consumer, executed path two instructions longer (the
    # seventeenth session's streamed consumer was 3-6% slower with a loop 5 KB larger and a steady path as long)
    "5 KB of unexecuted code in the key-block loop": _unexecuted_code(320),
    # the mask's code back in the non-causal key-block loop (as before the eighteenth session, with the blocks now
    # visited last first it is never executed there: only its branch runs)
    "mask code in the non-causal loop": [("        if causal != 0:\n            s = _mask_block(s, top - j",
                                          "        if True:\n            s = _mask_block(s, top - j")],
    # prepared in the eighteenth session (compiled offline only): the non-causal mask (the first step's, its only
    # one) without its always-true row condition, broadcast over the rows instead: 64 FSEL and 64 PLOP3 fewer per
    # consumer; kernels 5384 -> 5184 instructions at d64, 4088 -> 3944 at d128, 3664 -> 3592 at d256 (causal
    # unchanged). Same results; does the code size buy time again (the loop's mask code cost 4.7% at d64)?
    "non-causal mask without the row condition": [
        ("""                visible = gl.expand_dims(columns, 0) <= gl.expand_dims(row_last_key, 1)
        else:""", """                visible = gl.expand_dims(columns, 0) <= gl.expand_dims(row_last_key, 1)
            s = gl.where(visible, s, float("-inf"))
        else:"""),
        ("""            visible = gl.expand_dims(offs_n < seqlen_k, 0) & gl.expand_dims(offs_m >= 0, 1)
        s = gl.where(visible, s, float("-inf"))""", """            s = gl.where(gl.expand_dims(offs_n < seqlen_k, 0), s, float("-inf"))""")],
    # the P V wait before the softmax, as the kernel was until the fourteenth session: P converted where P V is
    # issued (LLVM then carries fp32 P around the loop) and no fence, so ptxas schedules the conversion into the
    # exp2s and the wait with it (offline SASS: no MUFU.EX2 between the S wait and the P V wait)
    "P V waited before the softmax": [
        ("        _hold_schedule(fences)\n", ""),
        ("    p = _operand_of(p, q.dtype, p_layout)\n    for j", "    for j"),
        ("        p = _operand_of(p, q.dtype, p_layout)\n", ""),
        ("acc = warpgroup_mma(p, v_smem.index(previous)",
         "acc = warpgroup_mma(gl.convert_layout(p.to(q.dtype), p_layout), v_smem.index(previous)"),
        ("acc = warpgroup_mma(p, v_smem.index(last % STAGES)",
         "acc = warpgroup_mma(gl.convert_layout(p.to(q.dtype), p_layout), v_smem.index(last % STAGES)")],
    # the fence that keeps the exp2s ahead of the P V wait (kernels/fwd_hopper._hold_schedule) off or on whatever
    # configs.HOPPER_FWD says (the conversion stays after the wait either way)
    "no schedule fence": [(_HOLD, "    if False:\n        fences = (0, )")],
    "schedule fence": [(_HOLD, "    if True:\n        fences = (0, )")],
    # the fence predicated on the row sum being negative, which never holds, so it never executes (ptxas still keeps
    # the exp2s ahead of the wait: offline SASS, session 14); "everywhere": also at d64 / d256, where the executed
    # fence cost 4-6% (fifteenth session: 2-8% slower than the executed fence / no fence)
    "never-executed fence": _NEVER_EXECUTED_FENCE,
    "never-executed fence everywhere": _NEVER_EXECUTED_FENCE + [(_HOLD, "    if True:\n        fences = (0, )")],
    # the loop in order (see _IN_ORDER), as configured and with 128-key blocks at d256 (fifteenth session: 5-16% slower)
    "in-order": _IN_ORDER,
    "in-order with 128-key blocks at d256": _IN_ORDER,
    # the P operand without the opaque copy (LLVM may carry fp32 P around the loop again)
    "no opaque P copy": [('    return gl.inline_asm_elementwise("mov.b32 $0, $1;"',
                          '    return operand\n    gl.inline_asm_elementwise("mov.b32 $0, $1;"')],
    # nineteenth session: Triton's barrier pass puts a warpgroup BAR.SYNC at the top of every consumer loop
    # iteration (offline SASS, every table entry: it goes only when all of the loop's mbarrier waits and arrivals
    # go); a second one per iteration, after the softmax, prices what removing it could buy
    "second warpgroup barrier per key block": [
        ("        p, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, qk_scale_log2, lag, tree)\n"
         "        _hold_schedule(fences)\n",
         "        p, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, qk_scale_log2, lag, tree)\n        gl.thread_barrier()\n"
         "        _hold_schedule(fences)\n")],
    # prepared in the nineteenth session (config only): FA4's d64 causal shape, three MMA warpgroups (192-row tiles)
    # on a grid of one program per tile (ncu: FA4 594 us against our 637 at 4x4096x32x64 causal); three consumers
    # on our persistent paired grid read 430-433 against 438-440 in session 16; and the grid change alone. Offline:
    # at 160 registers the three-consumer causal kernel has 38 local-memory accesses in its key-block loops (the
    # masked path: the causal loop holds the mask code), the two-consumer one none
    "three consumers at d64 causal per tile": [],
    "one program per tile at d64 causal": [],
    # the causal mask compared by column residues (prepared in the nineteenth session, in the kernel since the
    # twentieth as configs.HopperFwdConfig.mask_by_residues: at d128 / d256, where it won; kernels/fwd_hopper.
    # _mask_block), FA4's d64 causal shape with it, and its opposites (CONFIGS)
    "three consumers at d64 causal per tile by column residues": [],
    "causal mask by plain columns": [],
    "causal mask by column residues at d64": [],
    # twentieth session: three consumers on the persistent paired grid at d64 causal (session 16: 430-433 against
    # 438-440 with two, when the three-consumer causal loop spilled: 38 local accesses offline) with the residue
    # mask, which compiles it without loop spills
    "three consumers at d64 causal by column residues": [],
    # twentieth session: the row max in one dependent chain per thread, as Triton 3.6 reduces (ncu at 16x1024: the
    # chain's FMNMX carried 11% of the consumer loop's stall samples, "wait"), against kernels/fwd_hopper._row_max's
    # tree (configs.HopperFwdConfig.row_max_tree: at d128 non-causal, the only place it won; CONFIGS); and the row
    # sums as the same kind of tree (their FADD chain interleaves with the exp2s, which pace it). First run: the tree
    # +0.8% at 16x1024, +1.4% / +0.5% at 4x4096 / 1x16384 (spread +-3%), -5% / -6% at d64, -0.5 to -1.1% at d256, causal
    # d128 -1.1% to +1.8%; the sums as a tree -1.5 to +1.7%. Twenty-fourth session: the chain +1.1% / +2.2% / +2.6%
    # at d128 non-causal (16x1024 / 4x4096 / 1x16384), so the tree left the table; "row max as a tree at d128" is
    # the pair seen from the chain's side
    # twenty-first session: the persistent grids' last, partial wave cut by key blocks among all programs
    # (configs.HopperFwdConfig.split_tail; ops/hopper_fwd.tail_split) against the whole-tile last wave (SPLIT_TAIL
    # off: no code for it); with shares of 4 key blocks at least (16x1024: cut, -3.4% / -4.8%), at d128 causal
    # (-2% at 4x4096, -10% at 16x1024) and at d64 (level non-causal and causal): two calls each (configs.py)
    "tail not split": [],
    "tail split by 4 blocks at least": [],
    "tail split at d128 causal": [],
    "tail split at d64": [],
    "row max as a tree at d128": [],
    "row max as a tree everywhere": [],
    "row sums as a tree": [
        ("@gluon.jit\ndef _softmax_block(", """@gluon.jit
def _row_sum(p):
    ROWS: gl.constexpr = p.shape[0]
    BLOCK_N: gl.constexpr = p.shape[1]
    level = gl.sum(p.reshape([ROWS, BLOCK_N // 8, 4, 2]), 3)
    for _ in gl.static_range(BLOCK_N.bit_length() - 4):
        level = gl.sum(level.reshape([ROWS, 2, level.shape[1] // 2, 4]), 1)
    return gl.convert_layout(gl.sum(level.reshape([ROWS, 4]), 1), gl.SliceLayout(1, p.type.layout))


@gluon.jit
def _softmax_block("""),
        ("    l_i = l_i * alpha + gl.sum(p, 1)", "    l_i = l_i * alpha + _row_sum(p)")],
    # twentieth session: the producer's order before it, each tile's Q tiles ahead of its first K (kernels/fwd_hopper.
    # _producer: Q waits for the consumers' last S of the previous tile, the first K only for their second-to-last)
    "Q before the first K": [
        ("        _load_stage(k_desc, k_smem, k_ready, k_empty, load, batch, top, head_k)\n"
         "        for consumer in gl.static_range(CONSUMERS):", "        for consumer in gl.static_range(CONSUMERS):"),
        ("        _load_stage(v_desc, v_smem, v_ready, v_empty, load, batch, top, head_k)\n",
         "        _load_key_block(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, load, batch, top,\n"
         "                        head_k)\n")],
    # prepared in the twentieth session (compiled offline only): the tile's last P V issued without waiting, the
    # epilogue's row work (row sums, reciprocal, the LSE; since the twenty-first session's tail split no longer its
    # store and the wait for the previous O store, which moved into kernels/fwd_hopper._store_output) under it, then
    # the wait (ncu at 16x1024: the last P V's wait held 140-153 stall samples per consumer, ~1% of its time)
    "epilogue's row work under the last P V": [
        ("    acc = warpgroup_mma(p, v_smem.index(last % STAGES).reshape([BLOCK_N, HEAD_DIM]), acc)\n"
         "    arrive_after_wgmma(v_empty.index(last % STAGES))\n",
         "    acc = warpgroup_mma(p, v_smem.index(last % STAGES).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)\n"),
        ("        out = acc * gl.expand_dims(inverse_sum, 1)\n",
         "        acc = warpgroup_mma_wait(0, deps=(acc, ))\n"
         "        arrive_after_wgmma(v_empty.index((load + count - 1) % k_smem.shape[0]))\n"
         "        out = acc * gl.expand_dims(inverse_sum, 1)\n")],
    # one release per key block: K's stage is handed back with V's (after P V), not after S, so each consumer
    # iteration has one mbarrier arrival fewer, and the producer loads K of load l only once V of load l - STAGES is
    # released (correct results; prefetch one wgmma later)
    "one release per key block": [("arrive_after_wgmma(k_empty.index(stage))", "pass"),
                                  ("_load_stage(k_desc, k_smem, k_ready, k_empty, load",
                                   "_load_stage(k_desc, k_smem, k_ready, v_empty, load")],
}

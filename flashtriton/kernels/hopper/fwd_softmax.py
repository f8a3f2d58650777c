"""The Gluon forward's score side (kernels/hopper/fwd.py): a key block's raw scores to logits (ALiBi), masked
(causal, local window, keys past the sequence), the online softmax step with its A-1 rescale skip, the output's
rescale, and P as the P V wgmma's operand. Numerics are kernels/fwd.py's (fwd.py's docstring)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


def _rescale_unless_unmoved_ptx(pack: int) -> str:
    """PTX over `pack` consecutive output elements of a thread and their rows' alphas (operands: the results, the
    elements, the alphas). A thread's elements of the wgmma accumulator come in fours per 8 columns: rows r, r,
    r + 8, r + 8, so the alphas at 0 and 2 are both of its rows. A warp vote asks whether any of the warp's 16
    rows moved its max (alpha != 1); if none did, a warp-uniform branch skips the multiplies."""
    lines = ["{", ".reg .pred %moved;", f"setp.neu.f32 %moved, ${2 * pack}, 0f3F800000;",
             f"setp.neu.or.f32 %moved, ${2 * pack + 2}, 0f3F800000, %moved;",
             "vote.sync.any.pred %moved, %moved, -1;"]
    lines += [f"mov.f32 ${i}, ${pack + i};" for i in range(pack)]
    lines += ["@!%moved bra.uni unmoved_${:uid};"]
    lines += [f"mul.f32 ${i}, ${pack + i}, ${2 * pack + i};" for i in range(pack)]
    return "\n".join(lines + ["unmoved_${:uid}:", "}"])


def _rescale_constraints(pack: int) -> str:
    return ",".join(["=f"] * pack + ["f"] * 2 * pack)


# rescale's inline PTX for 8, 16, 32 and 64 elements per asm (a thread holds WIDTH / 2 elements of a [64, WIDTH]
# output chunk)
_RESCALE_PTX_8 = gl.constexpr(_rescale_unless_unmoved_ptx(8))
_RESCALE_PTX_16 = gl.constexpr(_rescale_unless_unmoved_ptx(16))
_RESCALE_PTX_32 = gl.constexpr(_rescale_unless_unmoved_ptx(32))
_RESCALE_PTX_64 = gl.constexpr(_rescale_unless_unmoved_ptx(64))
_RESCALE_CONSTRAINTS_8 = gl.constexpr(_rescale_constraints(8))
_RESCALE_CONSTRAINTS_16 = gl.constexpr(_rescale_constraints(16))
_RESCALE_CONSTRAINTS_32 = gl.constexpr(_rescale_constraints(32))
_RESCALE_CONSTRAINTS_64 = gl.constexpr(_rescale_constraints(64))


@gluon.jit
def mask_local(s, j, row0, offs_m, seqlen_q, seqlen_k, window, col_s: gl.constexpr):
    """mask_block under a local window (window_left, window_right): s [ROWS, BLOCK_N] of key block j with keys past
    seqlen_k and outside each row's window (bottom-right aligned: keys [i + sk - sq - left, i + sk - sq + right])
    set to -inf; a block inside every row's window and the keys comes back untouched."""
    ROWS: gl.constexpr = s.shape[0]
    BLOCK_N: gl.constexpr = s.shape[1]
    offset = seqlen_k - seqlen_q
    n_start = j * BLOCK_N
    # the last key the first row sees, the first key the last row sees
    first_row_last_key = row0 + offset + window[1]
    last_row_first_key = row0 + ROWS - 1 + offset - window[0]
    if (n_start + BLOCK_N > seqlen_k) | (n_start + BLOCK_N - 1 > first_row_last_key) | (n_start < last_row_first_key):
        # [ROWS] each row's first and last visible key, moved into the block; [BLOCK_N] the block's columns
        row_last_key = gl.minimum(offs_m + offset + window[1], seqlen_k - 1) - n_start
        row_first_key = offs_m + offset - window[0] - n_start
        columns = gl.expand_dims(gl.arange(0, BLOCK_N, col_s), 0)
        # [ROWS, BLOCK_N]
        visible = (columns <= gl.expand_dims(row_last_key, 1)) & (columns >= gl.expand_dims(row_first_key, 1))
        s = gl.where(visible, s, float("-inf"))
    return s


@gluon.jit
def mask_block(s, j, row0, offs_m, seqlen_q, seqlen_k, causal, residues, col_s: gl.constexpr):
    """s [ROWS, BLOCK_N] of key block j (query rows offs_m [ROWS] from row0) with keys past seqlen_k (and, causal,
    past each row's last key: bottom-right aligned) set to -inf; blocks that need neither come back untouched without
    any mask arithmetic. Causal blocks compare each key with its row's last visible key (the diagonal and seqlen_k
    in one bound): one comparison per element.
    residues: (0, ) or () (configs.HopperFwdConfig.mask_by_residues): column <= last key compared as column % 8 <=
    last key - column // 8 * 8. A thread's columns are 2 (lane % 4) + 8 k + {0, 1}: two residues per thread and an
    immediate per element, where the plain comparison keeps the thread's BLOCK_N / 4 loop-invariant columns in
    registers across the key-block loop (LLVM hoists them; they spill at d128 causal). Same mask either way."""
    BLOCK_N: gl.constexpr = s.shape[1]
    n_end = (j + 1) * BLOCK_N
    # the last key the tile's first row (row0) sees under the causal mask
    first_row_last_key = row0 + (seqlen_k - seqlen_q)
    if (n_end > seqlen_k) | ((causal != 0) & (n_end - 1 > first_row_last_key)):
        if causal != 0:
            # [ROWS] each row's last visible key, moved into the block
            row_last_key = gl.minimum(offs_m + (seqlen_k - seqlen_q), seqlen_k - 1) - j * BLOCK_N
            # [BLOCK_N] the block's columns
            columns = gl.arange(0, BLOCK_N, col_s)
            if len(residues) > 0:
                # [ROWS, BLOCK_N]
                visible = (gl.expand_dims(columns % 8, 0)
                           <= gl.expand_dims(row_last_key, 1) - gl.expand_dims(columns // 8 * 8, 0))
            else:
                # [ROWS, BLOCK_N]
                visible = gl.expand_dims(columns, 0) <= gl.expand_dims(row_last_key, 1)
        else:
            # [BLOCK_N] keys of this block
            offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, col_s)
            # [ROWS, BLOCK_N]
            visible = gl.expand_dims(offs_n < seqlen_k, 0) & gl.expand_dims(offs_m >= 0, 1)
        s = gl.where(visible, s, float("-inf"))
    return s


@gluon.jit
def softmax_block(s, m_i, l_i, qk_scale_log2, lag):
    """Online softmax step of one masked score block s [ROWS, BLOCK_N]: probabilities (scale folded into the exp2
    argument), the new running max (log2 units) and row sum, and alpha, the factor that rescales what was
    accumulated before. Rows that have seen no key yet keep max -inf and get p = 0, alpha = 0. lag: () or
    (threshold, ): the A-1 rescale skip (kernels/fwd.py's): a row's max moves only when a block raises it by more
    than threshold (log2 units), else alpha is exactly 1 and p stays below 2^threshold; O, the row sum and the LSE
    share the lagging base, so the result is exact."""
    m_block = gl.max(s, 1) * qk_scale_log2
    if len(lag) > 0:
        m_new = gl.where(m_block > m_i + lag[0], m_block, m_i)
    else:
        m_new = gl.maximum(m_i, m_block)
    pivot = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale_log2 - gl.expand_dims(pivot, 1))
    alpha = gl.exp2(m_i - pivot)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def rescale(acc, alpha, lag):
    """acc [ROWS, WIDTH] (an output chunk) * alpha [ROWS] by rows (alpha in any layout). With the rescale skip (lag:
    (threshold, )) each warp skips the multiplies when none of its rows moved its max (_rescale_unless_unmoved_ptx:
    a warp vote, where a warpgroup-wide decision would need a reduction through shared memory)."""
    WIDTH: gl.constexpr = acc.shape[1]
    alpha_by_row = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
    if len(lag) > 0:
        if WIDTH >= 128:
            acc = gl.inline_asm_elementwise(_RESCALE_PTX_64, _RESCALE_CONSTRAINTS_64, [acc, alpha_by_row],
                                            dtype=gl.float32, is_pure=True, pack=64)
        elif WIDTH == 64:
            acc = gl.inline_asm_elementwise(_RESCALE_PTX_32, _RESCALE_CONSTRAINTS_32, [acc, alpha_by_row],
                                            dtype=gl.float32, is_pure=True, pack=32)
        elif WIDTH == 32:
            acc = gl.inline_asm_elementwise(_RESCALE_PTX_16, _RESCALE_CONSTRAINTS_16, [acc, alpha_by_row],
                                            dtype=gl.float32, is_pure=True, pack=16)
        else:
            acc = gl.inline_asm_elementwise(_RESCALE_PTX_8, _RESCALE_CONSTRAINTS_8, [acc, alpha_by_row],
                                            dtype=gl.float32, is_pure=True, pack=8)
    else:
        acc = acc * alpha_by_row
    return acc


@gluon.jit
def reciprocal(x):
    """1 / x by the MUFU reciprocal (rcp.approx.ftz.f32: at most 1 ulp off; flushes denormals)."""
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def operand_of(p, dtype: gl.constexpr, p_layout: gl.constexpr):
    """P [ROWS, BLOCK_N] fp32 -> the P V wgmma's A operand in dtype, through an opaque register copy: LLVM folds a
    loop-carried value made by the same conversion on every path into one conversion of a loop-carried fp32 P at
    the loop's top (InstCombine), which keeps 64 fp32 registers live across the next S wgmma and makes ptxas
    wait for P V before the softmax; the copy keeps the conversion where it is written."""
    operand = gl.convert_layout(p.to(dtype), p_layout)
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [operand], dtype=operand.dtype, is_pure=True,
                                    pack=2)


@gluon.jit
def hold_schedule(fences):
    """fences: (0, ) or (): a CTA memory fence (MEMBAR.ALL.CTA; a consumer has no memory operation of its own in
    flight here but barrier arrivals) that ptxas does not move instructions across, so the softmax's exp2s before it
    stay ahead of the P V wait after it. Without it ptxas schedules P's conversion into the exp2s and the wait with
    it (offline SASS: no MUFU.EX2 between the S wait and the P V wait), so P V does not overlap the softmax. On where
    configs.HOPPER_FWD says (the fence's cost exceeds the overlap's gain without ping-pong)."""
    for _ in gl.static_range(len(fences)):
        gl.inline_asm_elementwise("fence.acq_rel.cta;\n\tmov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)


@gluon.jit
def logits(s, block, offs_m, seqlen_q, seqlen_k, alibi, col_s: gl.constexpr):
    """Raw q.k scores s [ROWS, BLOCK_N] of key block `block` (query rows offs_m [ROWS]) as the log2-domain logits the
    softmax takes at scale 1, where alibi = (slope_log2 of the tile's head, alibi_pure_causal, qk_scale_log2) asks for
    more than the scale: s * qk_scale_log2 plus kernels/common.alibi_bias_log2's bias, -slope_log2 * |row + seqlen_k
    - seqlen_q - key| (FA2's pure-causal configuration: -slope_log2 * -key). Without it (alibi ()), s itself (the
    softmax folds the scale into its exponent)."""
    if len(alibi) > 0:
        s = s * alibi[2]
        BLOCK_N: gl.constexpr = s.shape[1]
        # [ROWS] each row's position on the keys, counted from the block's first key (or the negated first key in
        # the pure-causal configuration), through an opaque copy: LLVM would otherwise hoist row - column, a loop-
        # invariant [ROWS, BLOCK_N] tile, out of the key-block loop and spill it
        first = block * BLOCK_N
        row_base = gl.where(alibi[1] != 0, offs_m * 0 - first, offs_m + (seqlen_k - seqlen_q) - first)
        row_base = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [row_base], dtype=gl.int32, is_pure=True,
                                             pack=1)
        # [BLOCK_N] the block's columns as column // 8 * 8 (an immediate per element) + column % 8 (two values per
        # thread), as mask_block's residues: the plain columns would stay live across the loop
        columns = gl.arange(0, BLOCK_N, col_s)
        # [ROWS, BLOCK_N] distances: |row - key|, or -key in the pure-causal configuration
        difference = ((gl.expand_dims(row_base, 1) - gl.expand_dims(columns // 8 * 8, 0))
                      - gl.expand_dims(columns % 8, 0))
        distance = gl.where(alibi[1] != 0, difference, gl.abs(difference))
        s = s - alibi[0] * distance.to(gl.float32)
    return s

"""Dropout inside the Gluon kernels: the keep mask of kernels/common.dropout_keep (docs/api.md §4.7), drawn on a
score tile in the wgmma accumulator layout.

A thread of a [64 rows, BLOCK_N] accumulator (warp w of the warpgroup, lane 4 g + t) holds rows 16 w + g and
16 w + g + 8 and, in each 8-key group k, keys 8 k + 2 t and 8 k + 2 t + 1, in register order (key parity, row
half, key group). The mapping's Philox call (4 (j / 32) + t, 8 (i / 16) + i % 8, stream, offset) covers exactly a
thread's sixteen consecutive registers of one 32-key group: byte 2 h + e of word k is the element of row half h,
key parity e in group k. So one Philox4x32-7 (kernels/common.PHILOX_ROUNDS) per sixteen elements, no draw wasted,
in inline PTX over packs of sixteen elements (_philox_ptx draws a pack's four words; _select_ptx keeps or zeroes
its fp32 elements by them, for the backward; _select_operand_ptx makes the forward's bf16 / fp16 P V operand from
them, two elements per instruction); the Triton kernels draw the same bits their own way.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..common import PHILOX_ROUNDS

_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PACK = 16  # elements per Philox call and asm instance


def _philox_ptx() -> str:
    """PTX of one Philox call (PHILOX_ROUNDS rounds) per pack of sixteen elements (operands: 16 int32 results; then
    16 each of the pack's 32-key group number, its row pair number, seed low and high words, stream and offset; of
    each group of 16 only the first is read: they are equal across a pack). The pack's key pair t is the lane's
    lane % 4. Results 0-3 are the four words, the others 0 (unused: ptxas drops their moves)."""
    first = {name: _PACK * (index + 1) for index, name in
             enumerate(("group", "pair", "seed_lo", "seed_hi", "stream", "offset"))}
    lines = ["{", ".reg .u32 %c0, %c1, %c2, %c3, %k0, %k1, %lo0, %hi0, %lo1, %hi1, %t;",
             "mov.u32 %t, %laneid;", "and.b32 %t, %t, 3;",
             f"shl.b32 %c0, ${first['group']}, 2;", "add.u32 %c0, %c0, %t;",
             f"mov.b32 %c1, ${first['pair']};", f"mov.b32 %c2, ${first['stream']};",
             f"mov.b32 %c3, ${first['offset']};", f"mov.b32 %k0, ${first['seed_lo']};",
             f"mov.b32 %k1, ${first['seed_hi']};"]
    for _ in range(PHILOX_ROUNDS.value):
        lines += [f"mul.lo.u32 %lo0, %c0, {_PHILOX_ROUND_A};", f"mul.hi.u32 %hi0, %c0, {_PHILOX_ROUND_A};",
                  f"mul.lo.u32 %lo1, %c2, {_PHILOX_ROUND_B};", f"mul.hi.u32 %hi1, %c2, {_PHILOX_ROUND_B};",
                  "xor.b32 %c0, %hi1, %c1;", "xor.b32 %c0, %c0, %k0;", "mov.b32 %c1, %lo1;",
                  "xor.b32 %c2, %hi0, %c3;", "xor.b32 %c2, %c2, %k1;", "mov.b32 %c3, %lo0;",
                  f"add.u32 %k0, %k0, {_PHILOX_KEY_A};", f"add.u32 %k1, %k1, {_PHILOX_KEY_B};"]
    lines += [f"mov.b32 ${word}, %c{word};" for word in range(4)]
    lines += [f"mov.b32 ${element}, 0;" for element in range(4, _PACK)]
    return "\n".join(lines + ["}"])


def _select_ptx() -> str:
    """PTX over a pack of sixteen fp32 values and the pack's Philox words (operands: 16 results; 16 values; 16 words,
    of which the first four are read; 16 thresholds, of which the first): element 4 k + b keeps its value where byte
    b of word k is <= the threshold, else 0."""
    lines = ["{", ".reg .u32 %byte;", ".reg .pred %keep;"]
    for element in range(_PACK):
        word, byte = divmod(element, 4)
        lines += [f"bfe.u32 %byte, ${2 * _PACK + word}, {8 * byte}, 8;",
                  f"setp.le.u32 %keep, %byte, ${3 * _PACK};",
                  f"selp.f32 ${element}, ${_PACK + element}, 0f00000000, %keep;"]
    return "\n".join(lines + ["}"])


def _select_operand_ptx(dtype: str) -> str:
    """PTX over a pack of sixteen fp32 values and the pack's Philox words that makes the P V operand: the values
    rounded to `dtype` ("bf16" or "f16") in pairs (operands: 8 packed results; 16 values; 16 words, of which the first
    four are read; 16 thresholds, of which the first), zeroed where dropped, two elements per instruction: each
    byte pair of a word becomes two fp16 values 1024 + byte (exact), compared at once with 1024 + threshold
    (set.le.u32.f16x2: a 16-bit mask per half) and applied to the packed pair with an and. Result r holds elements
    2r (low half) and 2r + 1; word k's bytes 2h + e are elements 4k + 2h + e (_select_ptx's)."""
    first_value, first_word, threshold = 8, 8 + _PACK, 8 + 2 * _PACK
    lines = ["{", ".reg .b32 %bytes, %limit, %mask, %pair;",
             f"prmt.b32 %limit, ${threshold}, 100, 0x4040;"]  # 1024 + threshold in both halves (0x64: 1024's exponent)
    for word in range(4):
        for half in range(2):
            result = 2 * word + half
            low, high = first_value + 2 * result, first_value + 2 * result + 1
            selector = "0x4140" if half == 0 else "0x4342"
            lines += [f"prmt.b32 %bytes, ${first_word + word}, 100, {selector};",
                      "set.le.u32.f16x2 %mask, %bytes, %limit;",
                      f"cvt.rn.{dtype}x2.f32 %pair, ${high}, ${low};",
                      f"and.b32 ${result}, %pair, %mask;"]
    return "\n".join(lines + ["}"])


_PHILOX_PTX = gl.constexpr(_philox_ptx())
_PHILOX_CONSTRAINTS = gl.constexpr(",".join(["=r"] * _PACK + ["r"] * (6 * _PACK)))
_SELECT_PTX = gl.constexpr(_select_ptx())
_SELECT_CONSTRAINTS = gl.constexpr(",".join(["=f"] * _PACK + ["f"] * _PACK + ["r"] * (2 * _PACK)))
_DROP_PACK = gl.constexpr(_PACK)
_SELECT_OPERAND_BF16 = gl.constexpr(_select_operand_ptx("bf16"))
_SELECT_OPERAND_F16 = gl.constexpr(_select_operand_ptx("f16"))
_SELECT_OPERAND_CONSTRAINTS = gl.constexpr(",".join(["=r"] * (_PACK // 2) + ["f"] * _PACK + ["r"] * (2 * _PACK)))


@gluon.jit
def dropout_key(rng_state, keep_threshold):
    """The call's part of the draws: (seed low and high words, offset, byte threshold) of rng_state (the call's (2,)
    int64 seed and offset) and the keep threshold (docs/api.md §4.7)."""
    seed = gl.load(rng_state)
    seed_lo = (seed & 0xFFFFFFFF).to(gl.uint32).to(gl.int32, bitcast=True)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(gl.uint32).to(gl.int32, bitcast=True)
    offset = (gl.load(rng_state + 1) & 0x7FFFFFFF).to(gl.int32)
    return seed_lo, seed_hi, offset, keep_threshold.to(gl.int32)


@gluon.jit
def row_draws(key, stream, offs_m):
    """What `dropped` needs of a tile's rows offs_m [ROWS] (from a multiple of 16) in a (batch * heads + head)
    stream: dropout_key's key, the stream and the rows' Philox row-pair numbers 8 (i / 16) + i % 8 [ROWS]."""
    return key + (stream, (offs_m // 16) * 8 + offs_m % 8)


@gluon.jit
def draw_words(like, block, draws, col_s: gl.constexpr):
    """[ROWS, BLOCK_N] int32 in the layout of `like` (the wgmma accumulator layout of 64-row warpgroup tiles; BLOCK_N
    a multiple of 32): the Philox words of key block `block` (keys from block * BLOCK_N), four per sixteen-element
    pack of a thread (draws: row_draws' of the tile's rows). They depend on no score: the forward draws them while
    the block's S wgmma runs (`kept` applies them)."""
    BLOCK_N: gl.constexpr = like.shape[1]
    gl.static_assert(BLOCK_N % 32 == 0, "dropout draws 32-key groups")
    seed_lo, seed_hi, offset, threshold, stream, pairs = draws
    # [ROWS, BLOCK_N] int32 zeros to broadcast scalars over the tile
    zeros = gl.zeros_like(like).to(gl.int32)
    # [ROWS, BLOCK_N] each element's 32-key group (equal across an asm pack) and row pair
    groups = zeros + block * (BLOCK_N // 32) + gl.expand_dims(gl.arange(0, BLOCK_N, col_s) // 32, 0)
    row_pairs = zeros + gl.expand_dims(gl.convert_layout(pairs, gl.SliceLayout(1, like.type.layout)), 1)
    return gl.inline_asm_elementwise(_PHILOX_PTX, _PHILOX_CONSTRAINTS,
                                     [groups, row_pairs, zeros + seed_lo, zeros + seed_hi, zeros + stream,
                                      zeros + offset],
                                     dtype=gl.int32, is_pure=True, pack=_DROP_PACK)


@gluon.jit
def kept(p, words, draws):
    """p [ROWS, BLOCK_N] (fp32) with the elements its Philox words (draw_words') drop set to 0."""
    threshold = gl.zeros_like(words) + draws[3]
    return gl.inline_asm_elementwise(_SELECT_PTX, _SELECT_CONSTRAINTS, [p, words, threshold], dtype=gl.float32,
                                     is_pure=True, pack=_DROP_PACK)


@gluon.jit
def kept_operand(p, words, draws, dtype: gl.constexpr, p_layout: gl.constexpr):
    """The P V wgmma's A operand (p_layout, dtype: bf16 or fp16) of p [ROWS, BLOCK_N] (fp32) with the elements its
    Philox words (draw_words') drop set to 0: rounding, mask and select in one pass over packed pairs
    (_select_operand_ptx), the same values as `kept` then the rounding, in half the instructions per element."""
    threshold = gl.zeros_like(words) + draws[3]
    if dtype == gl.bfloat16:
        operand = gl.inline_asm_elementwise(_SELECT_OPERAND_BF16, _SELECT_OPERAND_CONSTRAINTS, [p, words, threshold],
                                            dtype=gl.bfloat16, is_pure=True, pack=_DROP_PACK)
    else:
        operand = gl.inline_asm_elementwise(_SELECT_OPERAND_F16, _SELECT_OPERAND_CONSTRAINTS, [p, words, threshold],
                                            dtype=gl.float16, is_pure=True, pack=_DROP_PACK)
    return gl.convert_layout(operand, p_layout)


@gluon.jit
def dropped(p, block, draws, col_s: gl.constexpr):
    """p [ROWS, BLOCK_N] (fp32, the wgmma accumulator layout of 64-row warpgroup tiles; BLOCK_N a multiple of 32) of
    key block `block` (keys from block * BLOCK_N) with the dropped elements set to 0 (draws: row_draws' of p's
    rows)."""
    return kept(p, draw_words(p, block, draws, col_s), draws)

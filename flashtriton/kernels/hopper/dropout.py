"""Dropout inside the Gluon kernels: the keep mask of kernels/common.dropout_keep (docs/api.md §4.7), drawn on a
score tile in the wgmma accumulator layout.

A thread of a [64 rows, BLOCK_N] accumulator (warp w of the warpgroup, lane 4 g + t) holds rows 16 w + g and
16 w + g + 8 and, in each 8-key group k, keys 8 k + 2 t and 8 k + 2 t + 1, in register order (key parity, row
half, key group). The mapping's Philox call (4 (j / 32) + t, 8 (i / 16) + i % 8, stream, offset) covers exactly a
thread's sixteen consecutive registers of one 32-key group: byte 2 h + e of word k is the element of row half h,
key parity e in group k. So one Philox4x32-10 per sixteen elements, no draw wasted, in inline PTX over packs of
sixteen elements (_drop_ptx); the Triton kernels draw the same bits their own way.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PACK = 16  # elements per Philox call and asm instance


def _drop_ptx() -> str:
    """PTX over a pack of sixteen fp32 probabilities (operands: 16 results; then 16 each of the probabilities, the
    pack's 32-key group number, its row pair number, seed low and high words, stream, offset and byte threshold; of
    each group of 16 only the first is read: they are equal across a pack). The pack's key pair t is the lane's
    lane % 4. Results: the probability where its byte <= threshold, else 0."""
    first = {name: _PACK * (index + 2) for index, name in
             enumerate(("group", "pair", "seed_lo", "seed_hi", "stream", "offset", "threshold"))}
    lines = ["{", ".reg .u32 %c0, %c1, %c2, %c3, %k0, %k1, %lo0, %hi0, %lo1, %hi1, %t, %byte;",
             ".reg .pred %keep;",
             "mov.u32 %t, %laneid;", "and.b32 %t, %t, 3;",
             f"shl.b32 %c0, ${first['group']}, 2;", "add.u32 %c0, %c0, %t;",
             f"mov.b32 %c1, ${first['pair']};", f"mov.b32 %c2, ${first['stream']};",
             f"mov.b32 %c3, ${first['offset']};", f"mov.b32 %k0, ${first['seed_lo']};",
             f"mov.b32 %k1, ${first['seed_hi']};"]
    for _ in range(10):
        lines += [f"mul.lo.u32 %lo0, %c0, {_PHILOX_ROUND_A};", f"mul.hi.u32 %hi0, %c0, {_PHILOX_ROUND_A};",
                  f"mul.lo.u32 %lo1, %c2, {_PHILOX_ROUND_B};", f"mul.hi.u32 %hi1, %c2, {_PHILOX_ROUND_B};",
                  "xor.b32 %c0, %hi1, %c1;", "xor.b32 %c0, %c0, %k0;", "mov.b32 %c1, %lo1;",
                  "xor.b32 %c2, %hi0, %c3;", "xor.b32 %c2, %c2, %k1;", "mov.b32 %c3, %lo0;",
                  f"add.u32 %k0, %k0, {_PHILOX_KEY_A};", f"add.u32 %k1, %k1, {_PHILOX_KEY_B};"]
    for element in range(_PACK):
        word, byte = divmod(element, 4)
        lines += [f"bfe.u32 %byte, %c{word}, {8 * byte}, 8;",
                  f"setp.le.u32 %keep, %byte, ${first['threshold']};",
                  f"selp.f32 ${element}, ${_PACK + element}, 0f00000000, %keep;"]
    return "\n".join(lines + ["}"])


_DROP_PTX = gl.constexpr(_drop_ptx())
_DROP_PACK = gl.constexpr(_PACK)
_DROP_CONSTRAINTS = gl.constexpr(",".join(["=f"] * _PACK + ["f"] * _PACK + ["r"] * (7 * _PACK)))


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
def dropped(p, block, draws, col_s: gl.constexpr):
    """p [ROWS, BLOCK_N] (fp32, the wgmma accumulator layout of 64-row warpgroup tiles; BLOCK_N a multiple of 32) of
    key block `block` (keys from block * BLOCK_N) with the dropped elements set to 0 (draws: row_draws' of p's
    rows). A p of one value everywhere gives the mask times that value."""
    BLOCK_N: gl.constexpr = p.shape[1]
    gl.static_assert(BLOCK_N % 32 == 0, "dropout draws 32-key groups")
    seed_lo, seed_hi, offset, threshold, stream, pairs = draws
    # [ROWS, BLOCK_N] int32 zeros to broadcast scalars over the tile
    zeros = gl.zeros_like(p).to(gl.int32)
    # [ROWS, BLOCK_N] each element's 32-key group (equal across an asm pack) and row pair
    groups = zeros + block * (BLOCK_N // 32) + gl.expand_dims(gl.arange(0, BLOCK_N, col_s) // 32, 0)
    row_pairs = zeros + gl.expand_dims(gl.convert_layout(pairs, gl.SliceLayout(1, p.type.layout)), 1)
    return gl.inline_asm_elementwise(_DROP_PTX, _DROP_CONSTRAINTS,
                                     [p, groups, row_pairs, zeros + seed_lo, zeros + seed_hi, zeros + stream,
                                      zeros + offset, zeros + threshold],
                                     dtype=gl.float32, is_pure=True, pack=_DROP_PACK)

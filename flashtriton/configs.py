"""Kernel tile configurations as data, and the pure functions that pick them.

Each table names the benchmark that chose its entries in one line: command, date, commit, GPU (BENCHMARKS.md has
the numbers). The Triton kernels' tables are keyed by arch class ("interpreter", "sm80", "sm90") and head-dim
bucket, the Gluon Hopper kernels' by head dim (and causal). Two switches, read once at import:
FLASHTRITON_TMA=0 turns tensor descriptors off in every config (pointer loads only; the Gluon Hopper kernels,
which need them, are off then too): for debugging, and for tools like compute-sanitizer's initcheck that may not
see the bulk (TMA) stores as writes. FLASHTRITON_GLUON=0 keeps every forward and backward on the Triton kernels.

Tables and settings may be changed at run time (tuning sweeps, tests): `changes` counts every replacement of a
module attribute and every change to a table (ConfigTable), and ops/call_plans keeps a call's plan for one count only.
"""

from __future__ import annotations

import math
import os
import sys
import types
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional

import torch


@dataclass(frozen=True)
class TileConfig:
    block_m: int       # query rows per tile
    block_n: int       # key rows per tile
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class FwdConfig(TileConfig):
    # the A-1 rescale skip: the row max lags by up to this much (log2 units; FA4's value for 16-bit inputs), so most
    # key blocks skip the output rescale; 0: every block rescales
    rescale_threshold: float = 8.0
    use_tma: bool = False           # tensor descriptors for dense layouts (sm90+)


@dataclass(frozen=True)
class BwdConfig:
    dkdv: TileConfig   # one program per key tile, looping over query tiles
    dq: TileConfig     # one program per query tile, looping over key tiles
    preprocess_block: int = 128  # rows per program of the preprocess (delta; the zeroed dQ accumulator)
    use_tma: bool = False  # Q/dO (dK/dV) and K/V (dQ) tiles through in-kernel tensor descriptors (sm90+)
    dq_atomic: bool = False  # dQ added with atomics by the dK/dV kernel, no dQ pass (not with deterministic=True)


changes = 0  # replacements of this module's attributes and changes to its tables since import (_Settings)


class ConfigTable(dict):
    """A table of configs: a dict whose every change counts in `changes`."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        _count_change()

    def __delitem__(self, key):
        super().__delitem__(key)
        _count_change()

    def _refused(self, *args, **kwargs):
        raise TypeError("a ConfigTable changes by item assignment and deletion only (so that the change is counted)")

    update = pop = popitem = clear = setdefault = __ior__ = _refused


def _count_change() -> None:
    global changes
    changes += 1


TMA_ALLOWED = os.environ.get("FLASHTRITON_TMA", "1") != "0"
GLUON_ALLOWED = os.environ.get("FLASHTRITON_GLUON", "1") != "0"

# Interpreter: small tiles so that interpreter-sized tests (seqlens up to ~300) cross many blocks.
_INTERPRETER_FWD = FwdConfig(block_m=64, block_n=64, num_warps=4, num_stages=1)
_INTERPRETER_BWD = BwdConfig(TileConfig(64, 64, 4, 1), TileConfig(64, 64, 4, 1), preprocess_block=64)

# GPU tables, keyed by (arch class, causal): ((max head dim, config), ...), first match wins. On GPUs the Triton
# forward rescales every block (_NO_SKIP): in Triton the skip needs a tile-wide reduction and branch per key block.
# sm90: python benchmarks/sweep_configs.py, 2026-11-30, 2622019 (head dim 256: d8c9095), H200
# sm90 head dims 512 (and kv-cache q/k up to 576, tiles 1024 wide): python tools/offline_compile.py --head-dim 512
#   (--head-dim 576 --head-dim-v 512), 2026-12-05, afef2ac, sm_90 offline (the largest tiles that fit shared memory
#   with the fewest spills; not timed); pointer loads: a TMA box is at most 256 wide
# sm80: not measured (conservative tiles)
_NO_SKIP = 0.0
_TMA = True
_FWD_TABLE = ConfigTable({
    ("sm90", False): ((64, FwdConfig(64, 64, 4, 3, _NO_SKIP, _TMA)), (128, FwdConfig(128, 128, 8, 3, _NO_SKIP, _TMA)),
                      (256, FwdConfig(128, 32, 8, 3, _NO_SKIP, _TMA)), (512, FwdConfig(64, 32, 8, 2, _NO_SKIP)),
                      (1024, FwdConfig(32, 32, 8, 1, _NO_SKIP))),
    ("sm90", True): ((64, FwdConfig(64, 64, 4, 3, _NO_SKIP, _TMA)), (128, FwdConfig(64, 64, 4, 3, _NO_SKIP, _TMA)),
                     (256, FwdConfig(128, 32, 8, 3, _NO_SKIP, _TMA)), (512, FwdConfig(64, 32, 8, 2, _NO_SKIP)),
                     (1024, FwdConfig(32, 32, 8, 1, _NO_SKIP))),
    ("sm80", False): ((64, FwdConfig(128, 64, 4, 3, _NO_SKIP)), (128, FwdConfig(128, 64, 4, 2, _NO_SKIP)),
                      (256, FwdConfig(64, 64, 4, 2, _NO_SKIP)), (512, FwdConfig(64, 32, 4, 1, _NO_SKIP)),
                      (1024, FwdConfig(32, 16, 4, 1, _NO_SKIP))),
})
_FWD_TABLE[("sm80", True)] = _FWD_TABLE[("sm80", False)]
_BWD_TABLE = ConfigTable({
    "sm90": ((64, BwdConfig(TileConfig(32, 64, 4, 3), TileConfig(128, 64, 8, 3), use_tma=_TMA)),
             (128, BwdConfig(TileConfig(32, 64, 4, 3), TileConfig(128, 64, 8, 3), use_tma=_TMA)),
             (256, BwdConfig(TileConfig(32, 64, 8, 2), TileConfig(128, 32, 8, 2), use_tma=_TMA)),
             (512, BwdConfig(TileConfig(32, 32, 8, 1), TileConfig(32, 32, 8, 2)))),
    "sm80": ((64, BwdConfig(TileConfig(64, 64, 4, 2), TileConfig(64, 64, 4, 2))),
             (128, BwdConfig(TileConfig(64, 64, 4, 2), TileConfig(64, 64, 4, 2))),
             (256, BwdConfig(TileConfig(32, 64, 4, 1), TileConfig(32, 64, 4, 1))),
             (512, BwdConfig(TileConfig(32, 32, 4, 1), TileConfig(32, 32, 4, 1)))),
})


@lru_cache(maxsize=None)
def arch_class(device: torch.device) -> str:
    """'interpreter' for CPU tensors (the interpreter runs them), else 'sm90' for Hopper and newer, 'sm80' below."""
    if device.type != "cuda":
        return "interpreter"
    major, _ = torch.cuda.get_device_capability(device)
    return "sm90" if major >= 9 else "sm80"


def _lookup(table, key, head_dim: int):
    for max_dim, config in table[key]:
        if head_dim <= max_dim:
            return config
    return table[key][-1][1]


# Few query rows (decoding, speculative verification): 16-row tiles instead of 64/128, so a one-token query
# does not pay for 128 rows of tensor-core work.
# python benchmarks/bench_decode.py --sweep, 2026-11-30, 08441d7, H200
DECODE_MAX_ROWS = 16
_DECODE = FwdConfig(16, 128, 4, 3, _NO_SKIP)
_DECODE_LARGE = FwdConfig(16, 64, 4, 3, _NO_SKIP)
# head dims above 256: python tools/offline_compile.py --head-dim 512 --config 16,32,4,2, 2026-12-05, afef2ac,
# sm_90 offline (fits shared memory; not timed)
_DECODE_XL = FwdConfig(16, 32, 4, 2, _NO_SKIP)


# Decode tiles whose key tile shrank to a page pipeline deeper: the block-table load takes a stage of its own
# ahead of the K/V loads it addresses, so at num_stages 3-4 the loop keeps one K/V buffer in flight and at 5 two.
# python benchmarks/bench_decode.py --paged 0,64,256 --graph --sweep, 2026-11-30, 08441d7, H200
PAGED_DECODE_STAGES = 5


def page_key_block(block_n: int, page_size: int) -> int:
    """The key tile of a paged K/V cache for a kernel whose tile is block_n keys (a power of two): block_n where it
    divides page_size, else the largest power of two dividing page_size, so that each tile lies in one page and
    needs one block-table lookup (the Triton forward's paged_config and the Gluon forward's K / V boxes,
    ops/hopper.paged_key_rows)."""
    return block_n if page_size % block_n == 0 else page_size & -page_size


def paged_config(config: FwdConfig, page_size: int) -> FwdConfig:
    """The config for a paged K/V cache: key tiles shrink to page_key_block's (at least 16), and such decode tiles
    take PAGED_DECODE_STAGES; otherwise unchanged (pages of fewer than 16 keys: keys are gathered row by row)."""
    block_n = page_key_block(config.block_n, page_size)
    if block_n == config.block_n or block_n < 16:
        return config
    stages = config.num_stages
    if config.block_m <= DECODE_MAX_ROWS:
        stages = max(stages, PAGED_DECODE_STAGES)
    return replace(config, block_n=block_n, num_stages=stages)


def pack_gqa(seqlen_q: int, group_size: int) -> bool:
    """Whether the forward packs the group_size query heads of a KV head into one tile (decoding with GQA).

    With few query rows a tile is mostly empty and every query head re-reads its group's K/V; packed,
    each K/V tile is read once per KV head.
    """
    return group_size > 1 and seqlen_q <= DECODE_MAX_ROWS


# Dropout's in-kernel Philox needs registers: at head dim <= 128 the sm90 forward tiles spill, 128x64 w8 s3 least.
# python tools/offline_compile.py --dropout (sm_90, offline), 2026-11-30, 1724892
_DROPOUT_FWD = ConfigTable({"sm90": FwdConfig(128, 64, 8, 3, _NO_SKIP, _TMA)})


def fwd_config(arch: str, head_dim: int, causal: bool = False, seqlen_q: int = 1 << 30,
               dropout: bool = False) -> FwdConfig:
    if arch == "interpreter":
        config = _INTERPRETER_FWD
    elif seqlen_q <= DECODE_MAX_ROWS:
        config = _DECODE if head_dim <= 128 else _DECODE_LARGE if head_dim <= 256 else _DECODE_XL
    elif dropout and head_dim <= 128 and arch in _DROPOUT_FWD:
        config = _DROPOUT_FWD[arch]
    else:
        config = _lookup(_FWD_TABLE, (arch, causal), head_dim)
    return config if TMA_ALLOWED else replace(config, use_tma=False)


def forward_launch_config(arch: str, head_dim: int, causal: bool, seqlen_q: int, dropout: bool = False,
                          page_size: int = 0) -> FwdConfig:
    """The config the forward launches with (and the split-KV heuristic counts key blocks by): fwd_config,
    fitted to the page of a paged K/V cache when page_size > 0."""
    config = fwd_config(arch, head_dim, causal, seqlen_q, dropout)
    return paged_config(config, page_size) if page_size else config


def bwd_config(arch: str, head_dim: int) -> BwdConfig:
    config = _INTERPRETER_BWD if arch == "interpreter" else _lookup(_BWD_TABLE, arch, head_dim)
    return config if TMA_ALLOWED else replace(config, use_tma=False)


# Launch order of the forward and backward grids (kernels' grouped_tile_and_batch_head): programs run in groups
# of (batch, head) pairs whose shared operands (K and V for the forward and the dQ pass, Q and dO for the dK/dV
# pass) take at most L2_GROUP_BYTES[causal], all tiles of a group longest first, so a grid does not end on one
# head's longest tile; 0 gives one head per group (each head's tiles in turn). Without a causal mask every tile
# costs the same and the order only moves L2 traffic.
# python benchmarks/sweep_l2_groups.py, 2026-11-30, fedaf69 (--graph: 61dcdf5), H200
L2_GROUP_BYTES = ConfigTable({False: 0, True: 16 << 20})


@dataclass(frozen=True)
class HopperFwdConfig:
    """A config of the Gluon Hopper forward (kernels/hopper/fwd.py): two or three consumer warpgroups of 64 query
    rows and a TMA producer warp."""
    block_n: int         # keys per K/V stage
    stages: int          # K/V stages in shared memory
    consumer_regs: int   # registers per thread of each consumer warpgroup but the first (setmaxnreg)
    # one program per SM taking work items in turn (ops/hopper.forward_grid), else one program per tile
    persistent: bool = False
    pingpong: bool = False    # the consumers issue their wgmmas in alternation (kernels/hopper/fwd._wait_turn)
    # a fence keeps the softmax's exp2s ahead of the P V wait (kernels/hopper/fwd_softmax.hold_schedule)
    hold_schedule: bool = False
    # the A-1 rescale skip decided per warp (log2 units; kernels/hopper/fwd_softmax.rescale); 0: every block rescales
    rescale_threshold: float = 0.0
    consumers: int = 2   # consumer warpgroups of 64 query rows: a tile has 64 * consumers rows
    mask_by_residues: bool = False  # causal mask compared by column residues (kernels/hopper/fwd_softmax.mask_block)
    # persistent grids: the last, partial wave's items cut by key blocks among all programs, at least
    # tail_min_blocks per program (ops/hopper.tail_split)
    split_tail: bool = False
    tail_min_blocks: int = 8

    def __post_init__(self):
        if self.consumers not in (2, 3):
            raise ValueError(f"consumers must be 2 or 3, got {self.consumers}")
        if self.pingpong and self.consumers != 2:
            raise ValueError("pingpong takes turns between two consumers; consumers is 3")
        if self.tail_min_blocks < 1:
            raise ValueError(f"tail_min_blocks must be at least 1, got {self.tail_min_blocks}")


# keyed by (head dim, causal)
# flashtriton bench --modes fwd --timing kernels, 2026-12-04, f87894b, H200
_HOPPER_FWD_D128 = HopperFwdConfig(128, 2, 240, persistent=True, pingpong=True, hold_schedule=True,
                                   rescale_threshold=8.0)
_HOPPER_FWD_D256 = HopperFwdConfig(64, 2, 232, hold_schedule=True, rescale_threshold=8.0)
_HOPPER_FWD_D128_CAUSAL = replace(_HOPPER_FWD_D128, mask_by_residues=True)
_HOPPER_FWD_D128_FULL = replace(_HOPPER_FWD_D128, split_tail=True)
_HOPPER_FWD_D256_FULL = replace(_HOPPER_FWD_D256, persistent=True, split_tail=True)
_HOPPER_FWD_D256_CAUSAL = replace(_HOPPER_FWD_D256, mask_by_residues=True)
# 80 and 96 take d128's entries, 192 d256's: benchmarks/sweep_hopper_fwd.py --head-dims 80,96,192 candidates within
# 1% of the best, 2026-12-06, 6d06c78, H100 (without tail cuts)
# their non-causal tail cuts: on against off in one process (1-6% faster), 2026-12-07, c2fae50, H100
HOPPER_FWD = ConfigTable({(64, False): HopperFwdConfig(128, 2, 160, persistent=True, consumers=3),
                         (64, True): HopperFwdConfig(128, 2, 232, persistent=True),
                         (80, False): _HOPPER_FWD_D128_FULL, (80, True): _HOPPER_FWD_D128_CAUSAL,
                         (96, False): _HOPPER_FWD_D128_FULL, (96, True): _HOPPER_FWD_D128_CAUSAL,
                         (128, False): _HOPPER_FWD_D128_FULL, (128, True): _HOPPER_FWD_D128_CAUSAL,
                         (192, False): _HOPPER_FWD_D256_FULL, (192, True): _HOPPER_FWD_D256_CAUSAL,
                         (256, False): _HOPPER_FWD_D256_FULL, (256, True): _HOPPER_FWD_D256_CAUSAL})
HOPPER_FWD_HEAD_DIMS = tuple(sorted({head_dim for head_dim, _ in HOPPER_FWD}))
# Calls whose V tiles are narrower than Q's, keyed by (Q's tile dim, V's tile dim, causal), where HOPPER_FWD's entry
# for Q's tile dim is not the best: (192, 128) (MLA-style) keeps d128's registers per consumer (a 64 x 128 output
# and a 64 x 128 score accumulator) and takes its 128-key blocks, with O staged in Q's first chunk for shared memory
# (kernels/hopper/fwd.py's O_IN_Q); no tail cut (ops/hopper.launch_fwd cuts none where V's tiles are not Q's). d192's
# entry: 64-key blocks, 0.81-0.85x FA4 on this shape (BENCHMARKS.md).
# python tools/offline_compile.py --kernel fwd-hopper --head-dim 192 --head-dim-v 128, 2026-12-07, sm_90 offline
# (fits shared memory, no stack), not timed
HOPPER_FWD_NARROW_V = ConfigTable({(192, 128, False): _HOPPER_FWD_D128,
                                   (192, 128, True): _HOPPER_FWD_D128_CAUSAL})


@dataclass(frozen=True)
class HopperFwdD512Config:
    """A config of the Gluon forward at head dims 257-512 (kernels/hopper/fwd_d512.py): two consumer warpgroups
    splitting the head dim of 64 query rows, and a TMA producer warp."""
    block_n: int         # keys per K / V block
    stages: int          # K / V stages in shared memory
    consumer_regs: int   # registers per thread of the second consumer warpgroup


# keyed by whether a window (causal included) applies: the largest key blocks and stages whose tiles fit shared
# memory (Q 64 KiB, K and V 32 KiB per stage at 32 keys, the partial scores 32 KiB):
# python tools/offline_compile.py --kernel fwd-d512-hopper, 2026-12-07, e4f61bd, sm_90 offline (not timed)
HOPPER_FWD_D512 = ConfigTable({False: HopperFwdD512Config(32, 2, 240), True: HopperFwdD512Config(32, 2, 240)})
# With dropout (its Philox draws need registers), where the entry above spills: keyed as HOPPER_FWD.
# python tools/offline_compile.py --kernel fwd-hopper --head-dim 64 --dropout --hopper-config 128,2,232,1,0,0,0.0,2,
# 2026-12-07, 23cd64e, sm_90 offline: 40 B of stack against 296 with three consumers of 160 registers (not timed)
HOPPER_FWD_DROPOUT = ConfigTable({(64, False): HopperFwdConfig(128, 2, 232, persistent=True)})
# FP8 calls (e4m3 q and k, fp16 V: Q and K tiles of half the bytes, so more stages fit), where a config of their own
# measured faster than the entry above: keyed as HOPPER_FWD. Empty until python benchmarks/sweep_hopper_fwd.py --fp8
# runs on a GPU.
HOPPER_FWD_FP8 = ConfigTable({})
# The Gluon forward's tiles by head dim: the widths of the column chunks its shared tiles and wgmmas move (powers of
# two, which Gluon's shared layouts need; the kernel chains one S wgmma per chunk and keeps an output accumulator
# per chunk of V's head dim). Every HOPPER_FWD head dim has an entry.
HOPPER_FWD_CHUNKS = ConfigTable({64: (64, ), 80: (64, 16), 96: (64, 32), 128: (128, ), 192: (128, 64),
                                 256: (256, )})


def _tile_dim(head_dim: int, tile_dims) -> Optional[int]:
    """The smallest of the sorted tile_dims that holds head_dim, None above them all."""
    return next((tile for tile in tile_dims if head_dim <= tile), None)


def hopper_fwd_tile_dim(head_dim: int) -> Optional[int]:
    """The head dim of the Gluon forward's tiles for head_dim: the smallest HOPPER_FWD_HEAD_DIMS entry that holds it
    (72 runs on 80-wide tiles, 112 on 128-wide, 160 on 192-wide: the tensor descriptors read the missing columns of
    Q, K and V as zeros and never store them), None above 256."""
    return _tile_dim(head_dim, HOPPER_FWD_HEAD_DIMS)


@dataclass(frozen=True)
class HopperBwdConfig:
    """A config of the Gluon Hopper backward (kernels/hopper/bwd.py at head dims 64 and 128, kernels/hopper/bwd_d256.py
    at 256): two consumer warpgroups and a TMA producer warp per key block."""
    query_rows: int      # rows per Q / dO block (the M of the S and dP wgmmas)
    stages: int          # Q / dO stages in shared memory
    consumer_regs: int   # registers per thread of the second consumer warpgroup
    # the causal values (False, True) whose calls compute the scores key-major, S^T = K Q^T, so that P^T and dS^T
    # feed dV and dK from registers (kernels/hopper/bwd.py; calls with ALiBi always do, calls with dropout never: the
    # forward's mask follows the row-major tiles)
    key_major: tuple = ()


# keyed by head dim; 64-128: python benchmarks/sweep_hopper_bwd.py --head-dims 96,64,80 and --head-dims 128
# --deterministic, 2026-12-07, c59df22, H100 (192 and 256: flashtriton bench --modes bwd, 2026-12-01, a536212, H200)
HOPPER_BWD = ConfigTable({64: HopperBwdConfig(64, 3, 248),
                          80: HopperBwdConfig(64, 2, 240, (False, True)),
                          96: HopperBwdConfig(64, 2, 240, (False, True)),
                          128: HopperBwdConfig(64, 2, 248, (False, True)),
                          192: HopperBwdConfig(64, 2, 240), 256: HopperBwdConfig(64, 2, 240)})
HOPPER_BWD_HEAD_DIMS = tuple(sorted(HOPPER_BWD))
# The Gluon backward's tiles by head dim (HOPPER_FWD_CHUNKS' rule): K, V, Q and dO move in these column chunks, S and
# dP chain a wgmma per chunk, dK / dV keep an accumulator per chunk, and with two chunks each consumer adds one
# chunk's dQ features. 192 and 256 are kernels/hopper/bwd_d256.py's (dK / dV only; at 256 Q / dO move in halves).
HOPPER_BWD_CHUNKS = ConfigTable({64: (64, ), 80: (64, 16), 96: (64, 32), 128: (128, ), 192: (128, 64),
                                 256: (256, )})


@dataclass(frozen=True)
class HopperBwdDqConfig:
    """A config of the Gluon Hopper dQ kernel (kernels/hopper/bwd_dq.py): two consumer warpgroups of 64 query rows
    and a TMA producer warp streaming K / V blocks."""
    keys: int            # keys per K / V block (the N of the S and dP wgmmas)
    stages: int          # K / V stages in shared memory
    consumer_regs: int   # registers per thread of the second consumer warpgroup


# keyed by the tiles' head dim: where the Gluon dQ kernel follows the dK / dV kernel (kernels/hopper/bwd_d256.py);
# elsewhere that kernel leaves dQ to the Triton dQ kernel. Not swept: python tools/offline_compile.py --kernel
# bwd-dq-hopper --head-dim 192 (2026-12-07, sm_90 offline: fits shared memory, no spills)
HOPPER_BWD_DQ = ConfigTable({192: HopperBwdDqConfig(64, 2, 240)})


def hopper_bwd_tile_dim(head_dim: int) -> Optional[int]:
    """The head dim of the Gluon backward's tiles for head_dim (hopper_fwd_tile_dim's rule over HOPPER_BWD): the
    descriptors read the missing columns as zeros, dK / dV are stored and dQ reduced within head_dim only."""
    return _tile_dim(head_dim, HOPPER_BWD_HEAD_DIMS)


def heads_per_l2_group(bytes_per_head: int, batch_heads: int, causal: bool) -> int:
    """(batch, head) pairs per launch-order group: as many as fit L2_GROUP_BYTES[causal], at least 1."""
    return max(1, min(batch_heads, L2_GROUP_BYTES[causal] // max(1, bytes_per_head)))


def block_d(head_dim: int) -> int:
    """Head dim rounded up to a power of two, at least 16 (the smallest tl.dot operand)."""
    return max(16, 1 << (head_dim - 1).bit_length())


# Paged decode wants about twice the resident programs of a contiguous cache: each key tile's block-table
# load sits in front of its K/V loads.
# python benchmarks/bench_decode.py --splits 0,1,2,4,8,16,32,64 --graph, 2026-11-30, 2622019, H200
PAGED_PROGRAMS_PER_SM = 2


def num_splits_heuristic(num_programs: int, num_key_blocks: int, num_sms: int, max_splits: int = 128) -> int:
    """How many parts to split each row's keys into (split-KV), as a pure function of the launch shape.

    num_programs is the unsplit grid (query tiles x batch x heads); num_sms the programs the GPU should
    run at once (SM count, times PAGED_PROGRAMS_PER_SM for paged caches). Splitting pays only when the
    grid leaves them idle: below 80% of one wave, pick the smallest split count whose last wave is at
    least 85% as full as the best one, skipping counts that give the same number of key blocks per split.
    """
    if num_programs >= 0.8 * num_sms or num_key_blocks <= 1:
        return 1
    max_splits = max(1, min(max_splits, num_sms, num_key_blocks))

    def wave_efficiency(splits: int) -> float:
        waves = num_programs * splits / num_sms
        return waves / math.ceil(waves)

    def blocks_per_split(splits: int) -> int:
        return math.ceil(num_key_blocks / splits)

    eligible = [s for s in range(1, max_splits + 1) if s == 1 or blocks_per_split(s) != blocks_per_split(s - 1)]
    best = max(wave_efficiency(s) for s in eligible)
    return next(s for s in eligible if wave_efficiency(s) >= 0.85 * best)


def multiprocessor_count(device: torch.device) -> int:
    """SM count of a CUDA device; 8 elsewhere (so interpreted CPU runs exercise the split path)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


class _Settings(types.ModuleType):
    """This module's type: a replaced attribute (a table, a switch, a function) counts in `changes`."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name != "changes":
            _count_change()


sys.modules[__name__].__class__ = _Settings

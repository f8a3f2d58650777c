"""Kernel tile configurations as data, and the pure functions that pick them.

Each table entry names the measurement that justified it (BENCHMARKS.md / docs/perf-notes.md).
Entries are keyed by arch class ("interpreter", "sm80", "sm90", ...) and head-dim bucket.
FLASHTRITON_RESCALE_THRESHOLD (read once) overrides the forward's A-1 rescale threshold;
0 disables the skip (every tile rescales). FLASHTRITON_TMA=0 (read once) turns tensor descriptors off in
every config (pointer loads only; the Gluon Hopper forward, which needs them, is off then too): for debugging,
and for tools like compute-sanitizer's initcheck that may not see the bulk (TMA) stores as writes.
FLASHTRITON_GLUON=0 (read once) keeps every forward on the Triton kernel.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from functools import lru_cache

import torch


@dataclass(frozen=True)
class TileConfig:
    block_m: int       # query rows per tile
    block_n: int       # key rows per tile
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class FwdConfig(TileConfig):
    rescale_threshold: float = 8.0  # log2 units; FA4's value for 16-bit inputs
    use_tma: bool = False           # tensor descriptors for dense layouts (sm90+)


@dataclass(frozen=True)
class BwdConfig:
    dkdv: TileConfig   # one program per key tile, looping over query tiles
    dq: TileConfig     # one program per query tile, looping over key tiles
    preprocess_block: int = 128
    use_tma: bool = False  # Q/dO (dK/dV) and K/V (dQ) tiles through in-kernel tensor descriptors (sm90+)
    dq_atomic: bool = False  # dQ added with atomics by the dK/dV kernel, no dQ pass (not with deterministic=True)


def _env_float(name: str):
    value = os.environ.get(name)
    return None if value in (None, "") else float(value)


RESCALE_THRESHOLD_OVERRIDE = _env_float("FLASHTRITON_RESCALE_THRESHOLD")
TMA_ALLOWED = os.environ.get("FLASHTRITON_TMA", "1") != "0"

# Interpreter: small tiles so that interpreter-sized tests (seqlens up to ~300) cross many blocks.
_INTERPRETER_FWD = FwdConfig(block_m=64, block_n=64, num_warps=4, num_stages=1)
_INTERPRETER_BWD = BwdConfig(TileConfig(64, 64, 4, 1), TileConfig(64, 64, 4, 1), preprocess_block=64)

# GPU tables, keyed by (arch class, causal): ((max head dim, config), ...), first match wins.
# sm90 entries: benchmarks/sweep_configs.py on the H200, 2026-11-30 (docs/perf-notes.md has the numbers);
# bf16, shapes (4, 4096, 16, 128), (4, 4096, 32, 64), (4, 4096, 8, 256). Forward: tensor descriptors won
# on every row (d128: 572 vs 538 TF/s; d128 causal with 64x64 tiles: 489 vs 373). The A-1 rescale skip is
# off on GPUs: expressed in Triton it needs a tile-wide reduction and branch per key block, which cost 15%
# at head dim 128 (443 vs 519 TF/s). Head dim 256 (sweep of 2026-11-30, commit d8c9095, shape (4, 4096, 8, 256)):
# forward 128x32 w8 s3 with descriptors 558 / 461 TF/s (causal) vs 401 / 351 for 128x64 w8 s2 (offline compile:
# 128x32 s3 is the one candidate without spills); backward dQ 128x32 w8 s2 185 / 162 vs 141 / 125 for 64x32 w4.
# Backward tensor descriptors (sweep of 2026-11-30, commit 2622019, (4, 4096, 16, 128)): the previous entry
# (dK/dV 64x128 w8 s2) 331 -> 363 TF/s non-causal, 281 -> 286 causal; with dK/dV 32x64 w4 s3 379 / 330 (the
# offline compile shows every dK/dV tile with BLOCK_N >= 64 and 8 warps spilling; dQ 128x64 w8 s3 no longer
# spills). Head dim 64 with descriptors 295 / 256, head dim 256 190 (non-causal; causal 162 either way).
# sm80 entries are conservative guesses, not measured.
_NO_SKIP = 0.0
_TMA = True
_FWD_TABLE = {
    ("sm90", False): ((64, FwdConfig(64, 64, 4, 3, _NO_SKIP, _TMA)), (128, FwdConfig(128, 128, 8, 3, _NO_SKIP, _TMA)),
                      (256, FwdConfig(128, 32, 8, 3, _NO_SKIP, _TMA))),
    ("sm90", True): ((64, FwdConfig(64, 64, 4, 3, _NO_SKIP, _TMA)), (128, FwdConfig(64, 64, 4, 3, _NO_SKIP, _TMA)),
                     (256, FwdConfig(128, 32, 8, 3, _NO_SKIP, _TMA))),
    ("sm80", False): ((64, FwdConfig(128, 64, 4, 3, _NO_SKIP)), (128, FwdConfig(128, 64, 4, 2, _NO_SKIP)),
                      (256, FwdConfig(64, 64, 4, 2, _NO_SKIP))),
}
_FWD_TABLE[("sm80", True)] = _FWD_TABLE[("sm80", False)]
_BWD_TABLE = {
    "sm90": ((64, BwdConfig(TileConfig(32, 64, 4, 3), TileConfig(128, 64, 8, 3), use_tma=_TMA)),
             (128, BwdConfig(TileConfig(32, 64, 4, 3), TileConfig(128, 64, 8, 3), use_tma=_TMA)),
             (256, BwdConfig(TileConfig(32, 64, 8, 2), TileConfig(128, 32, 8, 2), use_tma=_TMA))),
    "sm80": ((64, BwdConfig(TileConfig(64, 64, 4, 2), TileConfig(64, 64, 4, 2))),
             (128, BwdConfig(TileConfig(64, 64, 4, 2), TileConfig(64, 64, 4, 2))),
             (256, BwdConfig(TileConfig(32, 64, 4, 1), TileConfig(32, 64, 4, 1)))),
}


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
# does not pay for 128 rows of tensor-core work. bench_decode.py --sweep (H200, commit 08441d7, contiguous cache):
# 16x128 w4 s3 4.18 / 4.28 / 4.20 / 3.77 TB/s at (64, 4k) / (16, 16k) / (4, 64k) / (1, 128k), within 1% of the
# best candidate on every row (16x128 s5 does not fit in shared memory).
DECODE_MAX_ROWS = 16
_DECODE = FwdConfig(16, 128, 4, 3, _NO_SKIP)
_DECODE_LARGE = FwdConfig(16, 64, 4, 3, _NO_SKIP)


# Decode tiles whose key tile shrank to a page pipeline deeper: the block-table load takes a stage of its own
# ahead of the K/V loads it addresses, so at num_stages 3-4 the loop keeps one K/V buffer in flight and at 5
# two (offline sm_90 compile, docs/perf-notes.md). bench_decode.py --paged 0,64,256 --graph --sweep (H200,
# commit 08441d7, GQA 32/8, d128 bf16, copy 4.25 TB/s), page 64, 16x64 tiles: s5 3.64 / 4.13 / 3.99 / 3.47 TB/s
# at (64, 4k) / (16, 16k) / (4, 64k) / (1, 128k) against s3 3.34 / 3.73 / 3.35 / 3.09. Page 256 keeps its
# 16x128 s3 tile (3.72 / 4.17 / 4.05 / 3.53; s5 there: 4.04 / 4.07 / 3.86 / 3.25).
PAGED_DECODE_STAGES = 5


def paged_config(config: FwdConfig, page_size: int) -> FwdConfig:
    """The config for a paged K/V cache: key tiles shrink to the largest power of two dividing page_size
    (at least 16), so each tile lies in one page and needs one block-table lookup, and such decode tiles
    take PAGED_DECODE_STAGES; otherwise unchanged (keys are gathered row by row)."""
    largest_divisor = page_size & -page_size
    if page_size % config.block_n == 0 or largest_divisor < 16:
        return config
    stages = config.num_stages
    if config.block_m <= DECODE_MAX_ROWS:
        stages = max(stages, PAGED_DECODE_STAGES)
    return replace(config, block_n=largest_divisor, num_stages=stages)


def pack_gqa(seqlen_q: int, group_size: int) -> bool:
    """Whether the forward packs the group_size query heads of a KV head into one tile (decoding with GQA).

    With few query rows a tile is mostly empty and every query head re-reads its group's K/V; packed,
    each K/V tile is read once per KV head.
    """
    return group_size > 1 and seqlen_q <= DECODE_MAX_ROWS


# Dropout's in-kernel Philox needs registers: at head dim <= 128 the sm90 forward tiles spill (offline sm_90
# compile, tools/offline_compile.py --dropout: 128x128 w8 368 B, 64x64 w4 48 B) where 128x64 w8 s3 spills 8 B.
_DROPOUT_FWD = {"sm90": FwdConfig(128, 64, 8, 3, _NO_SKIP, _TMA)}


def fwd_config(arch: str, head_dim: int, causal: bool = False, seqlen_q: int = 1 << 30,
               dropout: bool = False) -> FwdConfig:
    if arch == "interpreter":
        config = _INTERPRETER_FWD
    elif seqlen_q <= DECODE_MAX_ROWS:
        config = _DECODE if head_dim <= 128 else _DECODE_LARGE
    elif dropout and head_dim <= 128 and arch in _DROPOUT_FWD:
        config = _DROPOUT_FWD[arch]
    else:
        config = _lookup(_FWD_TABLE, (arch, causal), head_dim)
    if RESCALE_THRESHOLD_OVERRIDE is not None:
        config = replace(config, rescale_threshold=RESCALE_THRESHOLD_OVERRIDE)
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
# head's longest tile; 0 gives one head per group (each head's tiles in turn). benchmarks/sweep_l2_groups.py
# (H200, commit fedaf69, bf16, TF/s at 0 / 4 / 8 / 16 / 32 MiB / one group): causal forward 4x4096x16x128
# 413 / 429 / 449 / 449 / 445 / 390, 1x16384 479 / 479 / 487 / 488 / 489 / 458, d64 349 / 352 / 374 / 373 /
# 373 / 310, d256 449 / 451 / 462 / 487 / 482 / 460, varlen 16k-token mix 338 / 386 / 389 / 397 / 399 / 359;
# causal backward 317 -> 326 (d128), 231 -> 238 (d64), 160 -> 166 (d256) at 16 MiB. Without a causal mask every
# tile costs the same and the order only moves L2 traffic: 0 to 8 MiB are within 1%, 16 MiB loses up to 5%
# (4x4096 d128 forward 534 / 539 / 521 / 515), one group 5-30%. The same forward sweep from CUDA graphs (commit
# 61dcdf5, 0 / 4 / 8 / 16 MiB) agrees at 1x16384 (452 -> 470), d64 (341 -> 362), d256 (429 -> 463) and varlen
# (374 -> 390) but not at 4x4096 d128 (435 / 426 / 408 / 416) or 16x1024 (315 / 328 / 323 / 292): on those two
# rows the order is worth +-5%, about the noise between runs.
L2_GROUP_BYTES = {False: 0, True: 16 << 20}


# Hopper forward in Gluon (kernels/fwd_hopper.py, warp-specialized: two or three consumer warpgroups of 64 query rows
# and a TMA producer warp), keyed by (head dim, causal): key tile, K/V stages, consumer registers (setmaxnreg),
# persistent grid, the schedule's options.
# benchmarks/sweep_hopper_fwd.py on the H200 (2026-11-30, seventh session, bf16, TF/s non-causal / causal, SDPA
# cuDNN of the same run in brackets): in-order consumer schedule r232 -> overlapped r232 / overlapped r240:
#   d128 16x1024x16   473 / 346 -> 516 / 247 / 489 / 369   (576 / 426)
#   d128 4x4096x16    536 / 490 -> 586 / 517 / 587 / 537   (611 / 538)
#   d128 1x16384x16   551 / 557 -> 618 / 594 / 618 / 613   (582 / 572)
#   d64  4x4096x32    435 / 388 -> 447 / 396 (r232 only)   (452 / 413)
#   d256 4x4096x8     605 / 558 -> 651 / 613 / 641 / 607   (659 / 567)
# so the kernel keeps only the overlapped schedule. 3 stages: no better (d128 585 / 519 at 4x4096); d64 key tiles
# 64: 381 / 349. The d128 causal overlapped kernel spills at r232 (tools/offline_compile.py: 24 B of stack; none at
# r240): the 16x1024 causal collapse.
# Persistent grid (eighth session, 2026-12-01, scratch comparison in one process, best of 2 medians, one program
# per tile -> one per SM, cuDNN in brackets): non-causal d128 16x1024 502 -> 536 (606), 4x4096 576 -> 587 (595),
# 1x16384 602 -> 611 (594), d64 433 -> 439 (455), d256 640 -> 640 (640). Causal with single tiles taken in turn:
# 351 -> 367 (417), 523 -> 464 (516), 603 -> 508 (554), d64 392 -> 394 (420), d256 591 -> 393 (555) (a static split
# of tiles of different lengths); with tiles paired longest + shortest (ops/hopper_fwd.grid, second run):
# 16x1024 328 -> 373 (419), 4x4096 509 -> 534 (516), 1x16384 595 -> 585 (551), d64 385 -> 403 (416), d256 593 -> 588
# (566). d256 stayed one program per tile (its O is staged in Q, so a tile's end cannot overlap the next's start;
# non-causal d256 is persistent since the eighteenth session, below).
# Ping-pong (eleventh session, 2026-12-01, sweep_hopper_fwd.py, same process, off -> on at the table's registers,
# cuDNN in brackets): d128 16x1024 541 -> 544 (574) and causal 425 (424; the "off" reading, 262, was host-bound: an
# eager call of this size is ~160 us of GPU time), 4x4096 587 -> 597 (618) / 551 -> 551 (522), 1x16384 611 -> 610
# (623) / 597 -> 600 (565); d64 446 -> 434 (455) / 423 -> 407 (418); d256 659 -> 628 (665) / 590 -> 586 (574).
# ablate_kernel.py at 16x1024 (same process): 538 -> 547 and causal 412 -> 428. On at d128 only.
# Thirteenth session (arrivals without BAR.SYNC, kernels/hopper_sync.py; ablate_kernel.py kernel time, two rounds):
# on at d64 / d256 still 2-4% slower (442 / 461, 408 / 424; 691 / 704, 651 / 661 TF/s on / off).
# hold_schedule (fourteenth session, ablations/fwd_hopper.py, kernel time, two processes; on / off as the median of
# the readings of each kernel, 2-4 each): d128 4x4096 682 / 668 and causal 626 / 614, 1x16384 658 / 640, causal 657 /
# 652, 16x1024 level; d64 449 / 470 and causal 414 / 439, d256 706 / 709 and causal 649 / 667: on at d128 only
# (docs/perf-notes.md).
# rescale_threshold (fifteenth session, the A-1 skip decided per warp by a vote; ablations/fwd_hopper.py, kernel time,
# two rounds, skip / none): d128 16x1024 605-610 / 597-599 and causal 438-440 / 431, 4x4096 677-678 / 674-675 and 635 /
# 617, 1x16384 641-677 / 651-666 and 668-693 / 624-648; d64 453-454 / 433-469 and causal 424-425 / 439-440; d256
# 688-691 / 693-698 and causal 667-671 / 648-653: on at d128 only (docs/perf-notes.md).
# Sixteenth session (ablations/fwd_hopper.py, kernel time, four processes in two calls, TF/s): the skip with the
# fence at d256 757, 754 / 710, 707 without either and causal 699, 697 / 677, 675 (the skip alone level, with
# ping-pong instead 689 / 683): both on at d256. Three consumers (192-row tiles, 160 registers) at d64 514-520 / 440-
# 471 with two, causal 428-433 / 430-440 (the diagonal's masked waste grows with the tile): three for non-causal d64
# only, hence the (head dim, causal) keys.
# Eighteenth session (key blocks now visited last first; ablations/fwd_hopper.py, kernel time, --rounds 3, median):
# a persistent grid at d256 762.7 / 754.1 one program per tile non-causal, causal 694.2 / 698.2 (the library bench
# after the switch: 764.3 against 755.6-756.6 in two earlier runs of the day): persistent for non-causal d256 only.
# Three K / V stages at d64 level (541.9 / 541.8, causal 440.2 / 442.3); two consumers at d64 non-causal still far
# behind three (458.0 / 541.8).
# Twentieth session (ablations/fwd_hopper.py "causal mask by column residues", kernel time, --rounds 3, median, as is
# / residues): d128 16x1024 causal 455.9 / 461.1, 4x4096 646.1 / 647.2, 1x16384 653.6 / 665.1 (+-2%); d256 causal
# 685.1 / 714.7; d64 causal 442.3 / 425.2: by residues at d128 and d256 only. In the same call FA4's d64 causal shape
# (three consumers, one program per tile) read 415.0-415.3 and one program per tile alone 409.0: neither taken.
# The row max as a tree (ablations/fwd_hopper.py "row max in one chain" against it, kernel time, --rounds 3, tree /
# chain): d128 16x1024 634.5 / 629.4 (+-0.1%), 4x4096 702.9 / 693.2 (+-3%), 1x16384 653.5 / 650.1 (+-3%); causal
# 485.9 / 489.0, 652.8 / 660.3, 661.6 / 649.9; d64 515.7 / 539.9 and causal 412.6 / 438.3; d256 752.3 / 760.5 and
# causal 722.4 / 726.1: a tree at d128 non-causal only. The row sums as a tree too: -1.5 to +1.7%, not taken.
# Twenty-fourth session, the same pair at fe18e48 (kernel time, --rounds 3, tree / chain): d128 16x1024 644.8 / 651.9
# (+-0.1%), 4x4096 726.9 / 742.9 (+-1.3%), 1x16384 678.9 / 696.8 (+-4%): the chain at d128 non-causal too, so the
# tree is in no entry now (ablations/fwd_hopper.py "row max as a tree at d128" prices it again).
# Twenty-first session: the last, partial wave of a persistent grid cut by key blocks among all programs (split_tail;
# ops/hopper_fwd.tail_split; ablations/fwd_hopper.py "tail not split" etc., kernel time, --rounds 3, two calls, TF/s
# cut / whole tiles): d128 4x4096 726.2 / 711.4 and 708.4 / 698.4, 1x16384 686.3 / 676.2 and 681.1 / 628.0 (+-4%),
# d256 782.8 / 760.0 and 779.4 / 746.0; d64 530.9 / 528.6 and 528.2 / 526.1 (level), d64 causal 440.4 / 435.5 and
# 438.1 / 441.9 (level); 16x1024 with shares of 4 key blocks 624.8 / 646.4 and 601.7 / 632.0 (shares of 8: no cut
# there); d128 causal 427.9 / 474.3 and 422.5 / 470.3 at 16x1024, 647.5 / 662.9 and 632.6 / 645.3 at 4x4096. On at
# d128 and d256 non-causal, shares of 8 blocks at least.
@dataclass(frozen=True)
class HopperFwdConfig:
    block_n: int         # keys per K/V stage
    stages: int          # K/V stages in shared memory
    consumer_regs: int   # registers per thread of each consumer warpgroup but the first (setmaxnreg)
    persistent: bool = False  # one program per SM taking work items in turn (ops/hopper_fwd.grid), else one per tile
    pingpong: bool = False    # the consumers issue their wgmmas in alternation (kernels/fwd_hopper._wait_turn)
    hold_schedule: bool = False  # a fence keeps the softmax ahead of the P V wait (kernels/fwd_hopper._hold_schedule)
    rescale_threshold: float = 0.0  # the A-1 rescale skip's (log2 units; kernels/fwd_hopper._rescale), 0: none
    consumers: int = 2   # consumer warpgroups of 64 query rows: a tile has 64 * consumers rows
    mask_by_residues: bool = False  # causal mask compared by column residues (kernels/fwd_hopper._mask_block)
    row_max_tree: bool = False  # the softmax's row max as a tree, not Triton's chain (kernels/fwd_hopper._row_max)
    # persistent grids: the last, partial wave's items cut by key blocks among all programs, at least
    # tail_min_blocks per program (ops/hopper_fwd.tail_split)
    split_tail: bool = False
    tail_min_blocks: int = 8

    def __post_init__(self):
        if self.consumers not in (2, 3):
            raise ValueError(f"consumers must be 2 or 3, got {self.consumers}")
        if self.pingpong and self.consumers != 2:
            raise ValueError("pingpong takes turns between two consumers; consumers is 3")
        if self.tail_min_blocks < 1:
            raise ValueError(f"tail_min_blocks must be at least 1, got {self.tail_min_blocks}")


_HOPPER_FWD_D128 = HopperFwdConfig(128, 2, 240, persistent=True, pingpong=True, hold_schedule=True,
                                   rescale_threshold=8.0)
_HOPPER_FWD_D256 = HopperFwdConfig(64, 2, 232, hold_schedule=True, rescale_threshold=8.0)
# keyed by (head dim, causal)
HOPPER_FWD = {(64, False): HopperFwdConfig(128, 2, 160, persistent=True, consumers=3),
              (64, True): HopperFwdConfig(128, 2, 232, persistent=True),
              (128, False): replace(_HOPPER_FWD_D128, split_tail=True),
              (128, True): replace(_HOPPER_FWD_D128, mask_by_residues=True),
              (256, False): replace(_HOPPER_FWD_D256, persistent=True, split_tail=True),
              (256, True): replace(_HOPPER_FWD_D256, mask_by_residues=True)}
HOPPER_FWD_HEAD_DIMS = tuple(sorted({head_dim for head_dim, _ in HOPPER_FWD}))


def hopper_rescale_threshold(config: HopperFwdConfig) -> float:
    """The Gluon forward's rescale-skip threshold (log2 units, 0: none): the config's, or
    FLASHTRITON_RESCALE_THRESHOLD's where set (as fwd_config applies it to the Triton forward)."""
    return config.rescale_threshold if RESCALE_THRESHOLD_OVERRIDE is None else max(RESCALE_THRESHOLD_OVERRIDE, 0.0)


GLUON_ALLOWED = os.environ.get("FLASHTRITON_GLUON", "1") != "0"


# Hopper backward in Gluon (kernels/bwd_hopper.py: two consumer warpgroups of 64 keys, dQ by TMA reductions), keyed
# by head dim: query rows per Q / dO block, Q / dO stages, consumer registers (setmaxnreg). H200, 2026-12-01, bf16
# backward TF/s non-causal / causal, one process (scratch sweep; Triton backward and SDPA FLASH / cuDNN in brackets):
#   first design (S^T per 32-row block, dQ^T): d128 4x4096 303 / 280, 1x16384 314 / 318, d64 217 / 203
#   (Triton 370 / 345, 388 / 390, 285 / 238)
#   this design (64-row blocks, rows as M): 2 stages d128 16x1024 262 / 173, 4x4096 330 / 257, 1x16384 352 / 293,
#   d64 227 / 244; 3 stages 254 / 173, 317 / 259, 340 / 298, 242 / 225
#   (Triton 306 / 218, 362 / 332, 382 / 384, 282 / 236; flash 262 / 206, 303 / 276, 312 / 318, 280 / 248)
# dQ added with 4-wide vector atomics (a blocked layout and stated alignment: partition arguments carry none), 16
# per consumer and iteration instead of 64 scalar ones: d128 266 / 177, 331 / 268, 353 / 308; d64 247 / 275 (3
# stages 278 / 251); 248 registers: 262 / 184, 329 / 286, 354 / 332 (Triton 307 / 218, 366 / 336, 386 / 383, 282 /
# 237). ncu (4x4096 d128, before the vector atomics): 15.2 cycles between issues per warp, 6.0 of them waiting on
# L1TEX (local-memory spills, LSE / delta loads, atomics); occupancy 12 warps per SM. Offline
# (tools/offline_compile.py --kernel bwd-hopper): d128 200 B of stack, both consumers reloading loop-invariant
# 64-bit addresses every iteration; d64 8 B. Slower than the Triton backward on every d128 row then.
# Ninth session (2026-12-01, same process each step, TF/s non-causal / causal, Triton backward in brackets):
# ablation of that kernel: without the dQ atomics 616 / 464 at d128 4x4096 (334 / 268 with), d64 458 / 431 (247 /
# 278). dQ by TMA reductions through a shared fp32 tile: d128 4x4096 373 / 317 (359 / 329), 1x16384 396 / 362, d64
# 388 / 359 (283 / 238). LSE / delta by TMA with Q / dO, then 248 registers (d128): 4x4096 398 / 324, 403 / 369
# (358 / 327); 1x16384 415 / 369, 414 / 408. dQ product one block late (d128, so the consumers stop waiting for
# each other's dS every block): 4x4096 490 / 430 at 248 registers (490 / 408 at 240; Triton 363 / 333), 1x16384
# 525 / 492 (Triton 382 / 373), 16x1024 284 / 264 (Triton 305 / 221). d64 keeps dQ in the same block (its consumers
# never wait for each other; one block late it read 371 / 339). On by default; FLASHTRITON_GLUON_BWD=0 turns it off.
# Tenth session: a persistent grid (key blocks paired under the causal mask, one program per SM) read 383 / 227,
# 485 / 342, 521 / 393, d64 381 / 340 against 393 / 266, 487 / 419, 520 / 481, 383 / 342 for one program per key
# block (same process; its extra loops spilled): not kept (docs/perf-notes.md).
@dataclass(frozen=True)
class HopperBwdConfig:
    query_rows: int      # rows per Q / dO block (the M of the S and dP wgmmas)
    stages: int          # Q / dO stages in shared memory
    consumer_regs: int   # registers per thread of the second consumer warpgroup


# Head dim 256 (kernels/bwd_hopper_d256.py, tenth session): 64-key programs, both consumers in phase; offline 231 KB
# of shared memory, the worker consumer (240 registers) 42 / 47 static local loads non-causal / causal. H200, same
# process (bench_hopper_bwd.py, 4x4096x8x256): 284 / 240 TF/s against 190 / 166 for the Triton backward (FA2 255 /
# 232, cuDNN 379 / 362).
# Eleventh session: an ablation (benchmarks/ablations/bwd_hopper_d256.py) put the cost in dQ: without its TMA
# reductions 437 / 357, without dQ at all 595 / 531, the reductions' serialization not the cause (no wait for their
# shared-memory reads: 285). dQ by the Triton dQ kernel after the Gluon dK / dV kernel (no fp32 accumulator, no
# reductions; bench_hopper_bwd.py, same process): 351.5 / 328.4 against 285.2 / 251.2 with the
# reductions, FA2 252.8 / 230.3 (1.39 / 1.43x), cuDNN 378.1 / 346.3; deterministic=True then takes the same path
# (349.8 / 324.8; the Triton backward 189.7 / 165.7). GPU time per backward (torch.profiler): dK / dV kernel 1951 /
# 1033 us, Triton dQ kernel 1893 / 988 us (its tile 128x32 w8 s2 the best of sweep_configs.py --bwd-candidates dq:
# 353 / 329 against 323 / 281 for 64x32 w4, 281 / 255 for 64x64 w8, 214 / 197 for 64x32 w8), preprocess 43 us.
# So the d256 kernel computes dK and dV only (ops/hopper_bwd.computes_dq).
HOPPER_BWD = {64: HopperBwdConfig(64, 2, 240), 128: HopperBwdConfig(64, 2, 248), 256: HopperBwdConfig(64, 2, 240)}
HOPPER_BWD_ALLOWED = os.environ.get("FLASHTRITON_GLUON_BWD", "1") != "0"
# dQ reductions of the head dim 128 kernel in a fixed order (bitwise reproducible) on every call, not only with
# deterministic=True (ops/hopper_bwd.orders_dq): FLASHTRITON_ORDERED_DQ=1. Twelfth session, H200, kernel time in one
# process (scratch probe, torch.profiler), default / ordered TF/s: 16x1024 431 / 387, causal 314 / 257; 4x4096 537 /
# 493, 496 / 398; 1x16384 542 / 497, 548 / 456. Slower than the unordered default, so only deterministic=True
# orders (it replaced the Triton deterministic backward: 303 / 221, 366 / 336, 383 / 380 by wall clock).
HOPPER_BWD_ORDERED = os.environ.get("FLASHTRITON_ORDERED_DQ", "0") == "1"


@dataclass(frozen=True)
class HopperDqConfig:
    block_n: int         # keys per K / V stage
    stages: int          # K / V stages in shared memory
    consumer_regs: int   # registers per thread of the second consumer warpgroup


# Gluon dQ kernel (kernels/bwd_hopper_dq.py), keyed by the head dims whose Gluon dK / dV kernel leaves dQ to a
# kernel of its own; where a head dim is missing (or the kernel is off) the Triton dQ kernel runs. Eleventh session
# (H200, bench_hopper_bwd.py, 4x4096x8x256, same process, backward TF/s non-causal / causal): correct (test_hopper_bwd
# forces it on; gradients equal to the Triton dQ kernel's bit for bit here) but slower: with it 307.7 / 325.3, with
# the Triton dQ kernel 358.4 / 330.9. Not tuned (32-key S / dP wgmmas, every block's waits in order, consumers not
# in ping-pong), so off: FLASHTRITON_GLUON_DQ=1 turns it on.
HOPPER_DQ = {256: HopperDqConfig(32, 2, 240)}
HOPPER_DQ_ALLOWED = os.environ.get("FLASHTRITON_GLUON_DQ", "0") == "1"


def heads_per_l2_group(bytes_per_head: int, batch_heads: int, causal: bool) -> int:
    """(batch, head) pairs per launch-order group: as many as fit L2_GROUP_BYTES[causal], at least 1."""
    return max(1, min(batch_heads, L2_GROUP_BYTES[causal] // max(1, bytes_per_head)))


def block_d(head_dim: int) -> int:
    """Head dim rounded up to a power of two, at least 16 (the smallest tl.dot operand)."""
    return max(16, 1 << (head_dim - 1).bit_length())


# Paged decode wants about twice the resident programs of a contiguous cache: each key tile's block-table
# load sits in front of its K/V loads. bench_decode.py --splits 0,1,2,4,8,16,32,64 --graph (H200, commit
# 2622019, GQA 32/8, d128): with the one-program-per-SM heuristic page 256 reached 2.95 / 3.06 / 2.55 TB/s at
# (16, 16k) / (4, 64k) / (1, 128k) against 4.08 (2 splits) / 4.05 (8) / 3.48 (32) with twice the programs;
# page 64 2.48 / 2.43 / 2.03 against 3.71 (2) / 3.67 (8) / 3.24 (32). Copy bandwidth 4.25 TB/s.
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

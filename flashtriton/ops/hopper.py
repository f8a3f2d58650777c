"""Launchers of the warp-specialized Hopper kernels in Gluon (kernels/hopper/) and the one rule for when they run.

backend.launch_fwd and backend.launch_bwd ask `gluon_runs` first and fall back to the Triton kernels (kernels/fwd.py,
kernels/bwd.py) for everything the Gluon kernels do not take. The forward is kernels/hopper/fwd.py; the backward is
kernels/hopper/bwd.py at head dims 64 and 128 (dK, dV and dQ in one kernel, dQ by TMA reductions: at 128 they can come
in a fixed order, `orders_dq`, which deterministic=True takes; at 64 never, so deterministic=True does not take it
there) and kernels/hopper/bwd_d256.py at 192 and 256 (dK and dV only: backend.launch_bwd runs a dQ kernel after it,
deterministic: at 192 the Gluon one, kernels/hopper/bwd_dq.py, at 256 the Triton one); head dims between those run on
the next wider tiles. FLASHTRITON_GLUON=0 (configs.GLUON_ALLOWED) keeps
every call on the Triton kernels. Gluon has no interpreter: CPU tensors never get here, and the GPU tests
(tests/test_hopper_fwd.py, tests/test_hopper_bwd.py, plus every dense test whose case is eligible) are what check
these kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence, Tuple, Union

import torch

from .. import configs
from .dropout import kernel_dropout
from .launching import (alibi_batch_stride, compiled_without_line_info, descriptor_builder, launch, tma_compatible,
                        triton_cdiv)

try:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..kernels.hopper.fwd import CONSUMER_ROWS, attn_fwd_hopper_kernel
    from ..kernels.hopper.fwd_d512 import HALF as D512_HALF, ROWS as D512_ROWS, attn_fwd_hopper_d512_kernel
    from ..kernels.hopper.tail_merge import attn_tail_merge_kernel, tail_merge_rows
    compiled_without_line_info(attn_fwd_hopper_kernel, attn_fwd_hopper_d512_kernel, attn_tail_merge_kernel)
    # host descriptors of tensors gluon_runs / the launchers checked (tma_compatible)
    checked_descriptor = descriptor_builder(TensorDescriptor)
except Exception:  # Triton without Gluon's Hopper API, or its interpreter: the Triton kernels run everything
    attn_fwd_hopper_kernel = None

try:
    if attn_fwd_hopper_kernel is None:
        raise ImportError("no Gluon Hopper API")
    from ..kernels.hopper.bwd import KEYS_PER_CONSUMER, attn_bwd_hopper_kernel
    from ..kernels.hopper.bwd_d256 import KEYS_PER_PROGRAM, attn_bwd_hopper_d256_kernel
    from ..kernels.hopper.bwd_dq import CONSUMER_ROWS as DQ_CONSUMER_ROWS, attn_bwd_hopper_dq_kernel
    KEY_BLOCK = 2 * KEYS_PER_CONSUMER.value
    KEY_BLOCK_D256 = KEYS_PER_PROGRAM.value
    DQ_TILE_ROWS = 2 * DQ_CONSUMER_ROWS.value
    compiled_without_line_info(attn_bwd_hopper_kernel, attn_bwd_hopper_d256_kernel, attn_bwd_hopper_dq_kernel)
except Exception:  # no Gluon Hopper API, or no TMA reduction in it: the Triton backward runs everything
    attn_bwd_hopper_kernel = attn_bwd_hopper_d256_kernel = attn_bwd_hopper_dq_kernel = None
    KEY_BLOCK, KEY_BLOCK_D256, DQ_TILE_ROWS = 128, 64, 128

# Launches since import of the forward, of the tail's merge (a cut last wave), of the backward's dK / dV (and dQ)
# kernel and of the dQ kernel that follows a dK / dV only one; tests read them to know that the path they check ran.
fwd_launch_count = 0
tail_merge_count = 0
bwd_launch_count = 0
bwd_dq_launch_count = 0

DIRECTIONS = ("fwd", "bwd")
WIDE_TILE_DIM = 512  # the forward's tiles above head dim 256 (kernels/hopper/fwd_d512.py: two halves of 256)


@lru_cache(maxsize=None)  # called on every eligible forward and backward
def is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9  # wgmma and setmaxnreg: sm_90 only


@lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def covers(direction: str, head_dim: int, dtype: torch.dtype, seqlen_q: int, seqlen_k: int, params, plain: bool,
           deterministic: bool = False, head_dim_v: Optional[int] = None) -> bool:
    """gluon_runs' rule on the call's shape and options alone (no device, layout or switch): whether the Gluon kernels
    compute this forward ("fwd") or backward ("bwd"). `plain`: no paged cache (but a varlen forward's pool that
    `takes_pages`, without dropout or FP8), seqused_k / leftpad_k / cache_batch_idx or split-KV; the forward's ALiBi
    on causal-like calls only, the backward's ALiBi and dropout only on tiles up to 128 wide
    (backward_takes_logit_options) and its varlen calls only there without deterministic=True, dropout or ALiBi (the
    caller knows those); softcap in the backward on those tiles (without dropout: the caller knows), not in the
    forward. Windows: any (local windows: LOCAL), except that deterministic=True with dQ in
    a fixed order (`orders_dq`) takes no local window in the backward (its order assumes each key block's rows run to
    the last). Head dims up to 256 run on the next wider tiles of their direction (configs.hopper_fwd_tile_dim /
    hopper_bwd_tile_dim); the forward takes V's own head dim (head_dim_v, default head_dim), the backward equal ones or,
    on the dK / dV only tiles (192, 256), V's own on 128-wide tiles (`backward_takes_head_dims`); with
    deterministic=True the backward needs tiles where dQ is not added in an arbitrary order (`can_order_dq`). FP8
    (e4m3) q: the forward, on tiles whose column chunks are multiples of 32 (an e4m3 wgmma's K; `fp8_forward_tiles`)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if direction == "fwd":
        tile_dims_exist = configs.hopper_fwd_tile_dim(max(head_dim, head_dim_v)) is not None or \
            wide_forward(head_dim, head_dim_v)
    else:
        tile_dims_exist = backward_takes_head_dims(head_dim, head_dim_v)
    if not tile_dims_exist or (direction == "bwd" and deterministic and computes_dq(head_dim)
                               and (not can_order_dq(head_dim) or local_window(params, seqlen_k))):
        return False
    if dtype == torch.float8_e4m3fn and not (direction == "fwd" and fp8_forward_tiles(head_dim, head_dim_v)):
        return False
    softcap_fits = not params.has_softcap or (direction == "bwd" and backward_takes_logit_options(head_dim))
    return (plain and dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn)
            and seqlen_q > configs.DECODE_MAX_ROWS and seqlen_k > 0 and params.softmax_scale > 0.0 and softcap_fits)


def wide_forward(head_dim: int, head_dim_v: int) -> bool:
    """Head dims the forward runs on 512-wide tiles split between two consumers (kernels/hopper/fwd_d512.py): both
    in 257-512. Its callers keep calls with varlen, ALiBi, dropout or sinks on the Triton kernel."""
    return 256 < head_dim <= WIDE_TILE_DIM and 256 < head_dim_v <= WIDE_TILE_DIM


def fp8_forward_tiles(head_dim: int, head_dim_v: int) -> bool:
    """Whether the Gluon forward takes e4m3 q and k at these head dims: every column chunk of q's tiles is a multiple
    of 32 columns (the K of an e4m3 wgmma), and V's tiles exist (V enters in fp16)."""
    tile_dim, tile_dim_v = configs.hopper_fwd_tile_dim(head_dim), configs.hopper_fwd_tile_dim(head_dim_v)
    return (tile_dim is not None and tile_dim_v is not None
            and all(width % 32 == 0 for width in configs.HOPPER_FWD_CHUNKS[tile_dim]))


def causal_window(params, seqlen_k: int) -> bool:
    """The normalized window is the causal mask (window_right 0, window_left never binding)."""
    return params.window_right == 0 and params.window_left >= seqlen_k


def local_window(params, seqlen_k: int) -> bool:
    """The normalized window binds somewhere other than the causal diagonal (the forward's LOCAL)."""
    return params.window_left >= 0 and not causal_window(params, seqlen_k)


def gluon_runs(direction: str, q: torch.Tensor, params, seqlen_q: int, seqlen_k: int, plain: bool,
               addressable: Union[bool, Sequence[torch.Tensor]], deterministic: bool = False,
               head_dim_v: Optional[int] = None) -> bool:
    """Whether this forward (direction "fwd") or backward ("bwd") runs the Gluon kernels: Triton has them, they are
    switched on (FLASHTRITON_GLUON; and FLASHTRITON_TMA: they load and store only through tensor descriptors), they
    cover the call (`covers`), q is on an sm_90 GPU, the tensors the kernel addresses by tensor descriptors (q, k, v
    and out, or q, k, v and dout) are in layouts descriptors can address, and, for a backward whose dQ is ordered,
    every key block of a head fits on the GPU at once (`order_fits`). addressable: those tensors, checked here with
    launching.tma_compatible (after the cheaper conditions), or the caller's own answer for them (True / False)
    where it checks them anyway. head_dim_v: V's head dim where it is not q's."""
    kernel = attn_fwd_hopper_kernel if direction == "fwd" else attn_bwd_hopper_kernel
    return (kernel is not None and configs.GLUON_ALLOWED and configs.TMA_ALLOWED and q.is_cuda
            and covers(direction, q.shape[-1], q.dtype, seqlen_q, seqlen_k, params, plain, deterministic, head_dim_v)
            and (addressable if isinstance(addressable, bool) else all(tma_compatible(t) for t in addressable))
            and is_hopper(q.device)
            and not (direction == "bwd" and orders_dq(q.shape[-1], deterministic)
                     and not order_fits(seqlen_k, q.device)))


@lru_cache(maxsize=None)
def shared_layout(block: Tuple[int, ...], dtype: torch.dtype):
    """The shared-memory layout of a tensor descriptor's block (cached: building it costs ~8 us of host time)."""
    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32,
               torch.float8_e4m3fn: gl.float8e4nv}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), element)


def tile_descriptor(tensor: torch.Tensor, rows: int, columns: int = 0):
    """Host descriptor of a (B, S, H, D) tensor moving [1, rows, 1, columns] tiles (columns 0: all D); out-of-bounds
    rows read 0 and are never stored."""
    columns = columns or tensor.shape[-1]
    return checked_descriptor(tensor, list(tensor.shape), list(tensor.stride()), [1, rows, 1, columns],
                              shared_layout((1, rows, 1, columns), tensor.dtype))


# ----------------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------------

# Tests cap the grid (testing.forced_hopper_grid) so that every program runs many work items.
PROGRAMS_CAP = None


def forward_grid(num_tiles: int, batch_heads: int, config, causal: bool, device: torch.device) -> Tuple[int, bool]:
    """(programs, paired) of the forward's grid over num_tiles query tiles of each of batch_heads (batch, head)
    pairs: one program per tile, or persistent (config.persistent) one per SM (shared memory allows one program per
    SM at every head dim) taking work items in turn, never more programs than items. Causal tiles differ in length,
    so a persistent causal grid pairs them (the longest with the shortest left), so that programs taking items in
    turn get equal work."""
    paired = config.persistent and causal
    items = ((num_tiles + 1) // 2 if paired else num_tiles) * batch_heads
    programs = min(items, _multiprocessors(device)) if config.persistent else items
    return (programs if PROGRAMS_CAP is None else min(programs, PROGRAMS_CAP)), paired


@dataclass(frozen=True)
class TailSplit:
    """How a persistent grid's last, partial wave is cut (kernels/hopper/schedule.next_piece): items from full_items on
    form the tail, `blocks` key blocks of `tiles` tiles (item_blocks per item) cut evenly among the first `programs`
    programs, each of which leaves at most two partial results (the workspace's slots)."""
    full_items: int
    programs: int
    blocks: int
    item_blocks: int
    tiles: int


def tile_key_blocks(tile: int, num_tiles: int, tile_rows: int, block_n: int, seqlen_q: int, seqlen_k: int,
                    causal: bool) -> int:
    """Key blocks of tile `tile` (numbered longest first), as kernels/hopper/schedule.tile_work counts them."""
    key_end = seqlen_k
    if causal:
        key_end = min((num_tiles - tile) * tile_rows + seqlen_k - seqlen_q, seqlen_k)
    return max(triton_cdiv(key_end, block_n), 1)


@lru_cache(maxsize=4096)
def tail_split(items: int, programs: int, paired: bool, num_tiles: int, tile_rows: int, block_n: int, seqlen_q: int,
               seqlen_k: int, causal: bool, min_blocks: int) -> Optional[TailSplit]:
    """The cut of the last wave of a persistent grid of `programs` taking `items` work items in turn, or None where
    there is no partial wave, where cutting it would leave a program fewer than min_blocks key blocks or no more
    programs working than tail items, or where the items differ in length (causal pairs of another total when
    seqlen_k - seqlen_q crosses the tiles unevenly, or an odd number of tiles; the kernel's positions assume one
    length). The last wave then takes 1 / (programs / tail items) of a tile's time instead of a whole one: about 3%
    of the time of 15.5 waves (the baseline shapes' 16k tokens at head dim 128)."""
    full_waves, tail_items = divmod(items, programs)
    if tail_items == 0 or (paired and num_tiles % 2):
        return None
    blocks = [tile_key_blocks(tile, num_tiles, tile_rows, block_n, seqlen_q, seqlen_k, causal)
              for tile in range(num_tiles)]
    item_lengths = {blocks[slot] + blocks[num_tiles - 1 - slot] for slot in range(num_tiles // 2)} if paired \
        else {blocks[0]}
    if len(item_lengths) != 1:
        return None
    item_blocks = item_lengths.pop()
    tail_blocks = tail_items * item_blocks
    tail_programs = min(programs, tail_blocks // min_blocks)
    if tail_programs <= tail_items:
        return None
    return TailSplit(full_waves * programs, tail_programs, tail_blocks, item_blocks, tail_items * (2 if paired else 1))


def cuts_tail(config) -> bool:
    """Whether the forward's grid for `config` (configs.HOPPER_FWD) may cut its last wave: a persistent grid whose
    config says so (split_tail); launch_fwd adds the call's own conditions."""
    return config.persistent and config.split_tail


def forward_constexprs(config, causal: bool, local: bool = False, key_rows: int = 0) -> dict:
    """attn_fwd_hopper_kernel's compile-time arguments for `config` (configs.HOPPER_FWD; tools/offline_compile builds
    the same kernel); key_rows: the K / V boxes' rows where a key block is read in several (paged_key_rows; 0: one
    box per block)."""
    return dict(CAUSAL=causal, LOCAL=local, STAGES=config.stages, CONSUMERS=config.consumers,
                CONSUMER_REGS=config.consumer_regs, PINGPONG=config.pingpong, HOLD_SCHEDULE=config.hold_schedule,
                RESCALE_SKIP=config.rescale_threshold > 0.0, MASK_BY_RESIDUES=config.mask_by_residues,
                SPLIT_TAIL=cuts_tail(config), KEY_PIECES=config.block_n // (key_rows or config.block_n), num_warps=4)


def forward_config(tile_dim: int, tile_dim_v: int, causal_like: bool, dropout: bool = False, fp8: bool = False):
    """The configs.HopperFwdConfig of a forward on Q / K tiles tile_dim and V / O tiles tile_dim_v wide: the narrow-V
    table's entry where it has one (configs.HOPPER_FWD_NARROW_V), else the dropout or FP8 table's for the wider tile
    dim where the call has those, else HOPPER_FWD's (launch_fwd and tools/offline_compile both pick it here)."""
    narrow = configs.HOPPER_FWD_NARROW_V.get((tile_dim, tile_dim_v, causal_like))
    if narrow is not None:
        return narrow
    key = (max(tile_dim, tile_dim_v), causal_like)
    if dropout and key in configs.HOPPER_FWD_DROPOUT:
        return configs.HOPPER_FWD_DROPOUT[key]
    if fp8 and key in configs.HOPPER_FWD_FP8:
        return configs.HOPPER_FWD_FP8[key]
    return configs.HOPPER_FWD[key]


PAGE_BLOCK = 64  # the paged forward's smallest key block: its pages hold a multiple of it


def takes_pages(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the Gluon forward reads this paged pool (k, v: (num_pages, page_size, Hk, D)): pages of a multiple of
    PAGE_BLOCK keys, laid one after another (each pool a (1, num_pages * page_size, Hk, D) view to the
    descriptors), and a row just past the pool (where pages outside it read) within TMA's 32-bit coordinates."""
    num_pages, page_size = k.shape[0], k.shape[1]
    return (num_pages > 0 and page_size % PAGE_BLOCK == 0 and (num_pages + 1) * page_size < 2 ** 31
            and all(t.stride(0) == page_size * t.stride(1) for t in (k, v)))


def paged_key_rows(config, page_size: int) -> int:
    """The rows of a paged forward's K / V boxes, ones that lie in one page (configs.page_key_block: the config's key
    block where it divides page_size, else PAGE_BLOCK for the pools that `takes_pages`); a key block wider than that
    is read in config.block_n / rows boxes, each from its own page (attn_fwd_hopper_kernel's KEY_PIECES)."""
    return configs.page_key_block(config.block_n, page_size)


def chunk_descriptors(tensor: torch.Tensor, rows: int, tile_dim: int) -> Tuple:
    """The descriptors of a (B, S, H, D) tensor's [1, rows, 1, width] tiles for each chunk of its head dim's tiles
    (configs.HOPPER_FWD_CHUNKS[tile_dim]), None for a second chunk where there is one only."""
    widths = configs.HOPPER_FWD_CHUNKS[tile_dim]
    descriptors = tuple(tile_descriptor(tensor, rows, width) for width in widths)
    return descriptors + (None, ) * (2 - len(descriptors))


def launch_fwd(q, k, v, out, lse, lse_strides: Tuple[int, int], params, seqlen_q: int, seqlen_k: int, batch: int,
               heads_per_group: int, cu_seqlens_q=None, cu_seqlens_k=None, alibi_slopes=None, dropout_p: float = 0.0,
               rng_state=None, learnable_sink=None, descales=None, block_table=None) -> None:
    """Run the Gluon forward into out (B, Sq, H, Dv) and lse (fp32, rows contiguous, strides lse_strides). Varlen
    (cu_seqlens given): q, k, v and out (T, H, D), batch sequences, seqlen_q / seqlen_k the longest lengths, lse
    (H, T) with lse_strides (0, T). alibi_slopes: fp32 (H,) or (B, H). dropout_p > 0: attention probabilities
    dropped by the mask of rng_state ((2,) int64: seed, offset; docs/api.md §4.7). learnable_sink (H,): folded into
    out and lse by the kernel (docs/api.md §4.11). descales: FP8's (q_descale, k_descale, v_descale), (B, Hk) fp32
    contiguous, with e4m3 q and k, v in fp16 and a bf16 out (docs/api.md §4.12; no ALiBi). block_table (B, max
    pages) int32, varlen calls: k and v are paged pools (num_pages, page_size, Hk, D) that `takes_pages`; each
    sequence's keys are its cu_seqlens_k length, clamped to its row's capacity, from key 0 of its row."""
    global fwd_launch_count, tail_merge_count
    num_heads, head_dim, head_dim_v = q.shape[-2], q.shape[-1], v.shape[-1]
    if wide_forward(head_dim, head_dim_v):
        launch_fwd_d512(q, k, v, out, lse, lse_strides, params, seqlen_q, seqlen_k, batch, heads_per_group)
        return
    varlen = cu_seqlens_q is not None
    paged = block_table is not None
    # attn_fwd_hopper_kernel's varlen group, q_rows and k_rows (paged: a block-table row's capacity), paged group
    k_rows = block_table.shape[1] * k.shape[1] if paged else k.shape[0]
    varlen_args = ((cu_seqlens_q, cu_seqlens_k, out, out.stride(0), out.stride(1), head_dim_v), q.shape[0],
                   k_rows) if varlen else ((None, None, None, 0, 0, 0), 0, 0)
    paged_args = (block_table, block_table.stride(0), k.shape[1], k.shape[0]) if paged else (None, 0, 0, 0)
    if varlen:  # one batch entry of all the rows to the descriptors; each tile finds its sequence's rows
        q, out = q.unsqueeze(0), out.unsqueeze(0)
        # a paged pool: its pages one after another
        k, v = (t.view(1, -1, *t.shape[-2:]) if paged else t.unsqueeze(0) for t in (k, v))
    # head dims between the tile classes run on the next wider tiles (their missing columns read as zeros); q / k
    # and v / out have tiles of their own widths (and chunks: configs.HOPPER_FWD_CHUNKS), the config is the wider
    # one's
    tile_dim, tile_dim_v = configs.hopper_fwd_tile_dim(head_dim), configs.hopper_fwd_tile_dim(head_dim_v)
    config = forward_config(tile_dim, tile_dim_v, params.causal_like, dropout_p > 0.0, descales is not None)
    key_rows = paged_key_rows(config, paged_args[2]) if paged else config.block_n
    local = local_window(params, seqlen_k)
    tile_rows = config.consumers * CONSUMER_ROWS.value
    num_tiles = triton_cdiv(seqlen_q, tile_rows)
    # a local window's or varlen tiles do not pair into equal lengths, nor are tail items all one length: neither is
    # used
    programs, paired = forward_grid(num_tiles, batch * num_heads, config, params.causal_like and not (local or varlen),
                                    q.device)
    items = ((num_tiles + 1) // 2 if paired else num_tiles) * batch * num_heads
    split = None
    # the tail merge writes whole tile rows of q's head dim: not where out is narrower than the tiles or than q
    # (nor with sinks: a partial piece would fold its sink, and the merge add it again; nor with FP8's descales,
    # which a partial piece does not apply)
    if cuts_tail(config) and not (local or varlen or descales) and tile_dim == head_dim == head_dim_v \
            and learnable_sink is None:
        split = tail_split(items, programs, paired, num_tiles, tile_rows, config.block_n, seqlen_q, seqlen_k,
                           params.causal_like, config.tail_min_blocks)
    work = (heads_per_group, int(paired), items, 0, 0, 1)
    partial = partial_lse = lse  # not read without a tail cut (any fp32 tensor)
    if split is not None:
        rows = 2 * split.programs * tile_rows  # two slots per tail program (kernels/hopper/schedule.next_piece)
        partial = torch.empty(rows * head_dim, dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(rows, dtype=torch.float32, device=q.device)
        work = (heads_per_group, int(paired), split.full_items, split.programs, split.blocks, split.item_blocks)
    # the first chunks' descriptors of q, k, v and out, then the second chunks'
    firsts, seconds = zip(chunk_descriptors(q, CONSUMER_ROWS.value, tile_dim),
                          chunk_descriptors(k, key_rows, tile_dim),
                          chunk_descriptors(v, key_rows, tile_dim_v),
                          chunk_descriptors(out, CONSUMER_ROWS.value, tile_dim_v))
    launch(
        attn_fwd_hopper_kernel, (programs,), *firsts, *seconds, lse, partial, partial_lse,
        *lse_strides, batch, num_heads, num_heads // k.shape[-2], seqlen_q, seqlen_k, *work,
        1.0 if alibi_slopes is not None else params.qk_scale_log2, config.rescale_threshold,
        params.window_left, params.window_right, *varlen_args,
        (alibi_slopes, alibi_batch_stride(alibi_slopes), int(params.alibi_pure_causal), params.qk_scale_log2),
        (rng_state if dropout_p > 0.0 else None, *kernel_dropout(dropout_p)), learnable_sink,
        (*(descales or (None, None, None)), num_heads // k.shape[-2]), paged_args,
        # varlen tiles differ in length: a persistent grid's programs take the next tile when free
        torch.zeros(1, dtype=torch.int32, device=q.device) if varlen and config.persistent and split is None else None,
        **forward_constexprs(config, params.causal_like, local, key_rows))
    if split is not None:
        launch(
            attn_tail_merge_kernel, (split.tiles * (tile_rows // tail_merge_rows(head_dim)),),
            partial, partial_lse, out, lse, out.stride(0), out.stride(1), out.stride(2), *lse_strides, batch,
            num_heads, seqlen_q, seqlen_k, *work, CAUSAL=params.causal_like, TILE_ROWS=tile_rows,
            BLOCK_N=config.block_n, HEAD_DIM=head_dim, num_warps=4)
        tail_merge_count += 1
    fwd_launch_count += 1


def launch_fwd_d512(q, k, v, out, lse, lse_strides: Tuple[int, int], params, seqlen_q: int, seqlen_k: int,
                    batch: int, heads_per_group: int) -> None:
    """Run the Gluon forward at head dims 257-512 (kernels/hopper/fwd_d512.py; dense calls, any window) into out
    (B, Sq, H, Dv) and lse (fp32, rows contiguous, strides lse_strides)."""
    global fwd_launch_count
    num_heads = q.shape[-2]
    config = configs.HOPPER_FWD_D512[params.is_local]
    rows, half = D512_ROWS.value, D512_HALF.value
    launch(attn_fwd_hopper_d512_kernel, (triton_cdiv(seqlen_q, rows) * batch * num_heads, ),
           tile_descriptor(q, rows, half), tile_descriptor(k, config.block_n, half),
           tile_descriptor(v, config.block_n, half), tile_descriptor(out, rows, half), lse, *lse_strides, batch,
           num_heads, num_heads // k.shape[-2], seqlen_q, seqlen_k, heads_per_group, params.qk_scale_log2,
           params.window_left, params.window_right, LOCAL=params.is_local, STAGES=config.stages,
           CONSUMER_REGS=config.consumer_regs, num_warps=4)
    fwd_launch_count += 1


# ----------------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------------

# dQ columns per consumer warpgroup and TMA reduction: half of head dim 128, all of head dim 64 (kernels/hopper/bwd)
DQ_FEATURES = 64
# the tiles kernels/hopper/bwd_d256 runs (dK / dV only), and V's tiles of their own there
DK_DV_ONLY_TILE_DIMS = (192, 256)
V_TILE_OF_ITS_OWN = 128


def backward_division(head_dim: int, deterministic: bool = False):
    """(kernel, keys per program, (rows, features) per dQ reduction or None, tile head dim) of a head dim up to 256:
    its tiles are those of the next configs.HOPPER_BWD entry (configs.hopper_bwd_tile_dim; their missing columns read
    as zeros and are never stored). Tiles 192 and 256 wide run the dK / dV kernel (kernels/hopper/bwd_d256.py, its
    boxes: dk_dv_only_boxes; dQ is a kernel of its own: dq_kernel_runs). deterministic=True skips the other kernel's
    tiles of two chunks (80, 96: their consumers add dQ chunks of unequal widths, which the fixed order does not take) for its
    next class of one chunk (128: dQ in a fixed order)."""
    tile_dim = configs.hopper_bwd_tile_dim(head_dim)
    if deterministic and tile_dim is not None and tile_dim not in DK_DV_ONLY_TILE_DIMS:
        tile_dim = next(dim for dim in configs.HOPPER_BWD_HEAD_DIMS
                        if dim >= tile_dim and len(configs.HOPPER_BWD_CHUNKS[dim]) == 1)
    if tile_dim in DK_DV_ONLY_TILE_DIMS:
        return attn_bwd_hopper_d256_kernel, KEY_BLOCK_D256, None, tile_dim
    return attn_bwd_hopper_kernel, KEY_BLOCK, (configs.HOPPER_BWD[tile_dim].query_rows, DQ_FEATURES), tile_dim


def computes_dq(head_dim: int) -> bool:
    """Whether the Gluon backward adds dQ itself (into the fp32 accumulator: tiles up to 128 wide), or computes dK
    and dV only and leaves dQ to a dQ kernel of its own (tiles 192 and 256 wide: dq_kernel_runs). head_dim at most
    256."""
    return backward_division(head_dim)[2] is not None


def backward_takes_head_dims(head_dim: int, head_dim_v: int) -> bool:
    """Whether the Gluon backward has tiles for q / k's and v's head dims: equal ones up to 256, or V's own on
    128-wide tiles where q / k's run the dK / dV only kernel (192 or 256 wide: MLA-style (192, 128); its dV parts
    are halves of V's tile, as 256's Q / dO parts are of theirs)."""
    tile_dim = configs.hopper_bwd_tile_dim(head_dim)
    if head_dim_v == head_dim:
        return tile_dim is not None
    return tile_dim in DK_DV_ONLY_TILE_DIMS and configs.hopper_bwd_tile_dim(head_dim_v) == V_TILE_OF_ITS_OWN


def dq_kernel_runs(head_dim: int, head_dim_v: Optional[int] = None) -> bool:
    """Whether the Gluon dQ kernel (kernels/hopper/bwd_dq.py) computes dQ after the dK / dV only kernel (where
    computes_dq is False): tiles with a configs.HOPPER_BWD_DQ entry (V's head dim on its own tiles too, as
    backward_takes_head_dims allows); elsewhere the Triton dQ kernel does."""
    return (not computes_dq(head_dim) and backward_takes_head_dims(head_dim, head_dim if head_dim_v is None
                                                                   else head_dim_v)
            and configs.hopper_bwd_tile_dim(head_dim) in configs.HOPPER_BWD_DQ)


def backward_takes_logit_options(head_dim: int) -> bool:
    """Whether the Gluon backward takes dropout (drawing the forward's mask) and ALiBi at this head dim: on the tiles
    of kernels/hopper/bwd.py (up to 128 wide); the dK / dV only kernel (192 and 256) has neither, its calls run the
    Triton backward."""
    return configs.hopper_bwd_tile_dim(head_dim) is not None and computes_dq(head_dim)


def key_major_scores(config, causal_like: bool, alibi: bool, dropout: bool) -> bool:
    """Whether the Gluon backward (kernels/hopper/bwd.py, KEY_MAJOR) computes key-major scores S^T = K Q^T: where
    the config lists the call's causal value, and always with ALiBi (offline sm_90 at d128 causal: 85 local loads
    against the row-major tiles' 167); never with dropout (the forward's mask follows the row-major tiles)."""
    return (causal_like in config.key_major or alibi) and not dropout


def can_order_dq(head_dim: int) -> bool:
    """Whether the kernel can add dQ in a fixed order at this head dim (on the tiles a deterministic call takes:
    backward_division): where it splits dQ by 64-feature halves (tiles 128 wide), each consumer adds its own
    features, one reduction per (query block, feature half) and key block; on 64 wide tiles both consumers add into
    the same features and are not ordered."""
    _, _, dq_box, tile_dim = backward_division(head_dim, deterministic=True)
    return dq_box is not None and dq_box[1] < tile_dim


def orders_dq(head_dim: int, deterministic: bool) -> bool:
    """Whether this backward adds dQ in the fixed order (kernels/hopper/bwd.py, ORDERED): deterministic=True, where
    the head dim allows it."""
    return deterministic and can_order_dq(head_dim)


def order_fits(seqlen_k: int, device: torch.device) -> bool:
    """Whether ordered dQ can run: its waits resolve only if every key block of a (batch, kv head) is resident at
    once (launch-order groups of one head, one program per SM), so at most one key block per multiprocessor."""
    return triton_cdiv(seqlen_k, KEY_BLOCK) <= _multiprocessors(device)


def _row_statistic_descriptor(stat: torch.Tensor, strides: Tuple[int, int], batch: int, num_heads: int,
                              seqlen_q: int, rows: int):
    """Descriptor of a per-row fp32 statistic (lse or delta: (batch, head) strides, rows contiguous) as a
    (B * H, Sq) matrix loading [1, rows] blocks (rows past seqlen_q read 0); copied into a matrix with 16-byte
    aligned rows where its own layout is not one."""
    matrix = stat.as_strided((batch * num_heads, seqlen_q), (strides[1], 1))
    if strides[0] != num_heads * strides[1] or not tma_compatible(matrix):
        padded = torch.empty(batch * num_heads, triton_cdiv(seqlen_q, 4) * 4, dtype=torch.float32, device=stat.device)
        matrix = padded[:, :seqlen_q]
        matrix.view(batch, num_heads, seqlen_q).copy_(stat.as_strided((batch, num_heads, seqlen_q), (*strides, 1)))
    return checked_descriptor(matrix, list(matrix.shape), list(matrix.stride()), [1, rows],
                              shared_layout((1, rows), torch.float32))


def dk_dv_only_boxes(tile_dim: int, tile_dim_v: int) -> tuple:
    """attn_bwd_hopper_d256_kernel's descriptor boxes in its argument order (k, v, q, do, then k2, v2, q2, do2): each
    (tensor, "keys" or "rows", columns) or None. Per side (Q / K on tile_dim, dO / V on tile_dim_v) by its chunks
    (configs.HOPPER_BWD_CHUNKS): two chunks, a box of each for every tensor; one, K (V) in whole rows and Q (dO) in
    halves, the two consumers' feature parts."""
    sides = []
    for keyed, rowed, dim in (("k", "q", tile_dim), ("v", "do", tile_dim_v)):
        widths = configs.HOPPER_BWD_CHUNKS[dim]
        chunks = [(widths[0], widths[0] // 2), None] if len(widths) == 1 else [(width, width) for width in widths]
        sides.append([None if chunk is None else ((keyed, "keys", chunk[0]), (rowed, "rows", chunk[1]))
                      for chunk in chunks])
    boxes = ()
    for chunk in range(2):
        (k_box, q_box), (v_box, do_box) = (side[chunk] or (None, None) for side in sides)
        boxes += (k_box, v_box, q_box, do_box)
    return boxes


def backward_chunk_descriptors(k, v, q, dout, dq_accum, keys: int, rows: int, dq_box, tile_dim: int) -> Tuple:
    """attn_bwd_hopper_kernel's descriptors (k, v, q, dO, dQ's accumulator) of the first chunk of the head dim's
    tiles, then of the second (None where one chunk covers it). One chunk: dQ moves in dq_box boxes (64-feature
    halves at 128, whole rows at 64); two: a box per chunk (each consumer adds one chunk's features)."""
    widths = configs.HOPPER_BWD_CHUNKS[tile_dim]
    chunks = []
    for width in widths:
        dq_columns = width if len(widths) > 1 else dq_box[1]
        chunks += [tile_descriptor(k, keys, width), tile_descriptor(v, keys, width), tile_descriptor(q, rows, width),
                   tile_descriptor(dout, rows, width), tile_descriptor(dq_accum, rows, dq_columns)]
    return tuple(chunks) + (None, ) * (10 - len(chunks))


def _stage_type_descriptor(scratch: torch.Tensor, rows: int):
    """A descriptor of [1, rows] fp32 blocks that types the backward's lse / delta stage buffers and is never
    loaded through (a varlen call's statistics come by plain loads): over the first element of scratch (fp32)."""
    return checked_descriptor(scratch, [1, 1], [4, 1], [1, rows], shared_layout((1, rows), torch.float32))


def aligned_rows(*outputs) -> bool:
    """Whether every (tensor, head dim) of outputs (16-bit, stored by kernels/hopper/common.store_rows) takes 16-byte
    stores: its address and every stride but the last a multiple of 16 bytes (tma_compatible), and the head dim one
    of 16 bytes."""
    return all(tma_compatible(tensor) and head_dim % (16 // tensor.element_size()) == 0
               for tensor, head_dim in outputs)


def launch_bwd(q, k, v, dout, lse, delta, dq, dk, dv, dq_accum, lse_strides: Tuple[int, int],
               delta_strides: Tuple[int, int], params, seqlen_q: int, seqlen_k: int, batch: int,
               heads_per_group: int, deterministic: bool, dropout_p: float = 0.0, rng_state=None, cu_seqlens_q=None,
               cu_seqlens_k=None, alibi_slopes=None) -> None:
    """dK, dV into dk, dv and dQ into dq (B, S, H, D each) from lse and delta (fp32, rows contiguous, (batch,
    head) strides lse_strides / delta_strides), which the kernel loads by TMA with each Q / dO block. The kernel
    adds its scaled dQ products into dq_accum (fp32, q's shape, contiguous, zeroed) by TMA reductions (which clip
    rows past seqlen_q), copied into dq at the end; where it does not compute dQ (`computes_dq`) dq_accum is None
    and dq is left to the caller. With ordered dQ (`orders_dq`) the reductions take turns on zeroed counters, and
    each (batch, kv head)'s key blocks launch together. dropout_p > 0 (`backward_takes_logit_options` head dims): the
    forward's mask, from the rng_state it returned. Softcap (params; those head dims, without dropout): capped
    logits. Varlen (cu_seqlens given; tiles up to 128 wide, not ordered, no
    dropout): q, k, v, dout, dq, dk, dv and dq_accum (T, H, D), batch sequences, seqlen_q / seqlen_k the longest
    lengths, lse and delta (H, T) matrices (lse_strides / delta_strides (0, row stride)). alibi_slopes: fp32 (H,) or
    (B, H), on tiles up to 128 wide."""
    global bwd_launch_count
    num_heads, head_dim, head_dim_v = q.shape[-2], q.shape[-1], v.shape[-1]
    num_heads_k = k.shape[-2]
    kernel, keys, dq_box, tile_dim = backward_division(head_dim, deterministic)
    varlen = cu_seqlens_q is not None
    if varlen:  # one batch entry of all the rows to the descriptors; each program finds its sequence's rows
        if dq_box is None or orders_dq(head_dim, deterministic) or dropout_p > 0.0:
            raise ValueError("the Gluon backward takes varlen calls on tiles up to 128 wide, not ordered, no dropout")
        # lse and delta come by the producer's plain loads (a sequence's rows start anywhere, and TMA needs 16-byte
        # aligned inner coordinates): their descriptors only type the kernel's stage buffers
        varlen_args = ((cu_seqlens_q, cu_seqlens_k, q, k, v, dout, lse, delta), q.shape[0], k.shape[0],
                       lse_strides[1], delta_strides[1])
        q, k, v, dout, dk, dv, dq_accum = (t.unsqueeze(0) for t in (q, k, v, dout, dk, dv, dq_accum))
    elif dq_box is not None:
        varlen_args = ((None, ) * 8, 0, 0, 0, 0)
    else:  # the dK / dV only kernel takes no varlen call
        varlen_args = ()
    config = configs.HOPPER_BWD[tile_dim]
    grid = (triton_cdiv(seqlen_k, keys) * batch * num_heads_k,)
    ordered = orders_dq(head_dim, deterministic)
    # per (batch, query head, query block of the kernel, feature half): reductions completed so far
    dq_counters = (torch.zeros(batch * num_heads * triton_cdiv(seqlen_q, config.query_rows) * 2, dtype=torch.int32,
                               device=q.device) if ordered else None)
    key_major = key_major_scores(config, params.causal_like, alibi_slopes is not None, dropout_p > 0.0)
    # dQ's 64-feature boxes in the kernel's conflict-free staging order, where the accumulator is as wide as the tiles
    # (its columns past the head dim would be clipped, and in that order they hold features below it)
    swapped_dq = dq_box is not None and head_dim == tile_dim
    kernel_args = {} if dq_box is None else dict(ORDERED=ordered, KEY_MAJOR=key_major, SWAPPED_DQ=swapped_dq,
                                                 SOFTCAP=params.has_softcap)
    if params.has_softcap and (dq_box is None or dropout_p > 0.0):
        raise ValueError("the Gluon backward takes softcap on tiles up to 128 wide, without dropout")
    if alibi_slopes is not None and dq_box is None:
        raise ValueError("the Gluon backward takes ALiBi on tiles up to 128 wide")
    # the kernel's dropout_args, alibi_args and softcap_args (not the dK / dV only kernel's: it has none)
    logit_args = () if dq_box is None else ((rng_state if dropout_p > 0.0 else None, *kernel_dropout(dropout_p)),
                                            (alibi_slopes, alibi_batch_stride(alibi_slopes),
                                             int(params.alibi_pure_causal)), params.kernel_scores()[1:])
    if dq_box is None:  # the dK / dV only kernel: each side (Q / K, dO / V) whole rows and halves, or two chunks
        tensors = dict(k=k, v=v, q=q, do=dout)
        descriptors = tuple(None if box is None else
                            tile_descriptor(tensors[box[0]], keys if box[1] == "keys" else config.query_rows, box[2])
                            for box in dk_dv_only_boxes(tile_dim, configs.hopper_bwd_tile_dim(head_dim_v)))
    else:  # per chunk of the head dim (configs.HOPPER_BWD_CHUNKS): K, V, Q, dO and dQ's boxes, then the second's
        descriptors = backward_chunk_descriptors(k, v, q, dout, dq_accum, keys, config.query_rows, dq_box, tile_dim)
    if varlen:
        statistics = (_stage_type_descriptor(dq_accum, config.query_rows), ) * 2
    else:
        statistics = tuple(_row_statistic_descriptor(stat, strides, batch, num_heads, seqlen_q, config.query_rows)
                           for stat, strides in ((lse, lse_strides), (delta, delta_strides)))
    launch(
        kernel, grid, *descriptors, *statistics, dk, dv, *(() if dq_box is None else (dq_counters, )), dk.stride(0),
        dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2), num_heads_k, num_heads // num_heads_k, seqlen_q, seqlen_k, head_dim,
        *((head_dim_v, ) if dq_box is None else ()), 1 if ordered else heads_per_group, params.softmax_scale,
        params.qk_scale_log2, params.window_left, params.window_right, *logit_args, *varlen_args,
        CAUSAL=params.causal_like, LOCAL=local_window(params, seqlen_k),
        ALIGNED_ROWS=aligned_rows((dk, head_dim), (dv, head_dim_v)), STAGES=config.stages,
        CONSUMER_REGS=config.consumer_regs, num_warps=4, **kernel_args)
    if dq_accum is not None:
        if swapped_dq:
            unswapped_dq(dq, dq_accum.view(dq.shape))
        else:
            dq.copy_(dq_accum.view(dq.shape))
    bwd_launch_count += 1


def unswapped_dq(dq: torch.Tensor, dq_accum: torch.Tensor) -> None:
    """dq = dq_accum read back from the Gluon backward's SWAPPED_DQ order (kernels/hopper/bwd._staging_order): each
    whole group of 64 columns holds feature c at the column whose index has c's bits 2 and 4 swapped (an involution);
    columns past the last whole group are in order. dq_accum: dq's shape; dq's last dim contiguous."""
    groups = dq.shape[-1] // 64
    if groups > 0:
        bits = (*dq.shape[:-1], groups, 2, 2, 2, 2, 2, 2)
        dq[..., :64 * groups].view(bits).copy_(dq_accum[..., :64 * groups].view(bits).transpose(-5, -3))
    if dq.shape[-1] > 64 * groups:
        dq[..., 64 * groups:].copy_(dq_accum[..., 64 * groups:])


def launch_bwd_dq(q, k, v, dout, lse, delta, dq, lse_strides: Tuple[int, int], delta_strides: Tuple[int, int], params,
                  seqlen_q: int, seqlen_k: int, batch: int, heads_per_group: int) -> None:
    """dQ into dq (B, S, H, D) by the Gluon dQ kernel (where dq_kernel_runs; after launch_bwd's dK / dV), from lse
    and delta (fp32, rows contiguous, (batch, head) strides lse_strides / delta_strides): one program per query tile
    of DQ_TILE_ROWS rows and (batch, head), launch-order groups of heads_per_group."""
    global bwd_dq_launch_count
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    tile_dim = configs.hopper_bwd_tile_dim(head_dim)
    config = configs.HOPPER_BWD_DQ[tile_dim]
    rows = DQ_TILE_ROWS // 2
    # per chunk: Q, dO, K, V (Q / K on q's chunks, dO / V on v's), None past a side's chunks
    widths, widths_v = configs.HOPPER_BWD_CHUNKS[tile_dim], configs.HOPPER_BWD_CHUNKS[
        configs.hopper_bwd_tile_dim(v.shape[-1])]
    descriptors = ()
    for chunk in range(2):
        width = widths[chunk] if chunk < len(widths) else None
        width_v = widths_v[chunk] if chunk < len(widths_v) else None
        descriptors += tuple(None if columns is None else tile_descriptor(tensor, tile_rows, columns)
                             for tensor, tile_rows, columns in ((q, rows, width), (dout, rows, width_v),
                                                                (k, config.keys, width), (v, config.keys, width_v)))
    grid = (triton_cdiv(seqlen_q, DQ_TILE_ROWS) * batch * num_heads,)
    launch(
        attn_bwd_hopper_dq_kernel, grid, *descriptors,
        *(_row_statistic_descriptor(stat, strides, batch, num_heads, seqlen_q, rows)
          for stat, strides in ((lse, lse_strides), (delta, delta_strides))),
        dq, dq.stride(0), dq.stride(1), dq.stride(2), num_heads, num_heads // k.shape[-2], seqlen_q, seqlen_k,
        head_dim, heads_per_group, params.softmax_scale, params.qk_scale_log2, params.window_left,
        params.window_right, CAUSAL=params.causal_like, LOCAL=local_window(params, seqlen_k),
        ALIGNED_ROWS=aligned_rows((dq, head_dim)), STAGES=config.stages, CONSUMER_REGS=config.consumer_regs,
        num_warps=4)
    bwd_dq_launch_count += 1

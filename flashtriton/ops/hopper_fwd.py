"""Launcher of the warp-specialized Hopper forward (kernels/fwd_hopper.py) and the rule for when it runs.

backend.launch_fwd asks `runs_on` first and falls back to the Triton kernel (kernels/fwd.py) for everything the
Gluon kernel does not cover. Gluon has no interpreter: CPU tensors never get here, and the GPU test suite
(tests/test_hopper_fwd.py, plus every dense test whose case is eligible) is what checks this kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Tuple

import torch

from .. import configs
from .launching import compiled_without_line_info, descriptor_builder, tma_compatible, triton_cdiv

try:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..kernels.fwd_hopper import CONSUMER_ROWS, TAIL_MERGE_ELEMENTS, attn_fwd_hopper_kernel, \
        attn_tail_merge_kernel
    compiled_without_line_info(attn_fwd_hopper_kernel, attn_tail_merge_kernel)
    # host descriptors of tensors runs_on / the launchers checked (tma_compatible)
    checked_descriptor = descriptor_builder(TensorDescriptor)
except Exception:  # Triton without Gluon's Hopper API, or its interpreter: the Triton kernel runs everything
    attn_fwd_hopper_kernel = None

# Launches of this kernel since import, and of the tail's merge (a cut last wave); tests read them to know that the
# path they check ran.
launch_count = 0
tail_merge_count = 0


@lru_cache(maxsize=None)  # called on every eligible forward (and backward, ops/hopper_bwd)
def is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9  # wgmma and setmaxnreg: sm_90 only


def covers(head_dim: int, dtype: torch.dtype, seqlen_q: int, seqlen_k: int, params, plain: bool) -> bool:
    """Whether the Gluon kernel computes this forward (the device and the layout aside). `plain`: dense
    (B, S, H, D) layout with no varlen, paged cache, seqused_k / leftpad_k / cache_batch_idx, split-KV, dropout or
    ALiBi (the caller knows those). Windows: none, or the causal one (window_right 0, left never binding)."""
    no_window = params.window_left < 0 and params.window_right < 0
    causal = params.window_right == 0 and params.window_left >= seqlen_k
    return (plain and head_dim in configs.HOPPER_FWD_HEAD_DIMS and dtype in (torch.float16, torch.bfloat16)
            and seqlen_q > configs.DECODE_MAX_ROWS and seqlen_k > 0 and params.softcap == 0.0
            and params.softmax_scale > 0.0 and (no_window or causal))


def runs_on(q, k, v, out, params, seqlen_q: int, seqlen_k: int, plain: bool) -> bool:
    """Whether this forward runs the Gluon kernel: it covers the call (`covers`), Triton has the kernel, it is
    switched on, and the tensors are on an sm_90 GPU in layouts tensor descriptors can address. The kernel loads
    and stores only through descriptors, so FLASHTRITON_TMA=0 turns it off too."""
    return (attn_fwd_hopper_kernel is not None and configs.GLUON_ALLOWED and configs.TMA_ALLOWED and q.is_cuda
            and covers(q.shape[-1], q.dtype, seqlen_q, seqlen_k, params, plain)
            and all(tma_compatible(t) for t in (q, k, v, out)) and is_hopper(q.device))


@lru_cache(maxsize=None)
def shared_layout(block: Tuple[int, ...], dtype: torch.dtype):
    """The shared-memory layout of a tensor descriptor's block (cached: building it costs ~8 us of host time)."""
    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), element)


def tile_descriptor(tensor: torch.Tensor, rows: int, columns: int = 0):
    """Host descriptor of a (B, S, H, D) tensor moving [1, rows, 1, columns] tiles (columns 0: all D); out-of-bounds
    rows read 0 and are never stored."""
    columns = columns or tensor.shape[-1]
    return checked_descriptor(tensor, list(tensor.shape), list(tensor.stride()), [1, rows, 1, columns],
                              shared_layout((1, rows, 1, columns), tensor.dtype))


# Tests cap the grid (testing.forced_hopper_grid) so that every program runs many work items.
PROGRAMS_CAP = None


@lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def grid(num_tiles: int, batch_heads: int, config, causal: bool, device: torch.device) -> Tuple[int, bool]:
    """(programs, paired) of the kernel's grid over num_tiles query tiles of each of batch_heads (batch, head)
    pairs: one program per tile, or persistent (config.persistent) one per SM
    (shared memory allows one program per SM at every head dim) taking work items in turn, never more programs
    than items. Causal tiles differ in length, so a persistent causal grid pairs them (the longest with the
    shortest left): a static split of single tiles lost up to 33% against one program per tile (configs.py)."""
    paired = config.persistent and causal
    items = ((num_tiles + 1) // 2 if paired else num_tiles) * batch_heads
    programs = min(items, _multiprocessors(device)) if config.persistent else items
    return (programs if PROGRAMS_CAP is None else min(programs, PROGRAMS_CAP)), paired


@dataclass(frozen=True)
class TailSplit:
    """How a persistent grid's last, partial wave is cut (kernels/fwd_hopper._next_piece): items from full_items on
    form the tail, `blocks` key blocks of `tiles` tiles (item_blocks per item) cut evenly among the first `programs`
    programs, each of which leaves at most two partial results (the workspace's slots)."""
    full_items: int
    programs: int
    blocks: int
    item_blocks: int
    tiles: int


def tile_key_blocks(tile: int, num_tiles: int, tile_rows: int, block_n: int, seqlen_q: int, seqlen_k: int,
                    causal: bool) -> int:
    """Key blocks of tile `tile` (numbered longest first), as kernels/fwd_hopper._tile_work counts them."""
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
    of the time of 15.5 waves (BASELINES.md's 16k-token rows at head dim 128)."""
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


def kernel_constexprs(config, causal: bool, threshold: float) -> dict:
    """attn_fwd_hopper_kernel's compile-time arguments for `config` (configs.HOPPER_FWD) and the rescale threshold
    (configs.hopper_rescale_threshold; tools/offline_compile builds the same kernel)."""
    return dict(CAUSAL=causal, STAGES=config.stages, CONSUMERS=config.consumers, CONSUMER_REGS=config.consumer_regs,
                PINGPONG=config.pingpong, HOLD_SCHEDULE=config.hold_schedule, RESCALE_SKIP=threshold > 0.0,
                MASK_BY_RESIDUES=config.mask_by_residues, ROW_MAX_TREE=config.row_max_tree,
                SPLIT_TAIL=config.persistent and config.split_tail, num_warps=4)


def launch(q, k, v, out, lse, lse_strides: Tuple[int, int], params, seqlen_q: int, seqlen_k: int, batch: int,
           heads_per_group: int) -> None:
    """Run the Gluon forward into out (B, Sq, H, D) and lse (fp32, rows contiguous, strides lse_strides)."""
    global launch_count, tail_merge_count
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    config = configs.HOPPER_FWD[head_dim, params.causal_like]
    threshold = configs.hopper_rescale_threshold(config)
    tile_rows = config.consumers * CONSUMER_ROWS.value
    num_tiles = triton_cdiv(seqlen_q, tile_rows)
    programs, paired = grid(num_tiles, batch * num_heads, config, params.causal_like, q.device)
    items = ((num_tiles + 1) // 2 if paired else num_tiles) * batch * num_heads
    split = None
    if config.persistent and config.split_tail:
        split = tail_split(items, programs, paired, num_tiles, tile_rows, config.block_n, seqlen_q, seqlen_k,
                           params.causal_like, config.tail_min_blocks)
    work = (heads_per_group, int(paired), items, 0, 0, 1)
    partial = partial_lse = lse  # not read without a tail cut (any fp32 tensor)
    if split is not None:
        rows = 2 * split.programs * tile_rows  # two slots per tail program (kernels/fwd_hopper._next_piece)
        partial = torch.empty(rows * head_dim, dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(rows, dtype=torch.float32, device=q.device)
        work = (heads_per_group, int(paired), split.full_items, split.programs, split.blocks, split.item_blocks)
    attn_fwd_hopper_kernel[(programs,)](
        tile_descriptor(q, CONSUMER_ROWS.value), tile_descriptor(k, config.block_n),
        tile_descriptor(v, config.block_n), tile_descriptor(out, CONSUMER_ROWS.value), lse, partial, partial_lse,
        *lse_strides, batch, num_heads, num_heads // k.shape[-2], seqlen_q, seqlen_k, *work,
        params.kernel_args()[0], threshold, **kernel_constexprs(config, params.causal_like, threshold))
    if split is not None:
        attn_tail_merge_kernel[(split.tiles * tile_rows * head_dim // TAIL_MERGE_ELEMENTS.value,)](
            partial, partial_lse, out, lse, out.stride(0), out.stride(1), out.stride(2), *lse_strides, batch,
            num_heads, seqlen_q, seqlen_k, *work, CAUSAL=params.causal_like, TILE_ROWS=tile_rows,
            BLOCK_N=config.block_n, HEAD_DIM=head_dim, num_warps=4)
        tail_merge_count += 1
    launch_count += 1

"""Launcher of the warp-specialized Hopper forward (kernels/fwd_hopper.py) and the rule for when it runs.

backend.launch_fwd asks `runs_on` first and falls back to the Triton kernel (kernels/fwd.py) for everything the
Gluon kernel does not cover. Gluon has no interpreter: CPU tensors never get here, and the GPU test suite
(tests/test_hopper_fwd.py, plus every dense test whose case is eligible) is what checks this kernel.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Tuple

import torch

from .. import configs
from .launching import descriptor_builder, tma_compatible, triton_cdiv

try:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..kernels.fwd_hopper import CONSUMER_ROWS, attn_fwd_hopper_kernel
    # host descriptors of tensors runs_on / the launchers checked (tma_compatible)
    checked_descriptor = descriptor_builder(TensorDescriptor)
except Exception:  # Triton without Gluon's Hopper API, or its interpreter: the Triton kernel runs everything
    attn_fwd_hopper_kernel = None

# Launches of this kernel since import; tests read it to know that the path they check ran.
launch_count = 0


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


def kernel_constexprs(config, causal: bool, threshold: float) -> dict:
    """attn_fwd_hopper_kernel's compile-time arguments for `config` (configs.HOPPER_FWD) and the rescale threshold
    (configs.hopper_rescale_threshold; tools/offline_compile builds the same kernel)."""
    return dict(CAUSAL=causal, STAGES=config.stages, CONSUMERS=config.consumers, CONSUMER_REGS=config.consumer_regs,
                PINGPONG=config.pingpong, HOLD_SCHEDULE=config.hold_schedule, RESCALE_SKIP=threshold > 0.0,
                MASK_BY_RESIDUES=config.mask_by_residues, ROW_MAX_TREE=config.row_max_tree, num_warps=4)


def launch(q, k, v, out, lse, lse_strides: Tuple[int, int], params, seqlen_q: int, seqlen_k: int, batch: int,
           heads_per_group: int) -> None:
    """Run the Gluon forward into out (B, Sq, H, D) and lse (fp32, rows contiguous, strides lse_strides)."""
    global launch_count
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    config = configs.HOPPER_FWD[head_dim, params.causal_like]
    threshold = configs.hopper_rescale_threshold(config)
    tile_rows = config.consumers * CONSUMER_ROWS.value
    programs, paired = grid(triton_cdiv(seqlen_q, tile_rows), batch * num_heads, config, params.causal_like,
                            q.device)
    attn_fwd_hopper_kernel[(programs,)](
        tile_descriptor(q, CONSUMER_ROWS.value), tile_descriptor(k, config.block_n),
        tile_descriptor(v, config.block_n), tile_descriptor(out, CONSUMER_ROWS.value), lse, *lse_strides, batch,
        num_heads, num_heads // k.shape[-2], seqlen_q, seqlen_k, heads_per_group, int(paired),
        params.kernel_args()[0], threshold, **kernel_constexprs(config, params.causal_like, threshold))
    launch_count += 1

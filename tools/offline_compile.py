"""Compile flashtriton kernels for sm_90 on a machine without a GPU; print registers, spills, shared memory.

    python tools/offline_compile.py [--head-dim 128] [--head-dim-v DV] [--local] [--kernel fwd|dkdv|dq]
                                    [--config M,N,WARPS,STAGES]
    python tools/offline_compile.py --kernel fwd-hopper [--head-dim 128] [--head-dim-v DV] [--causal] [--local]
                                    [--packed] [--alibi]  # --packed: a varlen launch
                                    [--hopper-config N,STAGES,REGS[,P,PP,H[,T[,C]]]]
                                                       # the Gluon forward; default: its configs.HOPPER_FWD entry
                                                       # (P, PP, H: persistent, ping-pong, hold_schedule, 0 or 1;
                                                       # T: the rescale skip's threshold, 0: none; C: consumers)
    python tools/offline_compile.py --kernel fwd-d512-hopper [--causal] [--local] [--hopper-config N,STAGES,REGS]
                                                       # the Gluon forward at head dims 257-512
                                                       # (configs.HOPPER_FWD_D512)
    python tools/offline_compile.py --kernel bwd-hopper [--head-dim 128] [--head-dim-v DV] [--causal] [--ordered] [--local]
                                    [--hopper-config ROWS,STAGES,REGS]
                                                       # the Gluon backward; default: its configs.HOPPER_BWD entry
    python tools/offline_compile.py --kernel bwd-dq-hopper [--head-dim 192] [--head-dim-v DV] [--causal] [--local]
                                    [--hopper-config KEYS,STAGES,REGS]
                                                       # the Gluon dQ kernel; default: its configs.HOPPER_BWD_DQ entry
    (fwd-hopper also prints exp2_before_pv_wait: how much of each consumer loop's softmax runs under its P V product,
    and rescale_skip_branches: the warp votes that skip the output's rescale, warp_vote_branches)

Uses Triton's bundled ptxas. Integer arguments are compiled as plain i32 with the pointer/stride
divisibility hints a contiguous (B, S, H, D) launch would get, so the numbers approximate the real compile.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashtriton.kernel_inspect import bundled_tool, parse_sass
from flashtriton.kernels.bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
from flashtriton.kernels.fwd import attn_fwd_kernel

KERNELS = {"fwd": attn_fwd_kernel, "dkdv": attn_bwd_dkdv_kernel, "dq": attn_bwd_dq_kernel}


@dataclass(frozen=True)
class Arg:
    """A runtime argument of the compile: its signature type and whether it is specialized as 16-divisible."""

    type: str
    aligned: bool = False


STRIDE, INT, REAL = Arg("i32", True), Arg("i32"), Arg("fp32")


def _pointer(dtype: str) -> Arg:
    return Arg(f"*{dtype}", True)


def _ast_source(kernel, values: dict) -> ASTSource:
    """ASTSource of `kernel` with `values`: parameter name -> Arg, constexpr value (None, bool, int, float) or a
    tuple of those for a grouped parameter, as Triton's launcher would specialize them."""
    signature, constexprs, attrs = {}, {}, {}

    def walk(value, path):
        if isinstance(value, tuple):
            return tuple(walk(item, path + (index,)) for index, item in enumerate(value))
        if not isinstance(value, Arg):
            constexprs[path] = value
            return "constexpr"
        if value.aligned:
            attrs[path] = [["tt.divisibility", 16]]
        return value.type

    for index, name in enumerate(inspect.signature(kernel.fn).parameters):
        signature[name] = walk(values[name], (index,))
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)


def _kernel_values(name, head_dim, local, block_m, block_n, dtype, dropout, pack_gqa, paged, tma_device, packed,
                   dq_atomic, head_dim_v) -> dict:
    """The arguments of one launch of the forward ("fwd"), dK/dV ("dkdv") or dQ ("dq") kernel: a contiguous
    (B, S, H, D) layout, or varlen (packed), paged K/V with seqused_k (paged); no ALiBi, softcap or split."""
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    block_dv = max(16, 1 << (head_dim_v - 1).bit_length())
    row_strides = (STRIDE,) * 3
    int_pointer = _pointer("i32")
    rng_state = _pointer("i64") if dropout else None
    flags = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dv, BLOCK_M=block_m,
                 BLOCK_N=block_n, IS_LOCAL=local,
                 HAS_SOFTCAP=False, HAS_DROPOUT=dropout)
    scores = dict(seqlen_q=INT, seqlen_k=INT, heads_per_group=INT, scores=(REAL,) * 3, window_left=INT,
                  window_right=INT, alibi_pure_causal=INT, dropout=(REAL, REAL))
    if name == "fwd":
        cu_seqlens = int_pointer if packed else None
        paging = int_pointer if paged else None
        # host descriptors of a packed varlen launch (TMA_PACKED): Q, K, V; O is stored by pointer
        descriptors = (None,) * 4
        if packed:
            descriptors = (*(Arg(f"tensordesc<{dtype}[1,{rows},1,{width}]>")
                             for rows, width in ((block_m, block_d), (block_n, block_d), (block_n, block_dv))), None)
        out_dtype = "bf16" if dtype == "fp8e4nv" else dtype  # FP8 inputs write bf16
        return dict(inputs=(_pointer(dtype),) * 3, outputs=(_pointer(out_dtype), _pointer("fp32")),
                    optional=(None, cu_seqlens, cu_seqlens, paging, None, paging, None, rng_state,
                              (_pointer("fp32"),) * 3 if dtype == "fp8e4nv" else None),
                    **dict(zip(("q_desc", "k_desc", "v_desc", "o_desc"), descriptors)), strides=(row_strides,) * 4, stride_lse_b=INT, stride_lse_h=INT,
                    batch_strides=(STRIDE, STRIDE), page_size=INT, page_strides=(STRIDE, STRIDE),
                    split_strides=(STRIDE, STRIDE), head_counts=(INT, INT), **scores, **flags, IS_SPLIT=False,
                    TMA_MODE=3 if packed else 2 if tma_device else 0, FOLD_SCALE=not dropout, PACK_GQA=pack_gqa,
                    TILE_IN_PAGE=paged, RESCALE_THRESHOLD=0.0, q_rows=INT if packed else None,
                    k_rows=INT if packed or paged else None, kv_rows=INT if paged else None)
    gradients = dict(outputs=(_pointer(dtype), _pointer(dtype), _pointer("fp32") if dq_atomic else None),
                     grad_strides=(row_strides,) * 3, DQ_ATOMIC=dq_atomic) if name == "dkdv" else dict(
                         DQ=_pointer(dtype), dq_strides=row_strides)
    return dict(inputs=(*(_pointer(dtype),) * 4, _pointer("fp32"), _pointer("fp32")),
                optional=(None, None, None, rng_state), strides=(row_strides,) * 4,
                stride_lse_b=INT, stride_lse_h=INT, stride_delta_b=INT, stride_delta_h=INT, stride_alibi_b=STRIDE,
                head_counts=(INT, INT), softmax_scale=REAL, **scores, **gradients, **flags, USE_TMA=tma_device,
                q_rows=None, k_rows=None)


def compile_kernel(kernel, head_dim, local, block_m, block_n, warps, stages, dtype="bf16", dropout=False,
                   pack_gqa=False, paged=False, tma_device=False, packed=False, dq_atomic=False, head_dim_v=None):
    name = next(key for key, value in KERNELS.items() if value is kernel)
    values = _kernel_values(name, head_dim, local, block_m, block_n, dtype, dropout, pack_gqa, paged, tma_device,
                            packed, dq_atomic, head_dim_v or head_dim)
    return triton.compile(_ast_source(kernel, values), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def _gluon_descriptor_type(block: list, dtype: str) -> str:
    """Signature type of a host descriptor moving `block` tiles with the launchers' layout (ops/hopper)."""
    from triton.experimental.gluon import language as gl

    element = {"bf16": gl.bfloat16, "fp16": gl.float16, "fp32": gl.float32, "fp8e4nv": gl.float8e4nv}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block, element)
    return f"tensordesc<{dtype}[{','.join(map(str, block))}],{layout!r}>"


def _gluon_tile_type(rows: int, head_dim: int, dtype: str) -> str:
    """A descriptor of (B, S, H, D) moving [1, rows, 1, head_dim] tiles (ops/hopper.tile_descriptor)."""
    return _gluon_descriptor_type([1, rows, 1, head_dim], dtype)


def _compile_gluon(kernel, signature: dict, constexprs: dict):
    """A Gluon kernel compiled for sm_90 with 4 warps in its default partition; pointer arguments 16-byte aligned,
    as Triton specializes a launch on torch's allocations."""
    from triton.experimental.gluon._runtime import GluonASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    # constexprs by name (whole parameters) or by path (index, element) inside a grouped parameter
    signature.update({name: "constexpr" for name in constexprs if isinstance(name, str)})
    constexprs = {(names.index(key),) if isinstance(key, str) else key: value for key, value in constexprs.items()}
    attrs = {}
    for name, kind in signature.items():
        kinds = kind if isinstance(kind, tuple) else (kind, )
        for element, item in enumerate(kinds):
            if item.startswith("*"):
                path = (names.index(name), element) if isinstance(kind, tuple) else (names.index(name), )
                attrs[path] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def compile_hopper_fwd(head_dim: int, causal: bool, config=None, dtype: str = "bf16", local: bool = False,
                       head_dim_v: int = 0, varlen: bool = False, alibi: bool = False, dropout: bool = False,
                       sinks: bool = False, fp8: bool = False, paged: bool = False):
    """The Gluon Hopper forward (kernels/hopper/fwd.py) with `config` (default ops/hopper.forward_config's, as the
    launcher picks it), as a dense launch (`varlen`: a varlen one) on the tiles of head_dim for Q / K and of head_dim_v
    for V / O (0: head_dim's; head dims between the tile classes run on the next wider tiles,
    configs.hopper_fwd_tile_dim, as ops/hopper.launch_fwd does); `local`: a local window (LOCAL); `alibi`: ALiBi
    slopes; `dropout`: dropout's rng_state; `sinks`: learnable sinks; `fp8`: e4m3 q and k with descales, fp16 v, bf16
    out; `paged`: a varlen call's keys in a paged pool of pages of 64 keys (its key blocks read in boxes of 64 rows
    where the config's block is wider, as ops/hopper.paged_key_rows picks)."""
    from flashtriton import configs
    from flashtriton.kernels.hopper.fwd import CONSUMER_ROWS, attn_fwd_hopper_kernel
    from flashtriton.ops.hopper import PAGE_BLOCK, forward_config, forward_constexprs, paged_key_rows

    head_dim = configs.hopper_fwd_tile_dim(head_dim)
    head_dim_v = configs.hopper_fwd_tile_dim(head_dim_v) if head_dim_v else head_dim
    config = config or forward_config(head_dim, head_dim_v, causal, dropout, fp8)
    key_rows = config.block_n
    if paged:  # a varlen call's
        key_rows = paged_key_rows(config, PAGE_BLOCK)
        varlen = True
    rows = CONSUMER_ROWS.value
    signature = {"Lse": "*fp32", "Partial": "*fp32", "PartialLse": "*fp32"}
    constexprs = forward_constexprs(config, causal, local, key_rows)
    # the descriptors of each chunk of the head dims (configs.HOPPER_FWD_CHUNKS), a constexpr None for a missing
    # second chunk
    for name, tile_rows, tile_dim in (("q", rows, head_dim), ("k", key_rows, head_dim),
                                      ("v", key_rows, head_dim_v), ("o", rows, head_dim_v)):
        widths = configs.HOPPER_FWD_CHUNKS[tile_dim]
        for chunk, suffix in enumerate(("_desc", "_desc2")):
            if chunk < len(widths):
                tensor_dtype = {"q": "fp8e4nv", "k": "fp8e4nv", "v": "fp16", "o": "bf16"}[name] if fp8 else dtype
                signature[name + suffix] = _gluon_tile_type(tile_rows, widths[chunk], tensor_dtype)
            else:
                constexprs[name + suffix] = None
    signature.update({name: "i32" for name in ("stride_lse_b", "stride_lse_h", "batch", "num_heads", "group_size",
                                               "seqlen_q", "seqlen_k", "heads_per_group", "paired", "full_items",
                                               "tail_programs", "tail_blocks", "item_blocks")})
    signature["qk_scale_log2"] = signature["rescale_threshold"] = "fp32"
    signature["window_left"] = signature["window_right"] = signature["q_rows"] = signature["k_rows"] = "i32"
    names = list(inspect.signature(attn_fwd_hopper_kernel.fn).parameters)
    # the grouped parameters: (CuSeqlensQ, CuSeqlensK, Out, stride_om, stride_oh, head_dim_v) and (AlibiSlopes,
    # stride_alibi_b, alibi_pure_causal, logit_scale_log2); None pointers are constexprs
    signature["varlen"] = ("*i32", "*i32", f"*{dtype}", "i32", "i32", "i32")
    if not varlen:
        signature["varlen"] = ("constexpr", ) * 3 + ("i32", ) * 3
        constexprs.update({(names.index("varlen"), element): None for element in range(3)})
    signature["alibi_args"] = ("*fp32" if alibi else "constexpr", "i32", "i32", "fp32")
    if not alibi:
        constexprs[(names.index("alibi_args"), 0)] = None
    _dropout_group(signature, constexprs, names, dropout)
    if sinks:
        signature["LearnableSink"] = "*fp32"
    else:
        constexprs["LearnableSink"] = None
    # fp8_args: (QDescale, KDescale, VDescale, group_size)
    signature["fp8_args"] = ("*fp32" if fp8 else "constexpr", ) * 3 + ("i32", )
    if not fp8:
        constexprs.update({(names.index("fp8_args"), element): None for element in range(3)})
    # paged_args: (BlockTable, stride_bt, page_size, num_pages)
    signature["paged_args"] = ("*i32" if paged else "constexpr", "i32", "i32", "i32")
    if not paged:
        constexprs[(names.index("paged_args"), 0)] = None
    # a persistent varlen grid's dynamic schedule (ops/hopper.launch_fwd)
    if varlen and config.persistent:
        signature["item_counter"] = "*i32"
    else:
        constexprs["item_counter"] = None
    signature = {name: signature[name] for name in names if name in signature}  # in the kernel's order
    return _compile_gluon(attn_fwd_hopper_kernel, signature, constexprs)


def _dropout_group(signature: dict, constexprs: dict, names: list, dropout: bool) -> None:
    """A Gluon kernel's dropout_args (RngState, keep_threshold, dropout_scale): the pointer a constexpr None without
    dropout."""
    signature["dropout_args"] = ("*i64" if dropout else "constexpr", "fp32", "fp32")
    if not dropout:
        constexprs[(names.index("dropout_args"), 0)] = None


def compile_hopper_bwd(head_dim: int, causal: bool, config=None, dtype: str = "bf16", ordered: bool = False,
                       local: bool = False, head_dim_v: int = 0, dropout: bool = False, varlen: bool = False,
                       alibi: bool = False, softcap: bool = False):
    """The Gluon Hopper backward (kernels/hopper/bwd.py; kernels/hopper/bwd_d256.py at head dims 192 and 256) with
    `config` (default configs.HOPPER_BWD[head_dim]); `ordered`: dQ reductions in a fixed order (head dim 128);
    `local`: a local window (LOCAL); head_dim_v: V's own head dim (0: head_dim's; the dK / dV only kernel);
    `dropout`: dropout's rng_state (kernels/hopper/bwd.py's tiles); `varlen`: a varlen launch, `alibi`: ALiBi slopes
    and `softcap` (SOFTCAP; all on those tiles)."""
    from flashtriton import configs
    from flashtriton.ops.hopper import backward_division, dk_dv_only_boxes, key_major_scores

    config = config or configs.HOPPER_BWD[head_dim]
    kernel, keys, dq_box, tile_dim = backward_division(head_dim)
    signature = {"lse_desc": _gluon_descriptor_type([1, config.query_rows], "fp32"),
                 "delta_desc": _gluon_descriptor_type([1, config.query_rows], "fp32"),
                 "DK": f"*{dtype}", "DV": f"*{dtype}", "softmax_scale": "fp32", "qk_scale_log2": "fp32"}
    # ALIGNED_ROWS: contiguous dK / dV at a head dim that is a multiple of 8 (ops/hopper.aligned_rows)
    constexprs = dict(CAUSAL=causal, LOCAL=local, ALIGNED_ROWS=True, STAGES=config.stages,
                      CONSUMER_REGS=config.consumer_regs, num_warps=4)
    if dq_box is None:  # the dK / dV only kernel: each side whole rows and halves, or two chunks (dk_dv_only_boxes)
        boxes = dk_dv_only_boxes(tile_dim, configs.hopper_bwd_tile_dim(head_dim_v or head_dim))
        for position, box in enumerate(boxes):
            name = ("k", "v", "q", "do")[position % 4] + ("_desc" if position < 4 else "_desc2")
            if box is None:
                constexprs[name] = None
            else:
                signature[name] = _gluon_tile_type(keys if box[1] == "keys" else config.query_rows, box[2], dtype)
    else:  # per chunk of the head dim (configs.HOPPER_BWD_CHUNKS, ops/hopper.backward_chunk_descriptors), the dQ
        # accumulator's boxes, the counters of ordered dQ and varlen's group
        widths = configs.HOPPER_BWD_CHUNKS[tile_dim]
        for chunk, suffix in enumerate(("", "2")):
            width = widths[chunk] if chunk < len(widths) else None
            for name, rows, kind in (("k", keys, dtype), ("v", keys, dtype), ("q", config.query_rows, dtype),
                                     ("do", config.query_rows, dtype), ("dq", config.query_rows, "fp32")):
                columns = dq_box[1] if name == "dq" and len(widths) == 1 else width
                if width is None:
                    constexprs[f"{name}_desc{suffix}"] = None
                else:
                    signature[f"{name}_desc{suffix}"] = _gluon_tile_type(rows, columns, kind)
        signature["dq_counters"] = "*i32"
        constexprs["ORDERED"] = ordered
        constexprs["KEY_MAJOR"] = key_major_scores(config, causal, alibi, dropout)
        constexprs["SWAPPED_DQ"] = head_dim == tile_dim  # as ops/hopper.launch_bwd decides
        constexprs["SOFTCAP"] = softcap
        signature["softcap_args"] = ("fp32", "fp32")
    names = list(inspect.signature(kernel.fn).parameters)
    if "dropout_args" in names:
        _dropout_group(signature, constexprs, names, dropout)
    if "alibi_args" in names:
        signature["alibi_args"] = ("*fp32" if alibi else "constexpr", "i32", "i32")
        if not alibi:
            constexprs[(names.index("alibi_args"), 0)] = None
    if "varlen" in names:
        signature["varlen"] = ("*i32", "*i32") + (f"*{dtype}", ) * 4 + ("*fp32", ) * 2
        signature["q_rows"] = signature["k_rows"] = "i32"
        signature["lse_row_stride"] = signature["delta_row_stride"] = "i32"
        if not varlen:
            signature["varlen"] = ("constexpr", ) * 8
            constexprs.update({(names.index("varlen"), element): None for element in range(8)})
    signature.update({name: "i32" for name in names if name.startswith("stride") or name in (
        "num_heads_k", "group_size", "seqlen_q", "seqlen_k", "head_dim", "head_dim_v", "heads_per_group",
        "window_left", "window_right")})
    signature = {name: signature[name] for name in names if name in signature}  # in the kernel's order
    return _compile_gluon(kernel, signature, constexprs)


def compile_hopper_bwd_dq(head_dim: int, causal: bool, config=None, dtype: str = "bf16", local: bool = False,
                          head_dim_v: int = 0):
    """The Gluon Hopper dQ kernel (kernels/hopper/bwd_dq.py) with `config` (default configs.HOPPER_BWD_DQ[the head
    dim's tiles]); `local`: a local window (LOCAL); head_dim_v: V's own head dim (0: head_dim's)."""
    from flashtriton import configs
    from flashtriton.kernels.hopper.bwd_dq import CONSUMER_ROWS, attn_bwd_hopper_dq_kernel

    tile_dim = configs.hopper_bwd_tile_dim(head_dim)
    config = config or configs.HOPPER_BWD_DQ[tile_dim]
    rows = CONSUMER_ROWS.value
    signature = {"lse_desc": _gluon_descriptor_type([1, rows], "fp32"),
                 "delta_desc": _gluon_descriptor_type([1, rows], "fp32"),
                 "DQ": f"*{dtype}", "softmax_scale": "fp32", "qk_scale_log2": "fp32"}
    constexprs = dict(CAUSAL=causal, LOCAL=local, ALIGNED_ROWS=True, STAGES=config.stages,
                      CONSUMER_REGS=config.consumer_regs, num_warps=4)
    widths = configs.HOPPER_BWD_CHUNKS[tile_dim]
    widths_v = configs.HOPPER_BWD_CHUNKS[configs.hopper_bwd_tile_dim(head_dim_v or head_dim)]
    for chunk, suffix in enumerate(("", "2")):
        for name, tile_rows, side in (("q", rows, widths), ("do", rows, widths_v), ("k", config.keys, widths),
                                      ("v", config.keys, widths_v)):
            if chunk < len(side):
                signature[f"{name}_desc{suffix}"] = _gluon_tile_type(tile_rows, side[chunk], dtype)
            else:
                constexprs[f"{name}_desc{suffix}"] = None
    names = list(inspect.signature(attn_bwd_hopper_dq_kernel.fn).parameters)
    signature.update({name: "i32" for name in names if name.startswith("stride") or name in (
        "num_heads", "group_size", "seqlen_q", "seqlen_k", "head_dim", "heads_per_group", "window_left",
        "window_right")})
    signature = {name: signature[name] for name in names if name in signature}  # in the kernel's order
    return _compile_gluon(attn_bwd_hopper_dq_kernel, signature, constexprs)


def compile_hopper_fwd_d512(head_dim: int, causal: bool, config=None, dtype: str = "bf16", local: bool = False):
    """The Gluon forward at head dims 257-512 (kernels/hopper/fwd_d512.py) with `config` (default
    configs.HOPPER_FWD_D512[causal]); `causal` or `local`: its LOCAL variant (a window)."""
    from flashtriton import configs
    from flashtriton.kernels.hopper.fwd_d512 import HALF, ROWS, attn_fwd_hopper_d512_kernel

    config = config or configs.HOPPER_FWD_D512[causal or local]
    signature = {"q_desc": _gluon_tile_type(ROWS.value, HALF.value, dtype),
                 "k_desc": _gluon_tile_type(config.block_n, HALF.value, dtype),
                 "v_desc": _gluon_tile_type(config.block_n, HALF.value, dtype),
                 "o_desc": _gluon_tile_type(ROWS.value, HALF.value, dtype), "Lse": "*fp32", "qk_scale_log2": "fp32"}
    signature.update({name: "i32" for name in ("stride_lse_b", "stride_lse_h", "batch", "num_heads", "group_size",
                                               "seqlen_q", "seqlen_k", "heads_per_group", "window_left",
                                               "window_right")})
    constexprs = dict(LOCAL=causal or local, STAGES=config.stages, CONSUMER_REGS=config.consumer_regs, num_warps=4)
    names = list(inspect.signature(attn_fwd_hopper_d512_kernel.fn).parameters)
    signature = {name: signature[name] for name in names if name in signature}
    return _compile_gluon(attn_fwd_hopper_d512_kernel, signature, constexprs)


_GLUON_COMPILERS = {"fwd": "compile_hopper_fwd", "bwd": "compile_hopper_bwd", "dq": "compile_hopper_bwd_dq",
                    "fwd-d512": "compile_hopper_fwd_d512"}


def gluon_stats(kind: str, head_dim: int, causal: bool, **options) -> dict:
    """{"shared": bytes, "wgmma": wgmma instructions in its PTX} of one Gluon kernel variant (kind: "fwd", "bwd" or
    "dq": compile_hopper_fwd / compile_hopper_bwd / compile_hopper_bwd_dq with these arguments). Where this process
    interprets its kernels (TRITON_INTERPRET=1 when they were decorated: nothing compiled can be built from them),
    the variant compiles in a subprocess without TRITON_INTERPRET, so a CPU test suite run through the interpreter
    still compiles the Gluon kernels."""
    from flashtriton.ops.backend import KERNELS_INTERPRETED

    if not KERNELS_INTERPRETED:
        compiled = globals()[_GLUON_COMPILERS[kind]](head_dim, causal, **options)
        return {"shared": compiled.metadata.shared, "wgmma": compiled.asm["ptx"].count("wgmma.mma_async")}
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    request = json.dumps(dict(kind=kind, head_dim=head_dim, causal=causal, options=options))
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--gluon-stats", request], capture_output=True,
                          text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {request} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--gluon-stats":  # gluon_stats' subprocess
        request = json.loads(sys.argv[2])
        print(json.dumps(gluon_stats(request["kind"], request["head_dim"], request["causal"], **request["options"])))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--head-dim-v", type=int, help="V's head dim (default: --head-dim)")
    parser.add_argument("--local", action="store_true")
    parser.add_argument("--kernel", default="fwd", choices=[*KERNELS, "fwd-hopper", "fwd-d512-hopper", "bwd-hopper",
                                                             "bwd-dq-hopper"])
    parser.add_argument("--causal", action="store_true", help="fwd-hopper only: the causal variant")
    parser.add_argument("--hopper-config", help="fwd-hopper: BLOCK_N,STAGES,REGS[,PERSISTENT,PINGPONG,HOLD,THRESHOLD"
                                                "[,CONSUMERS]], "
                                                "bwd-hopper: ROWS,STAGES,REGS instead of the configs.HOPPER_FWD / "
                                                "HOPPER_BWD entry")
    parser.add_argument("--config", default="128,128,8,3")
    parser.add_argument("--dropout", action="store_true")
    parser.add_argument("--alibi", action="store_true", help="fwd-hopper: ALiBi slopes")
    parser.add_argument("--sinks", action="store_true", help="fwd-hopper: learnable sinks")
    parser.add_argument("--fp8", action="store_true", help="forward only: e4m3 q, k, v with descales (bf16 out)")
    parser.add_argument("--pack-gqa", action="store_true", help="forward only: packed GQA decode tiles")
    parser.add_argument("--paged", action="store_true",
                        help="forward / fwd-hopper: paged K/V (fwd: one page per key tile; fwd-hopper: pages of 64)")
    parser.add_argument("--tma-device", action="store_true",
                        help="in-kernel tensor descriptors (forward TMA_DEVICE, backward USE_TMA)")
    parser.add_argument("--packed", action="store_true",
                        help="forward only: varlen with host descriptors over the packed tensors (TMA_PACKED; "
                             "fwd-hopper, bwd-hopper: their varlen launch)")
    parser.add_argument("--dq-atomic", action="store_true", help="dkdv only: dQ added with atomics (DQ_ATOMIC)")
    parser.add_argument("--ordered", action="store_true", help="bwd-hopper d128: dQ reductions in a fixed order")
    args = parser.parse_args()
    if args.kernel == "bwd-dq-hopper":
        config = None
        if args.hopper_config:
            from flashtriton.configs import HopperBwdDqConfig

            config = HopperBwdDqConfig(*(int(x) for x in args.hopper_config.split(",")))
        compiled = compile_hopper_bwd_dq(args.head_dim, args.causal, config, local=args.local,
                                         head_dim_v=args.head_dim_v or 0)
        print(f"bwd-dq-hopper d{args.head_dim} dv{args.head_dim_v or args.head_dim} causal={args.causal} "
              f"local={args.local} "
              f"{args.hopper_config or 'table'}: {resource_usage(compiled)} shared {compiled.metadata.shared} "
              f"wgmma {compiled.asm['ptx'].count('wgmma.mma_async')}")
        return
    if args.kernel == "fwd-d512-hopper":
        config = None
        if args.hopper_config:
            from flashtriton.configs import HopperFwdD512Config

            config = HopperFwdD512Config(*(int(x) for x in args.hopper_config.split(",")))
        compiled = compile_hopper_fwd_d512(512, args.causal, config, local=args.local)
        print(f"fwd-d512-hopper causal={args.causal} local={args.local} {args.hopper_config or 'table'}: "
              f"{resource_usage(compiled)} shared {compiled.metadata.shared} "
              f"wgmma {compiled.asm['ptx'].count('wgmma.mma_async')}")
        return
    if args.kernel == "bwd-hopper":
        config = None
        if args.hopper_config:
            from flashtriton.configs import HopperBwdConfig

            config = HopperBwdConfig(*(int(x) for x in args.hopper_config.split(",")))
        compiled = compile_hopper_bwd(args.head_dim, args.causal, config, ordered=args.ordered, local=args.local,
                                      head_dim_v=args.head_dim_v or 0, dropout=args.dropout, varlen=args.packed,
                                      alibi=args.alibi)
        ptx = compiled.asm["ptx"]
        print(f"bwd-hopper d{args.head_dim} dv{args.head_dim_v or args.head_dim} causal={args.causal} "
              f"local={args.local} varlen={args.packed} alibi={args.alibi} "
              f"ordered={args.ordered} dropout={args.dropout} "
              f"{args.hopper_config or 'table'}: "
              f"{resource_usage(compiled)} shared {compiled.metadata.shared} wgmma {ptx.count('wgmma.mma_async')} "
              f"atomics {ptx.count('atom.global')} reductions {ptx.count('cp.reduce.async.bulk')}")
        return
    if args.kernel == "fwd-hopper":
        config = None
        if args.hopper_config:
            from flashtriton.configs import HopperFwdConfig

            block_n, stages, regs, *rest = args.hopper_config.split(",")
            flags, threshold = [bool(int(flag)) for flag in rest[:3]], [float(value) for value in rest[3:4]]
            consumers = [int(value) for value in rest[4:5]]
            config = HopperFwdConfig(int(block_n), int(stages), int(regs), *flags, *threshold, *consumers)
        compiled = compile_hopper_fwd(args.head_dim, args.causal, config, local=args.local,
                                      head_dim_v=args.head_dim_v or 0, varlen=args.packed,
                                      alibi=args.alibi, dropout=args.dropout, sinks=args.sinks, paged=args.paged)
        print(f"fwd-hopper d{args.head_dim} dv{args.head_dim_v or args.head_dim} causal={args.causal} "
              f"local={args.local} varlen={args.packed or args.paged} paged={args.paged} alibi={args.alibi} "
              f"dropout={args.dropout} sinks={args.sinks} "
              f"{args.hopper_config or 'table'}: "
              f"{resource_usage(compiled)} "
              f"shared {compiled.metadata.shared} wgmma {compiled.asm['ptx'].count('wgmma.mma_async')} "
              f"setmaxnreg {compiled.asm['ptx'].count('setmaxnreg')} "
              f"exp2_before_pv_wait {exp2_before_pv_wait(compiled.asm['cubin'])} "
              f"rescale_skip_branches {warp_vote_branches(compiled.asm['cubin'])}")
        return
    block_m, block_n, warps, stages = (int(x) for x in args.config.split(","))
    compiled = compile_kernel(KERNELS[args.kernel], args.head_dim, args.local, block_m, block_n, warps, stages,
                              dtype="fp8e4nv" if args.fp8 else "bf16", dropout=args.dropout, pack_gqa=args.pack_gqa, paged=args.paged,
                              tma_device=args.tma_device, packed=args.packed, dq_atomic=args.dq_atomic,
                              head_dim_v=args.head_dim_v)
    print(f"{args.kernel} d{args.head_dim} dv{args.head_dim_v or args.head_dim} local={args.local} dropout={args.dropout} pack_gqa={args.pack_gqa} "
          f"paged={args.paged} tma_device={args.tma_device} packed={args.packed} dq_atomic={args.dq_atomic} "
          f"{args.config}: "
          f"{resource_usage(compiled)} "
          f"shared {compiled.metadata.shared} wgmma {compiled.asm['ptx'].count('wgmma.mma_async')}")


def sass_of(cubin: bytes) -> tuple:
    """(instructions, labels) of a cubin by the bundled nvdisasm: instruction texts in address order (without
    address and `;`: kernel_inspect.parse_sass), and each branch label's index into them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run([bundled_tool("nvdisasm"), "-c", handle.name], capture_output=True, text=True,
                              check=True).stdout
    instructions, labels = parse_sass(text)
    index = {address: position for position, (address, _) in enumerate(instructions)}
    return [text for _, text in instructions], {name: index[address] for name, address in labels.items()}


def exp2_before_pv_wait(cubin: bytes, until_product: bool = False) -> list:
    """For each consumer loop of the Gluon forward (kernels/hopper/fwd._key_blocks), the MUFU.EX2 count between its
    S wait (WARPGROUP.DEPBAR.LE gsb0, 0x1; 0x2 where P V is two wgmmas, one per chunk of V's head dim) and its P V
    wait (0x0), following the unmasked block's path (taken `@P BRA`s and plain `BRA`s; `@!P BRA`s are barrier-wait
    retries): the part of the softmax that overlaps P V.
    A block's softmax is BLOCK_N / 2 + 2 exp2s per thread, so BLOCK_N / 2 + 2 means all of it; 0, that ptxas waits
    for P V first. None for a loop whose walk did not reach a wait. The same walk on the Gluon backward
    (kernels/hopper/bwd.py) counts P's exp2s between its S wait and its dP wait; with `until_product`, up to the
    wait or the next wgmma issued (its key-major tiles issue dV from P^T in registers before they wait for dP)."""
    instructions, labels = sass_of(cubin)
    counts = []
    for start, text in enumerate(instructions):
        if not re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x[12]\b", text):
            continue
        index, exp2s, count = start + 1, 0, None
        for _ in range(len(instructions)):
            if index >= len(instructions):
                break
            if "HGMMA" in instructions[index]:
                count = exp2s if until_product else None
                break
            line = instructions[index]
            if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
                count = exp2s
                break
            exp2s += "MUFU.EX2" in line
            branch = re.search(r"^(@P\d+\s+)?BRA `\((\.L_x_\d+)\)", line)
            index = labels[branch.group(2)] if branch else index + 1
        counts.append(count)
    return counts


def warp_vote_branches(cubin: bytes) -> int:
    """How many `VOTE.ANY Pn` of the SASS are followed, within 32 instructions, by a branch on `!Pn`: in the Gluon
    forward, the rescale skip's warp-uniform branch around the output's multiplies (kernels/hopper/fwd_softmax.rescale;
    ptxas schedules P's conversions between the two). 0 where the kernel has no skip."""
    instructions, _ = sass_of(cubin)
    count = 0
    for index, text in enumerate(instructions):
        vote = re.search(r"VOTE\.ANY (P\d),", text)
        if vote:
            count += any(f"@!{vote.group(1)} BRA" in line for line in instructions[index + 1:index + 33])
    return count


def resource_usage(compiled) -> str:
    """REG / STACK / local-memory line of `cuobjdump --dump-resource-usage` on the cubin."""
    tool = bundled_tool("cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(compiled.asm["cubin"])
        handle.flush()
        text = subprocess.run([tool, "--dump-resource-usage", handle.name], capture_output=True, text=True).stdout
    line = next((x for x in text.splitlines() if "REG:" in x), text)
    return " ".join(line.split())


if __name__ == "__main__":
    main()

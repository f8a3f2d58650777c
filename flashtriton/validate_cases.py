"""The cases `flashtriton validate` runs: the sizes of a run (Plan), the public API paths, the varlen sequences and
flash_attn_with_kvcache configurations, and the random inputs each case gets (flashtriton.validate_checks checks
them, flashtriton.validate runs and reports)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import bench
from .interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                        flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from .testing import Case, cu_seqlens

FUNCTIONS = {fn.__name__: fn for fn in (flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func,
                                         flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func,
                                         flash_attn_varlen_kvpacked_func)}
# Page sizes of the paged K/V checks: one that is not a power of two, one that is.
PAGE_SIZES = (48, 16)
# Varlen inputs get this many rows after the last sequence (they must come back 0), and the kernels get
# max_seqlen = true maximum + this slack (max_seqlen is an upper bound in the API).
VARLEN_TAIL = 3
MAX_SEQLEN_SLACK = 4
# flash_attn_with_kvcache: the page size of its paged cache (not a power of two).
KVCACHE_PAGE_SIZE = 48


@dataclass(frozen=True)
class ApiPath:
    """A public function; for flash_attn_varlen_func and flash_attn_with_kvcache also the page size of a paged K/V
    cache (block_table)."""

    function: str
    page_size: Optional[int] = None

    @property
    def name(self) -> str:
        return self.function if self.page_size is None else f"{self.function} paged{self.page_size}"

    @property
    def is_varlen(self) -> bool:
        return "varlen" in self.function

    @property
    def packing(self) -> str:
        """What the function packs into one tensor: 'qkv', 'kv', or '' for separate q, k, v."""
        return "qkv" if "qkvpacked" in self.function else "kv" if "kvpacked" in self.function else ""

    @property
    def has_backward(self) -> bool:
        return self.page_size is None


DENSE_PATH = ApiPath("flash_attn_func")
VARLEN_PATH = ApiPath("flash_attn_varlen_func")
API_PATHS = (tuple(ApiPath(name) for name in FUNCTIONS)
             + tuple(ApiPath(VARLEN_PATH.function, page_size) for page_size in PAGE_SIZES))
KVCACHE_PATHS = tuple(ApiPath(flash_attn_with_kvcache.__name__, page_size) for page_size in (None, KVCACHE_PAGE_SIZE))


@dataclass(frozen=True)
class Plan:
    """Sizes of one validation run (interpreter sizes on CPU, larger ones on CUDA)."""

    batch: int
    heads: int
    api_seqlen: int
    api_head_dim: int
    api_dtypes: tuple
    sweep_seqlens: tuple    # (seqlen_q, seqlen_k) pairs
    sweep_head_dims: tuple
    bwd_cases: tuple        # (seqlen_q, seqlen_k, head_dim)
    edge_seqlen: int
    varlen_lens: tuple      # (lens_q, lens_k) of the varlen API paths
    latency_shapes: tuple = ()
    kv_batch: int = 2       # flash_attn_with_kvcache: batch rows and keys each cache row holds
    kv_capacity: int = 96

    @property
    def window(self) -> tuple:
        """(32, 32) at interpreter sizes, a quarter of the sequence on each side at GPU sizes."""
        side = max(32, self.api_seqlen // 4)
        return side, side


def validated_dtypes() -> tuple:
    """The dtypes of the accuracy and backward sections: fp16 and bf16, on a GPU and in the interpreter alike."""
    return (torch.float16, torch.bfloat16)


def make_plan(device_type: str, full: bool) -> Plan:
    both = validated_dtypes()
    # Sequences with Sq > Sk, an empty query, a 1-length one, queries without any key and Sq < Sk.
    cpu_varlen = ((40, 0, 1, 30, 18), (23, 9, 1, 0, 61))
    if device_type == "cpu":
        if not full:
            return Plan(1, 2, 96, 64, (torch.float16,), ((128, 128), (77, 113)), (64, 128),
                        ((128, 128, 64), (113, 77, 128)), 64, cpu_varlen)
        return Plan(2, 2, 96, 64, both, ((17, 17), (64, 64), (128, 128), (77, 113), (113, 77), (200, 200)),
                    (32, 40, 64, 96, 128, 256),
                    ((17, 17, 32), (64, 64, 64), (128, 128, 128), (77, 113, 96), (113, 77, 64), (128, 128, 256)), 96,
                    (cpu_varlen[0] + (77,), cpu_varlen[1] + (128,)), kv_batch=3, kv_capacity=128)
    quick_latency = (bench.Shape(4, 4096, 16, 128),)
    gpu_varlen = ((700, 0, 1, 300, 517, 128), (411, 64, 1, 0, 1000, 128))
    if not full:
        return Plan(2, 4, 512, 128, (torch.float16,), ((128, 128), (1024, 1024), (333, 1000)), (64, 128, 256),
                    ((1024, 1024, 128), (333, 1000, 64), (1000, 333, 256)), 256, gpu_varlen, quick_latency,
                    kv_batch=4, kv_capacity=1000)
    return Plan(2, 4, 1024, 128, both,
                ((1, 1), (128, 128), (1024, 1024), (333, 1000), (1000, 333), (2048, 2048), (4096, 4096)),
                (32, 64, 96, 128, 256),
                ((1024, 1024, 128), (333, 1000, 64), (1000, 333, 256), (2048, 2048, 128), (4096, 4096, 64)), 512,
                (gpu_varlen[0] + (2049,), gpu_varlen[1] + (3000,)),
                quick_latency + (bench.Shape(4, 4096, 32, 64), bench.Shape(4, 4096, 8, 256),
                                 bench.Shape(1, 16384, 16, 128)),
                kv_batch=5, kv_capacity=5000)


@dataclass(frozen=True)
class VarlenBatch:
    """The sequences of a varlen call: lengths, the max_seqlen arguments and uncovered rows after the last one."""

    lens_q: tuple
    lens_k: tuple
    max_seqlen_q: int
    max_seqlen_k: int
    tail: int = VARLEN_TAIL

    @classmethod
    def from_lengths(cls, lens_q: Sequence[int], lens_k: Sequence[int], slack: int = MAX_SEQLEN_SLACK,
                     tail: int = VARLEN_TAIL) -> "VarlenBatch":
        return cls(tuple(lens_q), tuple(lens_k), max(lens_q) + slack, max(lens_k) + slack, tail)

    @property
    def total_q(self) -> int:
        return sum(self.lens_q) + self.tail

    @property
    def total_k(self) -> int:
        return sum(self.lens_k) + self.tail

    def cu_seqlens(self, device) -> tuple:
        """(cu_seqlens_q, cu_seqlens_k), int32 cumulative starts."""
        return tuple(cu_seqlens(lens, device) for lens in (self.lens_q, self.lens_k))


@dataclass(frozen=True)
class KVCase:
    """One flash_attn_with_kvcache configuration: seqlen_new keys appended to caches of `capacity` keys per row
    (paged: rounded up to whole pages), then seqlen_q queries attend to each row's keys."""

    batch: int
    capacity: int
    num_heads: int
    num_heads_k: int
    head_dim: int
    dtype: torch.dtype
    seqlen_q: int = 1
    seqlen_new: int = 1
    causal: bool = False
    softcap: float = 0.0
    alibi: bool = False
    rotary_dim: int = 0             # 0: no rotary; else interleaved (GPT-J) rotary on that many features
    batch_idx_leftpad: bool = False  # cache_batch_idx into a cache of batch + 2 rows, and cache_leftpad
    page_size: Optional[int] = None
    num_splits: tuple = (0,)        # each value is run and checked; several must agree with each other
    softmax_scale: Optional[float] = None

    @property
    def pages_per_row(self) -> int:
        return -(-self.capacity // self.page_size)

    @property
    def row_capacity(self) -> int:
        return self.capacity if self.page_size is None else self.pages_per_row * self.page_size


def make_kvcache_inputs(case: KVCase, device) -> tuple:
    """(q, k_cache, v_cache, keyword arguments of flash_attn_with_kvcache and kvcache_reference), in case.dtype.

    Row 0's new keys end exactly at the capacity; paged, row 1's start at the last slot of a page; the next row's
    cache is empty; further rows are random. Paged caches have shuffled pages and one page that no row uses.
    """
    gen = dict(device=device)
    room = case.row_capacity - case.seqlen_new
    lengths = torch.randint(0, room + 1, (case.batch,), **gen)
    edges = (room, 0) if case.page_size is None else (room, min(room, case.page_size - 1), 0)
    for row, length in enumerate(edges[:case.batch]):
        lengths[row] = length
    inputs = dict(cache_seqlens=lengths.to(torch.int32))
    cache_rows = case.batch + 2 if case.batch_idx_leftpad else case.batch
    cache_shape = (cache_rows, case.capacity, case.num_heads_k, case.head_dim)
    if case.page_size is not None:
        num_pages = case.batch * case.pages_per_row + 1
        table = torch.randperm(num_pages, **gen)[:case.batch * case.pages_per_row]
        inputs["block_table"] = table.view(case.batch, case.pages_per_row).to(torch.int32)
        cache_shape = (num_pages, case.page_size, case.num_heads_k, case.head_dim)
    k_cache, v_cache = (torch.randn(cache_shape, **gen).to(case.dtype) for _ in range(2))
    new_shape = (case.batch, case.seqlen_new, case.num_heads_k, case.head_dim)
    inputs["k"], inputs["v"] = (torch.randn(new_shape, **gen).to(case.dtype) for _ in range(2))
    if case.batch_idx_leftpad:
        inputs["cache_batch_idx"] = torch.randperm(cache_rows, **gen)[:case.batch].to(torch.int32)
        leftpad = torch.randint(0, 40, (case.batch,), **gen).minimum(lengths)
        inputs["cache_leftpad"] = leftpad.to(torch.int32)
    if case.rotary_dim:
        angles = torch.rand(case.row_capacity, case.rotary_dim // 2, **gen) * 6.28
        inputs.update(rotary_cos=angles.cos().to(case.dtype), rotary_sin=angles.sin().to(case.dtype),
                      rotary_interleaved=True)
    if case.alibi:
        inputs["alibi_slopes"] = torch.rand(case.num_heads, **gen) * 0.5
    q = torch.randn(case.batch, case.seqlen_q, case.num_heads, case.head_dim, **gen).to(case.dtype)
    return q, k_cache, v_cache, inputs


def make_varlen_inputs(case: Case, batch: VarlenBatch, device="cpu", scale: float = 1.0) -> tuple:
    """Fresh random packed (q (total_q, H, D), k, v (total_k, Hk, D), alibi_slopes (batch, H)), in case.dtype.

    Only the case's heads, head dim, dtype and alibi flag are used; the rows come from `batch`.
    """
    shape_q = (batch.total_q, case.num_heads, case.head_dim)
    shape_k = (batch.total_k, case.num_heads_k, case.head_dim)
    q, k, v = ((torch.randn(shape, device=device) * scale).to(case.dtype) for shape in (shape_q, shape_k, shape_k))
    slopes = None
    if case.alibi:
        slopes = torch.rand(len(batch.lens_q), case.num_heads, device=device, dtype=torch.float32) * 0.5
    return q, k, v, slopes


def paginate(k: torch.Tensor, v: torch.Tensor, batch: VarlenBatch, page_size: int) -> tuple:
    """(k_cache, v_cache, block_table): each sequence's keys scattered into shuffled pages of a random cache."""
    num_seqs = len(batch.lens_k)
    pages_per_seq = -(-batch.max_seqlen_k // page_size)
    num_pages = num_seqs * pages_per_seq + 2  # two pages no sequence uses
    block_table = torch.randperm(num_pages, device=k.device)[: num_seqs * pages_per_seq]
    block_table = block_table.view(num_seqs, pages_per_seq).to(torch.int32)
    caches = []
    for packed in (k, v):
        cache = torch.randn(num_pages, page_size, *packed.shape[1:], device=k.device).to(packed.dtype)
        start = 0
        for seq, length in enumerate(batch.lens_k):
            positions = torch.arange(length, device=k.device)
            pages = block_table[seq, positions // page_size].long()
            cache[pages, positions % page_size] = packed.detach()[start:start + length]
            start += length
        caches.append(cache)
    return caches[0], caches[1], block_table


def api_call(path: ApiPath, q, k, v, with_grad: bool, varlen: Optional[VarlenBatch] = None):
    """(leaves to differentiate, fn(**options) -> (out, lse, S_dmask)) for one public API path."""
    def leaf(t):
        return t.detach().clone().requires_grad_(with_grad)

    function = FUNCTIONS[path.function]
    pack_dim = q.dim() - 2
    extra = {}
    if path.packing == "qkv":
        leaves = (leaf(torch.stack((q, k, v), dim=pack_dim)),)
    elif path.packing == "kv":
        leaves = (leaf(q), leaf(torch.stack((k, v), dim=pack_dim)))
    elif path.page_size is not None:
        k_cache, v_cache, extra["block_table"] = paginate(k, v, varlen, path.page_size)
        leaves = (leaf(q), leaf(k_cache), leaf(v_cache))
    else:
        leaves = (leaf(q), leaf(k), leaf(v))
    sequences = ()
    if path.is_varlen:
        cu_seqlens_q, cu_seqlens_k = varlen.cu_seqlens(q.device)
        sequences = ((cu_seqlens_q, varlen.max_seqlen_q) if path.packing == "qkv"
                     else (cu_seqlens_q, cu_seqlens_k, varlen.max_seqlen_q, varlen.max_seqlen_k))
    return leaves, lambda **o: function(*leaves, *sequences, **o, **extra)


def unpack_grads(path: ApiPath, grads, pack_dim: int) -> tuple:
    """(dq, dk, dv) from the gradients of an API path's leaves; packed leaves stack along pack_dim."""
    if path.packing == "qkv":
        return tuple(grads[0].unbind(dim=pack_dim))
    if path.packing == "kv":
        return (grads[0], *grads[1].unbind(dim=pack_dim))
    return tuple(grads)


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

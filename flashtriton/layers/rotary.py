"""flash_attn.layers.rotary: rotary position embeddings with autograd, and the RotaryEmbedding module (docs/api.md §9.2).

The rotation itself is flashtriton.ops.triton.rotary.apply_rotary. Its adjoint (for backward) is the same
rotation with sin negated (conjugate=True), also with XPos-scaled tables, since scaling commutes with it.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ..ops.triton.rotary import apply_rotary

Offsets = Union[int, torch.Tensor]


def rotate_half(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Non-interleaved: cat(-x2, x1) of the two halves. Interleaved: pairs (x_even, x_odd) -> (-x_odd, x_even)."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x_odd, x_even), dim=-1).flatten(-2)


def apply_rotary_emb_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           interleaved: bool = False) -> torch.Tensor:
    """Pure-PyTorch reference in the promoted dtype of x and cos: x (B, S, H, D), cos/sin (S, r/2) or (B, S, r/2).

    Position s uses table row s (no offsets); tables with more than S rows are cut to the first S.
    """
    rotary_dim = 2 * cos.shape[-1]
    assert rotary_dim <= x.shape[-1], f"rotary_dim must be <= headdim (rotary_dim {rotary_dim}, headdim {x.shape[-1]})"
    seqlen = x.shape[1]
    # (..., S, 1, r): each angle covers both features of its pair
    cos, sin = (t[..., :seqlen, :] for t in (cos, sin))
    if interleaved:
        cos, sin = (t.repeat_interleave(2, dim=-1).unsqueeze(-2) for t in (cos, sin))
    else:
        cos, sin = (torch.cat((t, t), dim=-1).unsqueeze(-2) for t in (cos, sin))
    x_rot = x[..., :rotary_dim]
    return torch.cat((x_rot * cos + rotate_half(x_rot, interleaved) * sin, x[..., rotary_dim:]), dim=-1)


class ApplyRotaryEmb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved=False, inplace=False, seqlen_offsets: Offsets = 0,
                cu_seqlens=None, max_seqlen=None):
        out = apply_rotary(x, cos, sin, seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                           interleaved=interleaved, inplace=inplace)
        offsets_tensor = seqlen_offsets if isinstance(seqlen_offsets, torch.Tensor) else None
        ctx.save_for_backward(cos, sin, cu_seqlens, offsets_tensor)
        ctx.seqlen_offsets = None if offsets_tensor is not None else seqlen_offsets
        ctx.interleaved, ctx.max_seqlen = interleaved, max_seqlen
        if inplace:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        cos, sin, cu_seqlens, offsets_tensor = ctx.saved_tensors
        offsets = offsets_tensor if offsets_tensor is not None else ctx.seqlen_offsets
        grad_x = apply_rotary(grad_out, cos, sin, seqlen_offsets=offsets, cu_seqlens=cu_seqlens,
                              max_seqlen=ctx.max_seqlen, interleaved=ctx.interleaved, conjugate=True)
        return grad_x, None, None, None, None, None, None, None


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets: Offsets = 0, cu_seqlens: Optional[torch.Tensor] = None,
                     max_seqlen: Optional[int] = None) -> torch.Tensor:
    """Rotary embedding of x (B, S, H, D), or (T, H, D) with cu_seqlens (B+1,) and max_seqlen.

    cos, sin: (seqlen_ro, rotary_dim / 2). Token s of sequence b is at position s + seqlen_offsets[b]
    (int or int32/int64 (B,) tensor); with a tensor offset, positions >= seqlen_ro are left unrotated.
    Features >= rotary_dim pass through. Differentiable w.r.t. x; inplace=True writes into x.
    """
    return ApplyRotaryEmb.apply(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


apply_rotary_emb_func = apply_rotary_emb


def _qk_parts(qkv: torch.Tensor, num_heads_q: Optional[int]):
    """(q, k, qk): views of the query heads, the key heads, and both together (None if no single view exists)."""
    if qkv.dim() == 5:
        assert qkv.shape[2] == 3, f"qkv must have shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}"
        q, k = qkv[:, :, 0], qkv[:, :, 1]
        batch, seqlen, _, num_heads, head_dim = qkv.shape
        joinable = qkv.stride(2) == num_heads * qkv.stride(3)
        qk = qkv[:, :, :2].view(batch, seqlen, 2 * num_heads, head_dim) if joinable else None
        return q, k, qk
    assert qkv.dim() == 4, f"qkv must have 5 dims (batch, seqlen, 3, nheads, headdim) or 4, got {tuple(qkv.shape)}"
    assert num_heads_q is not None, (
        "num_heads_q must be given when qkv has shape (batch, seqlen, nheads_q + 2 * nheads_k, headdim)")
    num_heads_k = (qkv.shape[2] - num_heads_q) // 2
    assert qkv.shape[2] == num_heads_q + 2 * num_heads_k, (
        f"qkv has {qkv.shape[2]} heads, which is not num_heads_q ({num_heads_q}) + 2 * num_heads_k")
    num_qk = num_heads_q + num_heads_k
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_qk], qkv[:, :, :num_qk]


def _rotate_qk_(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q, conjugate):
    """Rotate q and k of qkv in place; one launch when they share tables and a single view holds both."""
    q, k, qk = _qk_parts(qkv, num_heads_q)
    if cos_k is None and sin_k is None and qk is not None:
        apply_rotary(qk, cos, sin, seqlen_offsets, interleaved=interleaved, inplace=True, conjugate=conjugate)
        return
    cos_k = cos if cos_k is None else cos_k
    sin_k = sin if sin_k is None else sin_k
    apply_rotary(q, cos, sin, seqlen_offsets, interleaved=interleaved, inplace=True, conjugate=conjugate)
    apply_rotary(k, cos_k, sin_k, seqlen_offsets, interleaved=interleaved, inplace=True, conjugate=conjugate)


def _save_offsets(ctx, seqlen_offsets: Offsets, *tensors) -> None:
    offsets_tensor = seqlen_offsets if isinstance(seqlen_offsets, torch.Tensor) else None
    ctx.save_for_backward(*tensors, offsets_tensor)
    ctx.seqlen_offsets = None if offsets_tensor is not None else seqlen_offsets


def _saved_with_offsets(ctx):
    *tensors, offsets_tensor = ctx.saved_tensors
    return tensors, offsets_tensor if offsets_tensor is not None else ctx.seqlen_offsets


class ApplyRotaryEmbQKV_(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets: Offsets = 0,
                num_heads_q=None):
        _rotate_qk_(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q, conjugate=False)
        _save_offsets(ctx, seqlen_offsets, cos, sin, cos_k, sin_k)
        ctx.interleaved, ctx.num_heads_q = interleaved, num_heads_q
        ctx.mark_dirty(qkv)
        return qkv

    @staticmethod
    def backward(ctx, grad_qkv):
        (cos, sin, cos_k, sin_k), offsets = _saved_with_offsets(ctx)
        grad_qkv = grad_qkv.clone(memory_format=torch.contiguous_format)
        _rotate_qk_(grad_qkv, cos, sin, cos_k, sin_k, ctx.interleaved, offsets, ctx.num_heads_q, conjugate=True)
        return grad_qkv, None, None, None, None, None, None, None


def apply_rotary_emb_qkv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          cos_k: Optional[torch.Tensor] = None, sin_k: Optional[torch.Tensor] = None,
                          interleaved: bool = False, seqlen_offsets: Offsets = 0,
                          num_heads_q: Optional[int] = None) -> torch.Tensor:
    """Rotate q and k of qkv in place and return qkv: (B, S, 3, H, D), or (B, S, Hq + 2 Hk, D) with num_heads_q.

    cos_k / sin_k (e.g. XPos) default to cos / sin. Differentiable.
    """
    return ApplyRotaryEmbQKV_.apply(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q)


class ApplyRotaryEmbKV_(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, cos, sin, interleaved=False, seqlen_offsets: Offsets = 0):
        assert kv.dim() == 5 and kv.shape[2] == 2, (
            f"kv must have shape (batch, seqlen, 2, nheads, headdim), got {tuple(kv.shape)}")
        apply_rotary(kv[:, :, 0], cos, sin, seqlen_offsets, interleaved=interleaved, inplace=True)
        _save_offsets(ctx, seqlen_offsets, cos, sin)
        ctx.interleaved = interleaved
        ctx.mark_dirty(kv)
        return kv

    @staticmethod
    def backward(ctx, grad_kv):
        (cos, sin), offsets = _saved_with_offsets(ctx)
        grad_kv = grad_kv.clone(memory_format=torch.contiguous_format)
        apply_rotary(grad_kv[:, :, 0], cos, sin, offsets, interleaved=ctx.interleaved, inplace=True, conjugate=True)
        return grad_kv, None, None, None, None


def apply_rotary_emb_kv_(kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                         seqlen_offsets: Offsets = 0) -> torch.Tensor:
    """Rotate k = kv[:, :, 0] of kv (B, S, 2, H, D) in place and return kv. Differentiable."""
    return ApplyRotaryEmbKV_.apply(kv, cos, sin, interleaved, seqlen_offsets)


class RotaryEmbedding(torch.nn.Module):
    """Rotary embedding (RoFormer) with cached cos/sin tables; XPos scaling when scale_base is given.

    inv_freq = base^(-arange(0, dim, 2) / dim). The tables for positions t are cos/sin(t * inv_freq), built in
    fp32 and cast to the input's dtype; they grow to the needed length and are rebuilt when the dtype or
    device changes. XPos (scale_base) multiplies q's tables by zeta^((t - L // 2) / scale_base) and divides
    k's by it, with zeta = (arange(0, dim, 2) + 0.4 dim) / (1.4 dim) and L the cached length, so q.k is
    scaled by zeta^((t_q - t_k) / scale_base).
    """

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False,
                 scale_base: Optional[float] = None, device=None):
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self.scale_base = scale_base
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        scale = None
        if scale_base is not None:
            scale = (torch.arange(0, dim, 2, device=device, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None
        self._cos_k_cached = None
        self._sin_k_cached = None

    def _compute_inv_freq(self, device=None) -> torch.Tensor:
        exponents = torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim
        return 1.0 / (self.base ** exponents)

    def _needs_rebuild(self, seqlen: int, device, dtype) -> bool:
        cached = self._cos_cached
        return (cached is None or seqlen > self._seq_len_cached or cached.device != device
                or cached.dtype != dtype or (self.training and cached.is_inference()))

    def _update_cos_sin_cache(self, seqlen: int, device=None, dtype=None) -> None:
        """Make the cached tables cover positions [0, seqlen) in `dtype` on `device` (they never shrink)."""
        device = self.inv_freq.device if device is None else torch.device(device)
        dtype = torch.float32 if dtype is None else dtype
        if not self._needs_rebuild(seqlen, device, dtype):
            return
        seqlen = max(seqlen, self._seq_len_cached)
        self._seq_len_cached = seqlen
        # a module cast to half precision converts inv_freq too; the tables are always built from fp32
        inv_freq = self.inv_freq.to(device) if self.inv_freq.dtype == torch.float32 else self._compute_inv_freq(device)
        positions = torch.arange(seqlen, device=device, dtype=torch.float32)
        # (seqlen, dim / 2)
        freqs = torch.outer(positions, inv_freq)
        cos, sin = torch.cos(freqs), torch.sin(freqs)
        if self.scale is None:
            self._cos_cached, self._sin_cached = cos.to(dtype), sin.to(dtype)
            return
        power = (positions - seqlen // 2) / self.scale_base
        # (seqlen, dim / 2)
        scale = self.scale.to(device=device, dtype=torch.float32) ** power[:, None]
        self._cos_cached, self._sin_cached = (cos * scale).to(dtype), (sin * scale).to(dtype)
        self._cos_k_cached, self._sin_k_cached = (cos / scale).to(dtype), (sin / scale).to(dtype)

    def forward(self, qkv: torch.Tensor, kv: Optional[torch.Tensor] = None, seqlen_offset: Offsets = 0,
                max_seqlen: Optional[int] = None,
                num_heads_q: Optional[int] = None) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Rotate in place. qkv: (B, S, 3, H, D) or (B, S, Hq + 2 Hk, D) with num_heads_q; or q (B, S, H, D) with
        kv (B, S, 2, H, D). Returns qkv, or (q, kv).

        The tables grow to max_seqlen when given, else to S + seqlen_offset for an int offset; a tensor offset
        without max_seqlen only needs S rows, and positions past the tables are left unrotated.
        """
        seqlen = qkv.shape[1]
        needed = seqlen + seqlen_offset if isinstance(seqlen_offset, int) else seqlen
        if max_seqlen is not None:
            needed = max(needed, int(max_seqlen))
        self._update_cos_sin_cache(needed, device=qkv.device, dtype=qkv.dtype)
        cos_k, sin_k = (self._cos_k_cached, self._sin_k_cached) if self.scale is not None else (None, None)
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached, cos_k, sin_k,
                                         interleaved=self.interleaved, seqlen_offsets=seqlen_offset,
                                         num_heads_q=num_heads_q)
        q = apply_rotary_emb_func(qkv, self._cos_cached, self._sin_cached, interleaved=self.interleaved,
                                  inplace=True, seqlen_offsets=seqlen_offset)
        kv = apply_rotary_emb_kv_(kv, self._cos_cached if cos_k is None else cos_k,
                                  self._sin_cached if sin_k is None else sin_k,
                                  interleaved=self.interleaved, seqlen_offsets=seqlen_offset)
        return q, kv

"""Exact PyTorch attention with every flash_attn 2.x semantic: the oracle of the tests and the CPU path.

Layout is flash_attn's padded one: q (B, Sq, H, D), k/v (B, Sk, Hk, D). Everything follows
docs/api.md §4 literally; nothing here is tuned for speed. Run it in float64 for an oracle, in
float32 for the CPU fallback, or in the input dtype to measure what PyTorch itself achieves there.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from .scores import normalize_window, score_params

__all__ = ["visible_mask", "attention_probabilities", "attention_reference", "attention_reference_backward",
           "attention_reference_varlen", "attention_reference_varlen_backward", "kvcache_reference", "rotate"]


def visible_mask(seqlen_q: int, seqlen_k: int, window_left: int, window_right: int, device=None) -> torch.Tensor:
    """Bool (Sq, Sk): key j visible to query i under bottom-right alignment with a normalized window."""
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    aligned = rows + (seqlen_k - seqlen_q)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_left >= 0:
        visible &= cols >= aligned - window_left
    if window_right >= 0:
        visible &= cols <= aligned + window_right
    return visible


def _alibi_bias(slopes: torch.Tensor, batch: int, seqlen_q: int, seqlen_k: int, pure_causal: bool,
                dtype) -> torch.Tensor:
    """(B, H, Sq, Sk) ALiBi bias in natural-log units, with FA2's pure-causal LSE quirk."""
    slopes = slopes.to(dtype)
    slopes = slopes.expand(batch, -1) if slopes.dim() == 1 else slopes
    rows = torch.arange(seqlen_q, device=slopes.device, dtype=dtype)[:, None]
    cols = torch.arange(seqlen_k, device=slopes.device, dtype=dtype)[None, :]
    if pure_causal:
        distance = -cols.expand(seqlen_q, seqlen_k)
    else:
        distance = (rows + (seqlen_k - seqlen_q) - cols).abs()
    return -slopes[:, :, None, None] * distance


class _Probabilities(NamedTuple):
    """Intermediates of one reference evaluation, in the compute dtype, heads expanded to H."""

    qc: torch.Tensor        # (B, Sq, H, D)
    kc: torch.Tensor        # (B, Sk, H, D)
    vc: torch.Tensor        # (B, Sk, H, D)
    probs: torch.Tensor     # (B, H, Sq, Sk) softmax, before dropout
    kept: torch.Tensor      # (B, H, Sq, Sk) probs after dropout and its 1/(1-p) rescale
    capped: Optional[torch.Tensor]  # (B, H, Sq, Sk) tanh(scaled scores / softcap), when softcap > 0
    lse: torch.Tensor       # (B, H, Sq), +inf on rows without a visible key
    scale: float


def _probabilities(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, dropout_mask,
                   seqlen_k_star, compute_dtype, given_lse=None, learnable_sink=None) -> _Probabilities:
    """given_lse (B, H, Sq): P = exp(S - given_lse) on the visible keys instead of the softmax of these scores (a
    backward from the forward's statistics). learnable_sink (H,): one more logit per row and head in the softmax's
    sum (natural-log units, no scale, softcap or ALiBi), carrying no value (docs/api.md §4.11)."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_heads_k = k.shape[1], k.shape[2]
    compute_dtype = compute_dtype or q.dtype
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    star = seqlen_k if seqlen_k_star is None else seqlen_k_star
    params = score_params(scale, causal, int(window_size[0]), int(window_size[1]), softcap, star)

    group = num_heads // num_heads_k
    qc = q.to(compute_dtype)
    kc = k.to(compute_dtype).repeat_interleave(group, dim=2)
    vc = v.to(compute_dtype).repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qc, kc) * scale
    capped = None
    if softcap > 0.0:
        capped = torch.tanh(scores / softcap)
        scores = softcap * capped
    if alibi_slopes is not None:
        scores = scores + _alibi_bias(alibi_slopes, batch, seqlen_q, seqlen_k, params.alibi_pure_causal,
                                      compute_dtype)
    visible = visible_mask(seqlen_q, seqlen_k, params.window_left, params.window_right, device=q.device)
    scores = scores.masked_fill(~visible, float("-inf"))

    if given_lse is not None:
        lse = given_lse.to(scores.dtype)
        probs = torch.exp(scores - lse[..., None]).masked_fill(~visible, 0.0)
    else:
        has_key = visible.any(dim=-1)  # (Sq,)
        # A finite pivot for rows with no visible key keeps logsumexp and its gradient free of NaN.
        safe_scores = torch.where(has_key[:, None], scores, torch.zeros((), dtype=scores.dtype, device=scores.device))
        lse = torch.logsumexp(safe_scores, dim=-1)
        if learnable_sink is not None:
            # (1, H, 1) sink logits; rows without a key: the sink is their only term
            sink = learnable_sink.to(scores.dtype)[None, :, None]
            lse = torch.logaddexp(torch.where(has_key, lse, float("-inf")), sink)
            has_key = torch.ones_like(has_key)
        probs = torch.exp(safe_scores - lse[..., None]).masked_fill(~visible, 0.0)
    kept = probs
    if dropout_p > 0.0:
        if dropout_mask is None:
            raise ValueError("attention_reference: dropout_p > 0 needs dropout_mask (the keep mask)")
        kept = probs.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
    if given_lse is None:
        lse = torch.where(has_key, lse, torch.full((), float("inf"), dtype=lse.dtype, device=lse.device))
    return _Probabilities(qc, kc, vc, probs, kept, capped, lse, scale)


def attention_probabilities(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            alibi_slopes=None, *, seqlen_k_star=None, compute_dtype=torch.float32,
                            learnable_sink=None) -> torch.Tensor:
    """(B, H, Sq, Sk) softmax probabilities before dropout; 0 where a key is not visible (with learnable_sink, the
    keys' share: rows sum to 1 - the sink's)."""
    return _probabilities(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, 0.0, None,
                          seqlen_k_star, compute_dtype, learnable_sink=learnable_sink).probs


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    dropout_mask: Optional[torch.Tensor] = None,
    *,
    seqlen_k_star: Optional[int] = None,
    compute_dtype: Optional[torch.dtype] = torch.float64,
    learnable_sink: Optional[torch.Tensor] = None,
    descales: Optional[Sequence[torch.Tensor]] = None,
    quantize_p: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention exactly as docs/api.md §4.1 defines it. Returns (out in q's dtype, lse (B, H, Sq) float32).

    descales: (q_descale, k_descale, v_descale), each (B, Hk) fp32, for FP8 (e4m3) q, k, v (docs/api.md §4.12):
    attention of the dequantized inputs with P in fp16 for the P.V product as the kernels take it (fp8_pv_operand,
    relative to each row's max; quantize_p=False: unrounded, the oracle of the dequantized inputs);
    out in bf16.

    compute_dtype: float64 for an oracle, float32 for the CPU path, None (or q.dtype) to do the
    math in the input dtype, which measures PyTorch's own rounding error there.
    dropout_mask: bool (B, H, Sq, Sk), True where kept; required when dropout_p > 0.
    seqlen_k_star: S* of the window normalization (defaults to Sk; varlen uses max_seqlen_k).
    learnable_sink: (H,) sink logits (docs/api.md §4.11): the lse includes them, and rows with no visible key give
    out 0 and lse = learnable_sink[h].
    Differentiable w.r.t. q, k, v (and learnable_sink); rows with no visible key give out 0, lse +inf (without a
    sink) and zero gradients.
    """
    if descales is not None:
        return _fp8_attention(q, k, v, descales, softmax_scale, causal, window_size, softcap, alibi_slopes,
                              seqlen_k_star, compute_dtype or torch.float32, learnable_sink, quantize_p)
    r = _probabilities(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, dropout_mask,
                       seqlen_k_star, compute_dtype, learnable_sink=learnable_sink)
    out = torch.einsum("bhqk,bkhd->bqhd", r.kept.to(r.vc.dtype), r.vc)
    return out.to(q.dtype).contiguous(), r.lse.to(torch.float32)


def fp8_pv_operand(relative: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """Probabilities relative to the row max (in [0, 1]) as the FP8 kernels multiply them by V (widened to fp16,
    exactly): rounded to fp16."""
    return relative.to(torch.float16).to(compute_dtype)


def _fp8_attention(q, k, v, descales, softmax_scale, causal, window_size, softcap, alibi_slopes, seqlen_k_star,
                   compute_dtype, learnable_sink, quantize_p):
    """attention_reference of FP8 inputs (descales given): the softmax of the dequantized scores; each row's
    probabilities relative to its max (what the kernels hold, in (0, 1]) rounded to fp16 for the product with V,
    normalized by the unrounded sum, times v_descale. Returns (out bf16, lse fp32)."""
    q_descale, k_descale, v_descale = (d.to(compute_dtype) for d in descales)
    group = q.shape[2] // k.shape[2]
    # (B, 1, H or Hk, 1) per-head factors
    q_factor = q_descale.repeat_interleave(group, dim=1)[:, None, :, None]
    qf = q.to(compute_dtype) * q_factor
    kf = k.to(compute_dtype) * k_descale[:, None, :, None]
    r = _probabilities(qf, kf, v.to(compute_dtype), softmax_scale, causal, window_size, softcap, alibi_slopes, 0.0,
                       None, seqlen_k_star, compute_dtype, learnable_sink=learnable_sink)
    # (B, H, Sq, 1) each row's largest probability: the kernels' P is probs / row_max, its sum 1 / row_max
    row_max = r.probs.amax(dim=-1, keepdim=True)
    relative = torch.where(row_max > 0, r.probs / torch.where(row_max > 0, row_max, 1.0), 0.0)
    if quantize_p:
        relative = fp8_pv_operand(relative, compute_dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", relative * row_max, r.vc)
    out = out * v_descale.repeat_interleave(group, dim=1)[:, None, :, None]
    return out.to(torch.bfloat16).contiguous(), r.lse.to(torch.float32)


def attention_reference_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    dropout_mask: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
    seqlen_k_star: Optional[int] = None,
    compute_dtype: Optional[torch.dtype] = torch.float32,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of attention_reference written out (docs/api.md §4.10), without autograd.

    Used where autograd is unavailable (inside custom ops); GQA gradients are summed over each group.
    out (B, Sq, H, D) and lse (B, H, Sq), given together, are the forward's: the backward then uses them as FA2's
    does (P = exp(S - lse), delta = rowsum(dout * out)) instead of recomputing them from q, k, v, so a blockwise
    caller (ring attention) that passes the whole sequence's out and lse gets each key block's share of the gradients.
    """
    if (out is None) != (lse is None):
        raise ValueError("attention_reference_backward: out and lse are given together or not at all")
    r = _probabilities(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, dropout_mask,
                       seqlen_k_star, compute_dtype, given_lse=lse)
    do = dout.to(r.vc.dtype)
    dv = torch.einsum("bhqk,bqhd->bkhd", r.kept, do)
    d_kept = torch.einsum("bqhd,bkhd->bhqk", do, r.vc)
    d_probs = d_kept if dropout_p <= 0.0 else d_kept.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
    if out is None:
        delta = (r.probs * d_probs).sum(-1, keepdim=True)
    else:
        delta = (do * out.to(do.dtype)).sum(-1).transpose(1, 2)[..., None]
    d_scores = r.probs * (d_probs - delta)
    if r.capped is not None:
        d_scores = d_scores * (1.0 - r.capped * r.capped)
    dq = torch.einsum("bhqk,bkhd->bqhd", d_scores, r.kc) * r.scale
    dk = torch.einsum("bhqk,bqhd->bkhd", d_scores, r.qc) * r.scale
    num_heads_k = k.shape[2]
    group = q.shape[2] // num_heads_k
    dk = dk.unflatten(2, (num_heads_k, group)).sum(3)
    dv = dv.unflatten(2, (num_heads_k, group)).sum(3)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def row_slopes(alibi_slopes: Optional[torch.Tensor], b: int) -> Optional[torch.Tensor]:
    """ALiBi slopes of batch row (or varlen sequence) b, as attention_reference takes them."""
    if alibi_slopes is None:
        return None
    return alibi_slopes[b : b + 1] if alibi_slopes.dim() == 2 else alibi_slopes


def _sequence_mask(mask: Optional[torch.Tensor], b: int, rows_q: slice, rows_k: slice) -> Optional[torch.Tensor]:
    """Sequence b's (1, H, Sq_b, Sk_b) corner of a (B, H, rows, cols) varlen dropout mask."""
    if mask is None:
        return None
    return mask[b : b + 1, :, : rows_q.stop - rows_q.start, : rows_k.stop - rows_k.start]


def sequence_slices(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    """(b, q rows, k rows) of every varlen sequence, as slices of the packed first dimension."""
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        yield b, slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])


def attention_reference_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_k: int,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    *,
    dropout_p: float = 0.0,
    dropout_mask: Optional[torch.Tensor] = None,
    compute_dtype: Optional[torch.dtype] = torch.float64,
    learnable_sink: Optional[torch.Tensor] = None,
    descales: Optional[Sequence[torch.Tensor]] = None,
    quantize_p: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention (docs/api.md §4.9): each sequence on its own, window normalized with S* = max_seqlen_k.
    descales: FP8 inputs' (q, k, v) descales, (B, Hk) each (attention_reference's); out then bf16.

    q (Tq, H, D), k/v (Tk, Hk, D). Returns (out (Tq, H, D), lse (H, Tq)); uncovered rows are 0 / +inf (lse =
    learnable_sink[h] with a sink).
    dropout_mask: bool (B, H, >= max Sq, >= max Sk) in each sequence's local indices.
    """
    total_q, num_heads, head_dim = q.shape
    out = torch.zeros(total_q, num_heads, v.shape[-1], dtype=torch.bfloat16 if descales else q.dtype,
                      device=q.device)
    lse = torch.full((num_heads, total_q), float("inf"), dtype=torch.float32, device=q.device)
    for b, rows_q, rows_k in sequence_slices(cu_seqlens_q, cu_seqlens_k):
        if rows_q.stop == rows_q.start:
            continue
        out_b, lse_b = attention_reference(
            q[None, rows_q], k[None, rows_k], v[None, rows_k], softmax_scale, causal, window_size, softcap,
            row_slopes(alibi_slopes, b), dropout_p, _sequence_mask(dropout_mask, b, rows_q, rows_k),
            seqlen_k_star=max_seqlen_k, compute_dtype=compute_dtype, learnable_sink=learnable_sink,
            descales=None if descales is None else [d[b:b + 1] for d in descales], quantize_p=quantize_p)
        out[rows_q] = out_b[0]
        lse[:, rows_q] = lse_b[0]
    if learnable_sink is not None:  # rows of no sequence see no key: their lse is the sink
        covered = torch.zeros(total_q, dtype=torch.bool, device=q.device)
        covered[int(cu_seqlens_q[0]):int(cu_seqlens_q[-1])] = True
        lse = torch.where(covered, lse, learnable_sink.to(lse.dtype)[:, None])
    return out, lse


def attention_reference_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_k: int,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    *,
    dropout_p: float = 0.0,
    dropout_mask: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
    compute_dtype: Optional[torch.dtype] = torch.float32,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of attention_reference_varlen without autograd; uncovered rows get 0. out (Tq, H, D) and lse
    (H, Tq): the forward's, used as attention_reference_backward uses them."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for b, rows_q, rows_k in sequence_slices(cu_seqlens_q, cu_seqlens_k):
        grads = attention_reference_backward(
            dout[None, rows_q], q[None, rows_q], k[None, rows_k], v[None, rows_k], softmax_scale, causal,
            window_size, softcap, row_slopes(alibi_slopes, b), dropout_p,
            _sequence_mask(dropout_mask, b, rows_q, rows_k), out=None if out is None else out[None, rows_q],
            lse=None if lse is None else lse[None, :, rows_q], seqlen_k_star=max_seqlen_k,
            compute_dtype=compute_dtype)
        for target, grad, rows in zip((dq, dk, dv), grads, (rows_q, rows_k, rows_k)):
            target[rows] = grad[0]
    return dq, dk, dv


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary embedding of docs/api.md §9.2 on the first 2 * cos.shape[-1] features of x (..., D), in fp32.

    cos/sin broadcast against x's leading dims with a last dim of rotary_dim / 2.
    """
    half = cos.shape[-1]
    x32 = x.float()
    rot, rest = x32[..., : 2 * half], x32[..., 2 * half:]
    cos, sin = cos.float(), sin.float()
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        rotated = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return torch.cat((rotated, rest), dim=-1).to(x.dtype)


def _table_rows(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor):
    """(cos, sin) rows (len, 1, r/2) of the positions; a position past the table is not rotated (cos 1, sin 0),
    as flashtriton's rotary kernel does (queries of a chunk longer than the appended keys can reach past it)."""
    inside = positions < cos.shape[0]
    rows = positions.clamp(max=cos.shape[0] - 1).to(cos.device)
    inside = inside.to(cos.device)[:, None]
    cos_rows = torch.where(inside, cos[rows].float(), 1.0)
    sin_rows = torch.where(inside, sin[rows].float(), 0.0)
    return cos_rows[:, None], sin_rows[:, None]


def kvcache_reference(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                      cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                      window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                      compute_dtype=torch.float64, learnable_sink=None, descales=None, quantize_p=True):
    """flash_attn_with_kvcache literally (docs/api.md §5), one batch row at a time; host loops, any device.

    Returns (out (B, Sq, H, D), lse (B, H, Sq) fp32, new k_cache, new v_cache); the caches passed in are
    not modified.
    """
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    batch, seqlen_q = q.shape[:2]
    paged = block_table is not None
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    seqlen_new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        lengths = [capacity] * batch
    elif isinstance(cache_seqlens, int):
        lengths = [cache_seqlens] * batch
    else:
        lengths = [int(x) for x in cache_seqlens.tolist()]
    rows = list(range(batch)) if cache_batch_idx is None else [int(x) for x in cache_batch_idx.tolist()]
    starts = [0] * batch if cache_leftpad is None else [int(x) for x in cache_leftpad.tolist()]
    local = normalize_window(window_size, causal, capacity)[0] >= 0

    def positions_of(b, positions):
        """(cache tensor index tuple) of logical positions of batch row b."""
        positions = torch.as_tensor(positions, device=k_cache.device, dtype=torch.long)
        if paged:
            return block_table[b, positions // page_size].long(), positions % page_size
        return torch.full_like(positions, rows[b]), positions

    out = torch.empty(*q.shape[:-1], v_cache.shape[-1], dtype=torch.bfloat16 if descales else q.dtype,
                      device=q.device)
    lse = torch.empty(batch, q.shape[2], seqlen_q, dtype=torch.float32, device=q.device)
    for b in range(batch):
        length = lengths[b]
        if k is not None:
            k_new = k[b]
            if rotary_cos is not None:
                table = slice(length, length + seqlen_new)
                k_new = rotate(k_new, rotary_cos[table, None], rotary_sin[table, None], rotary_interleaved)
            index = positions_of(b, range(length, length + seqlen_new))
            k_cache[index] = k_new
            v_cache[index] = v[b]
        q_b = q[b]
        if rotary_cos is not None:
            positions = (torch.arange(length, length + seqlen_q) if (causal or local)
                         else torch.full((seqlen_q,), length))
            q_b = rotate(q_b, *_table_rows(rotary_cos, rotary_sin, positions), rotary_interleaved)
        index = positions_of(b, range(starts[b], length + seqlen_new))
        out_b, lse_b = attention_reference(q_b[None], k_cache[index][None], v_cache[index][None], softmax_scale,
                                           causal, window_size, softcap, row_slopes(alibi_slopes, b),
                                           seqlen_k_star=capacity, compute_dtype=compute_dtype,
                                           learnable_sink=learnable_sink, quantize_p=quantize_p,
                                           descales=None if descales is None else [d[b:b + 1] for d in descales])
        out[b], lse[b] = out_b[0], lse_b[0]
    return out, lse, k_cache, v_cache

"""flashtriton as an attention implementation of Hugging Face transformers (5.x), with no flash_attn package.

    from flashtriton.integrations import transformers as ft_transformers
    name = ft_transformers.register()        # "triton_fa"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name, dtype=torch.bfloat16)

`register` adds one attention function to transformers' `AttentionInterface` and one mask function to its
`AttentionMaskInterface`, both under `name`; every model whose attention goes through that interface
(Llama, Qwen2, Mistral, Gemma2, ...) then runs flashtriton's kernels.

The name contains no "flash": transformers treats every implementation name containing "flash" as one of its
flash-kernel backends and, at model load, imports the flash_attn package or a Hugging Face Hub kernel for it
(`lazy_import_flash_attention`), which fails for a name it does not know. `register` refuses such names, and
names that other transformers machinery matches by substring ("sdpa", "flex_attention", "eager", "paged|", "/").

What the attention function does with what the model passes:
    attention_mask None          dense `flash_attn_func`; or, when `position_ids` restart (packed sequences, no
                                 cache), `flash_attn_varlen_func` over the sequences they delimit, the rule of
                                 transformers' eager/sdpa masks (a new sequence wherever the position does not
                                 grow by exactly 1)
    cu_seq_lens_q/k, max_length_q/k kwargs   `flash_attn_varlen_func` on those boundaries
    2-D padding mask (B, Sk)     unpad (flashtriton.bert_padding) -> `flash_attn_varlen_func` -> pad; queries are
                                 the last Sq positions of each row (left padding when Sq < Sk, as in generate())
    causal                       `is_causal` kwarg, else `module.is_causal`
    sliding_window w             window_size (w - 1, 0) when causal, (w - 1, w - 1) otherwise: the key k is seen
                                 from the query q when q - k < w, as transformers' eager masks
    softcap, scaling, dropout    softcap, softmax_scale, dropout_p (the model passes 0.0 outside training)
    s_aux (attention sinks)      learnable_sink (gpt-oss), differentiable
    GQA                          key/value with fewer heads go through unrepeated
    value head dim               any (MLA-style models: V narrower or wider than Q/K) goes through unpadded
    dtype                        fp16/bf16 as they come; float32 q/k/v are cast to autocast's dtype when autocast
                                 is on, else to bfloat16, and the output is cast back to float32

Refused with an exception naming the alternative: output_attentions, 4-D or other non-padding masks, custom mask
patterns (or/and mask functions), paged/continuous-batching kwargs, static caches, and
float64 inputs. Padded query positions come back as zeros (eager computes values there that no valid token reads).
"""

from typing import Optional

import torch

from flashtriton.bert_padding import pad_input, unpad_input
from flashtriton.interface import flash_attn_func, flash_attn_varlen_func

__all__ = ["DEFAULT_NAME", "register", "attention_forward", "padding_mask"]

DEFAULT_NAME = "triton_fa"

# Substrings through which transformers routes an implementation name to other machinery.
_RESERVED_SUBSTRINGS = ("flash", "sdpa", "flex_attention", "eager", "paged|", "/", ":")

_ALTERNATIVE = "use attn_implementation='eager' or 'sdpa' for this"

# Keyword arguments of transformers' paged / continuous-batching attention path.
_PAGED_KWARGS = ("block_table", "k_cache", "v_cache", "read_index", "write_index", "cache_index")


def register(name: str = DEFAULT_NAME) -> str:
    """Register flashtriton with transformers under `name`; returns the name for `attn_implementation=`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    reserved = [s for s in _RESERVED_SUBSTRINGS if s in name]
    if reserved:
        raise ValueError(
            f"name {name!r} contains {reserved[0]!r}, which transformers routes to its own machinery (a name "
            f"containing 'flash' is loaded as a flash_attn / Hub kernel); pick a name without "
            f"{', '.join(repr(s) for s in _RESERVED_SUBSTRINGS)}, e.g. the default {DEFAULT_NAME!r}"
        )
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as e:
        raise ImportError(
            "flashtriton.integrations.transformers.register needs transformers>=5 (AttentionInterface and "
            f"AttentionMaskInterface); importing them failed: {e}"
        ) from e
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                 mask_function=None, attention_mask: Optional[torch.Tensor] = None, use_vmap: bool = False,
                 **kwargs) -> Optional[torch.Tensor]:
    """Mask function of the registered name: the (B, kv_length) bool padding mask, or None without padding.

    Causality, windows and packed sequences are the attention function's business (module attributes, kwargs
    and position_ids), as for transformers' flash implementations.
    """
    if use_vmap:
        raise NotImplementedError(
            "this model adds a custom attention-mask pattern (or_mask_function / and_mask_function, e.g. "
            "bidirectional image tokens); flashtriton's transformers attention takes padding masks only: "
            + _ALTERNATIVE
        )
    seen = int(q_offset) + q_length
    if kv_offset == 0 and kv_length > seen:
        raise NotImplementedError(
            f"the cache holds {kv_length} key slots but only {seen} are filled: a static (preallocated) cache; "
            "flashtriton's transformers attention supports the default dynamic cache: drop "
            "cache_implementation='static' (or the StaticCache) or " + _ALTERNATIVE
        )
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def _compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if dtype in (torch.float16, torch.bfloat16):
        return dtype
    if dtype == torch.float32:
        if torch.is_autocast_enabled(device.type):
            autocast_dtype = torch.get_autocast_dtype(device.type)
            if autocast_dtype in (torch.float16, torch.bfloat16):
                return autocast_dtype
        return torch.bfloat16
    raise TypeError(
        f"flashtriton attention computes in float16/bfloat16 (float32 is cast to bfloat16); got query dtype "
        f"{dtype}: " + _ALTERNATIVE
    )


def _packed_cu_seqlens(position_ids: torch.Tensor, batch: int, seqlen: int) -> Optional[torch.Tensor]:
    """cu_seqlens (int32) of the sequences packed in the rows of position_ids, or None if no row restarts.

    A sequence starts at each row start and wherever the position does not grow by exactly 1, the rule of
    transformers' `find_packed_sequence_indices`.
    """
    if position_ids.dim() != 2 or position_ids.shape[1] != seqlen or position_ids.shape[0] not in (1, batch):
        raise ValueError(
            f"position_ids must be (batch, seqlen) = ({batch}, {seqlen}) or (1, {seqlen}) to find packed "
            f"sequences, got {tuple(position_ids.shape)}: " + _ALTERNATIVE
        )
    position_ids = position_ids.expand(batch, seqlen)
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    if bool(starts[:, 1:].any()) is False:
        return None
    first = starts.flatten().nonzero().flatten().to(torch.int32)
    end = torch.tensor([batch * seqlen], dtype=torch.int32, device=first.device)
    return torch.cat([first, end])


def _max_len(cu_seqlens: torch.Tensor) -> int:
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, **kwargs):
    """transformers attention function: query (B, H, Sq, D), key/value (B, Hk, Sk, D) -> ((B, Sq, H, D), None)."""
    if kwargs.get("output_attentions"):
        raise ValueError(
            "output_attentions=True: flashtriton never forms the attention matrix; load the model with "
            "attn_implementation='eager' to get attention weights"
        )
    paged = [k for k in _PAGED_KWARGS if kwargs.get(k) is not None]
    if paged:
        raise NotImplementedError(
            f"paged attention / continuous batching ({', '.join(paged)}) is not supported by flashtriton's "
            "transformers attention: " + _ALTERNATIVE
        )
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise ValueError(
            f"attention_mask must be a 2-D (batch, kv_len) padding mask or None, got {shape}: a custom 4-D mask "
            "(or any non-padding pattern) is not supported by flashtriton: " + _ALTERNATIVE
        )
    out_dtype = query.dtype
    dtype = _compute_dtype(query.dtype, query.device)
    batch, _, seqlen_q, _ = query.shape
    seqlen_k = key.shape[2]
    # (B, H, S, D) -> (B, S, H, D)
    q, k, v = (t.transpose(1, 2) if t.dtype == dtype else t.transpose(1, 2).to(dtype) for t in (query, key, value))

    causal = bool(module.is_causal if is_causal is None else is_causal)
    window_size = (-1, -1)
    if sliding_window is not None:
        window_size = (sliding_window - 1, 0 if causal else sliding_window - 1)
    options = dict(dropout_p=dropout, softmax_scale=scaling, causal=causal, window_size=window_size,
                   softcap=0.0 if softcap is None else softcap, learnable_sink=kwargs.get("s_aux"))

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None:
        if attention_mask.shape != (batch, seqlen_k):
            raise ValueError(
                f"attention_mask must be (batch, kv_len) = ({batch}, {seqlen_k}), got {tuple(attention_mask.shape)}"
                ": a static cache or a mask that does not match the keys; " + _ALTERNATIVE
            )
        k, indices_k, cu_k, max_k, _ = unpad_input(k, attention_mask)
        v = v.flatten(0, 1)[indices_k]
        if seqlen_q == seqlen_k:
            q, indices_q, cu_q, max_q = q.flatten(0, 1)[indices_k], indices_k, cu_k, max_k
        else:
            q, indices_q, cu_q, max_q, _ = unpad_input(q, attention_mask[:, -seqlen_q:])
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **options)
        out = pad_input(out, indices_q, batch, seqlen_q)
    elif cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None:
            raise ValueError("cu_seq_lens_q and cu_seq_lens_k must be given together")
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = _max_len(cu_q) if max_q is None else int(max_q)
        max_k = _max_len(cu_k) if max_k is None else int(max_k)
        out = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q.to(torch.int32),
                                     cu_k.to(torch.int32), max_q, max_k, **options)
        out = out.view(batch, seqlen_q, *out.shape[1:])
    else:
        cu = None
        if position_ids is not None and seqlen_q == seqlen_k and seqlen_q > 1:
            cu = _packed_cu_seqlens(position_ids, batch, seqlen_q)
        if cu is not None:
            max_len = _max_len(cu)
            out = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, max_len,
                                         max_len, **options)
            out = out.view(batch, seqlen_q, *out.shape[1:])
        else:
            out = flash_attn_func(q, k, v, **options)
    return (out if out.dtype == out_dtype else out.to(out_dtype)), None

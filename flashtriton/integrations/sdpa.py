"""flashtriton as a flash attention implementation of PyTorch's SDPA (torch >= 2.11).

    import torch, flashtriton                         # registers the impl "flashtriton" (does not activate it)
    torch.nn.attention.activate_flash_attention_impl("flashtriton")
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

Activation replaces the CUDA kernels of these aten operators, process-wide, until another impl is activated or
`torch.nn.attention.restore_flash_attention_impl()` runs:

    _scaled_dot_product_flash_attention (+ _backward)   SDPA's FLASH backend, (B, H, S, D) tensors
    _flash_attention_forward / _flash_attention_backward dense (B, S, H, D) or varlen (T, H, D) with cum_seq_q/k;
                                                         torch.nn.attention.varlen.varlen_attn calls these
    _flash_attention_forward_no_dropout_inplace         varlen_attn_out (where the torch version has it)

They run flashtriton.ops.backend's mha_fwd / mha_bwd / mha_varlen_fwd / mha_varlen_bwd. aten's conventions map
onto flash_attn's: SDPA's (B, H, S, D) views are transposed to (B, S, H, D) without copies; the LSE is float32
(B, H, Sq) dense and (H, Tq) varlen, as aten stores it; a window side None means -1 (unlimited); scale None means
1/sqrt(head_dim); is_causal with Sq != Sk aligns the diagonal bottom-right, as aten's flash kernels do (SDPA's
own dispatch sends non-square causal calls to another backend). The rng_state / unused outputs are the zero
uint64 tensors aten returns without dropout.

Unsupported here, raising RuntimeError naming the argument: dropout_p > 0, return_debug_mask, block_table (paged
KV), seqused_k. Dtype, head dim and shape errors are flashtriton's own (docs/api.md §6): fp16 and
bf16 only, head dim at most 512. SDPA checks its FLASH backend's constraints (no attn_mask, fp16/bf16, ...) before
it calls these kernels, so those calls go to the other backends as usual.

Activation checks each operator's schema against the functions here and raises naming the operator when the
installed torch declares arguments they do not accept.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Optional

import torch

from ..ops import backend, checks

IMPL_NAME = "flashtriton"

__all__ = ["IMPL_NAME", "register", "activate"]


def _unsupported(op: str, what: str) -> RuntimeError:
    return RuntimeError(f"flashtriton SDPA provider ({op}): {what}")


def _window(value: Optional[int]) -> int:
    return -1 if value is None else int(value)


def _scale(scale: Optional[float], query: torch.Tensor) -> float:
    return checks.default_softmax_scale(query.shape[-1]) if scale is None else float(scale)


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if checks.has_contiguous_last_dim(tensor) else tensor.contiguous()


def _no_dropout_state(device: torch.device):
    """aten's rng_state (2,) and unused () outputs of a call without dropout."""
    return (torch.zeros(2, dtype=torch.uint64, device=device), torch.zeros((), dtype=torch.uint64, device=device))


def _check_forward_options(op: str, dropout_p: float, return_debug_mask: bool, block_table) -> None:
    if dropout_p != 0.0:
        raise _unsupported(op, f"dropout_p must be 0.0, got {dropout_p}")
    if return_debug_mask:
        raise _unsupported(op, "return_debug_mask=True is not supported")
    if block_table is not None:
        raise _unsupported(op, "block_table (paged KV) is not supported")


def flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                            return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                            seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None, out=None):
    """aten::_flash_attention_forward. Dense: query (B, Sq, H, D), lse (B, H, Sq). Varlen (cum_seq_q given):
    query (Tq, H, D), lse (H, Tq). Returns (out, lse, rng_state, unused, debug_attn_mask); `out`, when given,
    receives the output. num_splits is a scheduling hint; flashtriton's kernels do not split keys."""
    op = "_flash_attention_forward"
    _check_forward_options(op, dropout_p, return_debug_mask, block_table)
    if seqused_k is not None:
        raise _unsupported(op, "seqused_k is not supported")
    softmax_scale = _scale(scale, query)
    left, right = _window(window_size_left), _window(window_size_right)
    if cum_seq_q is None:
        if cum_seq_k is not None:
            raise _unsupported(op, "cum_seq_k is given without cum_seq_q")
        result, lse, _, _ = backend.mha_fwd(query, key, value, 0.0, softmax_scale, bool(is_causal), left, right,
                                            0.0, alibi_slopes, False)
    else:
        if cum_seq_k is None:
            raise _unsupported(op, "cum_seq_k is required with cum_seq_q")
        result, lse, _, _ = backend.mha_varlen_fwd(query, key, value, cum_seq_q, cum_seq_k, int(max_q), int(max_k),
                                                   0.0, softmax_scale, bool(is_causal), left, right, 0.0,
                                                   alibi_slopes, False)
    if out is not None:
        out.copy_(result)
        result = out
    rng_state, unused = _no_dropout_state(query.device)
    return result, lse, rng_state, unused, torch.empty(0, dtype=query.dtype, device=query.device)


def flash_attention_forward_no_dropout_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                                               dropout_p, is_causal, return_debug_mask, *, scale=None,
                                               window_size_left=None, window_size_right=None, seqused_k=None,
                                               alibi_slopes=None, block_table=None, num_splits=None):
    """aten::_flash_attention_forward_no_dropout_inplace: the forward into `out`; returns the lse."""
    return flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                   return_debug_mask, scale=scale, window_size_left=window_size_left,
                                   window_size_right=window_size_right, seqused_k=seqused_k,
                                   alibi_slopes=alibi_slopes, block_table=block_table, num_splits=num_splits,
                                   out=out)[1]


def flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                             dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                             window_size_right=None):
    """aten::_flash_attention_backward in the layouts of flash_attention_forward; returns (dq, dk, dv)."""
    if dropout_p != 0.0:
        raise _unsupported("_flash_attention_backward", f"dropout_p must be 0.0, got {dropout_p}")
    softmax_scale = _scale(scale, query)
    left, right = _window(window_size_left), _window(window_size_right)
    q, k, v, o, dout = (_last_dim_contiguous(t) for t in (query, key, value, out, grad_out))
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    deterministic = torch.are_deterministic_algorithms_enabled()
    if cum_seq_q is None or cum_seq_q.numel() == 0:
        backend.mha_bwd(dout, q, k, v, o, logsumexp, dq, dk, dv, 0.0, softmax_scale, bool(is_causal), left, right,
                        0.0, None, deterministic)
    else:
        backend.mha_varlen_bwd(dout, q, k, v, o, logsumexp, dq, dk, dv, cum_seq_q, cum_seq_k, int(max_q),
                               int(max_k), 0.0, softmax_scale, bool(is_causal), left, right, 0.0, None,
                               deterministic)
    return dq, dk, dv


def scaled_dot_product_flash_attention(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                                       *, scale=None):
    """aten::_scaled_dot_product_flash_attention: (B, H, S, D) tensors. Returns (out (B, H, Sq, D), lse
    (B, H, Sq), cum_seq_q None, cum_seq_k None, max_q, max_k, rng_state, unused, debug_attn_mask)."""
    _check_forward_options("_scaled_dot_product_flash_attention", dropout_p, return_debug_mask, None)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out, lse, rng_state, unused, debug = flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], 0.0,
                                                                 is_causal, False, scale=scale)
    return out.transpose(1, 2), lse, None, None, q.shape[1], k.shape[1], rng_state, unused, debug


def scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                                                max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                                                scale=None):
    """aten::_scaled_dot_product_flash_attention_backward: (B, H, S, D) tensors; returns (dq, dk, dv) in the
    (B, H, S, D) shapes of query, key and value."""
    if dropout_p != 0.0:
        raise _unsupported("_scaled_dot_product_flash_attention_backward", f"dropout_p must be 0.0, got {dropout_p}")
    tensors = (t.transpose(1, 2) for t in (grad_out, query, key, value, out))
    dout, q, k, v, o = tensors
    grads = flash_attention_backward(dout, q, k, v, o, logsumexp, None, None, q.shape[1], k.shape[1], 0.0,
                                     is_causal, philox_seed, philox_offset, scale=scale)
    return tuple(g.transpose(1, 2) for g in grads)


# aten operator -> (kernel, number of returns, required): operators a torch version may lack are not required
_KERNELS = {
    "_flash_attention_forward": (flash_attention_forward, 5, True),
    "_flash_attention_forward_no_dropout_inplace": (flash_attention_forward_no_dropout_inplace, 1, False),
    "_flash_attention_backward": (flash_attention_backward, 3, True),
    "_scaled_dot_product_flash_attention": (scaled_dot_product_flash_attention, 9, True),
    "_scaled_dot_product_flash_attention_backward": (scaled_dot_product_flash_attention_backward, 3, True),
}


def schema_mismatch(schema, kernel, returns: int) -> Optional[str]:
    """Why `kernel` cannot take the calls of an operator with this torch FunctionSchema, or None.

    The dispatcher passes positional schema arguments positionally and keyword-only ones by name; every
    argument must be accepted in that form, and every kernel parameter without a default must be in the schema.
    """
    params = inspect.signature(kernel).parameters
    positional = [p.name for p in params.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    keyword = {p.name for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    schema_positional = [a.name for a in schema.arguments if not a.kwarg_only]
    schema_keyword = {a.name for a in schema.arguments if a.kwarg_only}
    if schema_positional != positional[:len(schema_positional)]:
        return f"positional arguments {schema_positional}, expected {positional}"
    missing = [name for name in positional[len(schema_positional):] if params[name].default is inspect.Parameter.empty]
    if missing:
        return f"no arguments {missing}"
    unknown = sorted(schema_keyword - keyword)
    if unknown:
        return f"keyword arguments {unknown} that flashtriton does not handle"
    if len(schema.returns) != returns:
        return f"{len(schema.returns)} returns, expected {returns}"
    return None


def _operator_schemas() -> dict:
    """Schemas of the overridden aten operators this torch has; raises when a required one is missing or differs."""
    schemas = {}
    for name, (kernel, returns, required) in _KERNELS.items():
        packet = getattr(torch.ops.aten, name) if hasattr(torch.ops.aten, name) else None
        if packet is None:
            if required:
                raise RuntimeError(f"flashtriton SDPA provider: this torch ({torch.__version__}) has no aten::{name}")
            continue
        why = schema_mismatch(packet.default._schema, kernel, returns)
        if why is not None:
            raise RuntimeError(f"flashtriton SDPA provider: aten::{name} of torch {torch.__version__} has {why}; "
                               f"its schema is {packet.default._schema}")
        schemas[name] = packet.default._schema
    return schemas


class _Handle:
    """What activation returns to torch's registry: the Library holding the CUDA kernels. remove() drops it,
    which unregisters them (torch's Library unregisters its kernels when destroyed)."""

    def __init__(self, library) -> None:
        self.library = library

    def remove(self) -> None:
        library, self.library = self.library, None
        if library is not None and hasattr(library, "_destroy"):
            library._destroy()


def activate() -> _Handle:
    """The register_fn torch's registry calls on activate_flash_attention_impl("flashtriton"): checks the
    operator schemas, then registers the CUDA kernels of every operator in the module docstring."""
    schemas = _operator_schemas()
    library = torch.library.Library("aten", "IMPL", "CUDA")
    for name in schemas:
        library.impl(name, _KERNELS[name][0], "CUDA")
    return _Handle(library)


def register() -> bool:
    """Register (not activate) "flashtriton" with torch.nn.attention's flash attention registry. Returns False,
    doing nothing, on a torch without that registry."""
    try:
        attention = importlib.import_module("torch.nn.attention")
    except ImportError:
        return False
    register_impl = getattr(attention, "register_flash_attention_impl", None)
    if register_impl is None:
        return False
    register_impl(IMPL_NAME, register_fn=activate)
    return True

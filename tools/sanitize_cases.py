"""Run every flashtriton kernel once on CUDA with small shapes: the workload tools/sanitize.sh runs under
compute-sanitizer (memcheck, racecheck, initcheck, synccheck).

    python tools/sanitize_cases.py                      # every case
    python tools/sanitize_cases.py --only kv --only dropout   # cases whose name contains "kv" or "dropout"
    python tools/sanitize_cases.py --list

Each case prints one line, `ok   <name>  <seconds>  <what ran>` or `FAIL <name>  <error>`; the exit status is 1 if a
case failed. A case synchronizes and then reads every output (a NaN check), so an output element no kernel wrote
is an uninitialized read for initcheck. Outputs are not poisoned (poisoning would initialize them); --poison turns
NaN-poisoning on for a plain correctness run, where a NaN then means an element was never written.
Shapes are small and odd (off the tile sizes) so that masked edges and partial tiles are exercised.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {}
DEVICE = "cuda"  # --device cpu (with TRITON_INTERPRET=1) rehearses the cases through Triton's interpreter


def case(name: str, what: str):
    def register(fn):
        CASES[name] = (what, fn)
        return fn
    return register


# ----------------------------------------------------------------------------------------------------------------
# Case bodies. Each returns the tensors to check; imports happen in main() (torch may be absent for --help).
# ----------------------------------------------------------------------------------------------------------------

def _randn(*shape, dtype=None, requires_grad=False):
    import torch

    t = torch.randn(*shape, device=DEVICE).to(dtype or torch.float16)
    return t.requires_grad_(requires_grad)


def _dense(batch, seqlen_q, seqlen_k, heads, heads_k, dim, dtype=None, alibi=False, dropout_p=0.0, layout="contiguous",
           **options):
    """flash_attn_func forward + backward."""
    import torch

    import flashtriton
    from flashtriton.testing import strided_like

    q = strided_like(_randn(batch, seqlen_q, heads, dim, dtype=dtype), layout).requires_grad_()
    k = strided_like(_randn(batch, seqlen_k, heads_k, dim, dtype=dtype), layout).requires_grad_()
    v = strided_like(_randn(batch, seqlen_k, heads_k, dim, dtype=dtype), layout).requires_grad_()
    slopes = torch.rand(batch, heads, device=DEVICE) * 0.3 if alibi else None
    out, lse, s_dmask = flashtriton.flash_attn_func(q, k, v, dropout_p, alibi_slopes=slopes, return_attn_probs=True,
                                                    **options)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    return [out, lse, s_dmask, *grads]


def _cumulative(lengths):
    from flashtriton.testing import cu_seqlens

    return cu_seqlens(lengths, DEVICE)


def _varlen(lens_q, lens_k, heads, heads_k, dim, tail=3, dropout_p=0.0, alibi=False, **options):
    """flash_attn_varlen_func forward + backward, with `tail` rows past the last sequence."""
    import torch

    import flashtriton

    q = _randn(sum(lens_q) + tail, heads, dim, requires_grad=True)
    k = _randn(sum(lens_k) + tail, heads_k, dim, requires_grad=True)
    v = _randn(sum(lens_k) + tail, heads_k, dim, requires_grad=True)
    slopes = torch.rand(heads, device=DEVICE) * 0.3 if alibi else None
    out, lse, s_dmask = flashtriton.flash_attn_varlen_func(
        q, k, v, _cumulative(lens_q), _cumulative(lens_k), max(lens_q), max(lens_k), dropout_p, alibi_slopes=slopes,
        return_attn_probs=True, **options)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    return [out, lse, s_dmask, *grads]


def _paged_table(batch, pages_per_row, spare=3):
    import torch

    num_pages = batch * pages_per_row + spare
    table = torch.randperm(num_pages, device=DEVICE)[: batch * pages_per_row].view(batch, pages_per_row)
    return table.to(torch.int32), num_pages


def _kvcache(batch=3, seqlen_q=1, seqlen_new=1, capacity=200, heads=8, heads_k=2, dim=128, page=0, rotary_dim=0,
             rotary_interleaved=True, batch_idx=False, leftpad=False, alibi=False, dtype=None, **options):
    """flash_attn_with_kvcache; lengths leave room for the append, row 0 fills the cache exactly."""
    import torch

    import flashtriton

    lengths = torch.randint(0, capacity - seqlen_new + 1, (batch,), device=DEVICE).to(torch.int32)
    lengths[0] = capacity - seqlen_new
    inputs = dict(cache_seqlens=lengths)
    rows = batch + 2 if batch_idx else batch
    if page:
        table, num_pages = _paged_table(batch, -(-capacity // page))
        inputs["block_table"] = table
        cache_shape = (num_pages, page, heads_k, dim)
    else:
        cache_shape = (rows, capacity, heads_k, dim)
    k_cache, v_cache = _randn(*cache_shape, dtype=dtype), _randn(*cache_shape, dtype=dtype)
    if seqlen_new:
        inputs["k"] = _randn(batch, seqlen_new, heads_k, dim, dtype=dtype)
        inputs["v"] = _randn(batch, seqlen_new, heads_k, dim, dtype=dtype)
    if batch_idx:
        inputs["cache_batch_idx"] = torch.randperm(rows, device=DEVICE)[:batch].to(torch.int32)
    if leftpad:
        inputs["cache_leftpad"] = torch.minimum(torch.randint(0, 40, (batch,), device=DEVICE).to(torch.int32), lengths)
    if rotary_dim:
        angles = torch.rand(capacity, rotary_dim // 2, device=DEVICE) * 6.28
        q_dtype = dtype or torch.float16
        inputs.update(rotary_cos=angles.cos().to(q_dtype), rotary_sin=angles.sin().to(q_dtype),
                      rotary_interleaved=rotary_interleaved)
    if alibi:
        inputs["alibi_slopes"] = torch.rand(heads, device=DEVICE) * 0.3
    q = _randn(batch, seqlen_q, heads, dim, dtype=dtype)
    out, lse = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, **inputs, return_softmax_lse=True, **options)
    return [out, lse, k_cache, v_cache]


def _paged_varlen(page):
    """flash_attn_varlen_func with a paged K/V (forward only)."""
    import flashtriton

    lens_q, lens_k = [3, 20, 0, 9], [50, 20, 11, 97]
    table, num_pages = _paged_table(len(lens_k), -(-max(lens_k) // page), spare=2)
    k_cache, v_cache = _randn(num_pages, page, 2, 64), _randn(num_pages, page, 2, 64)
    q = _randn(sum(lens_q), 4, 64)
    out = flashtriton.flash_attn_varlen_func(q, k_cache, v_cache, _cumulative(lens_q), _cumulative(lens_k),
                                             max(lens_q), max(lens_k), causal=True, block_table=table)
    return [out]


# Dense: fwd + bwd
case("dense-d64-causal", "B2 S97 H4 d64 causal")(lambda: _dense(2, 97, 97, 4, 4, 64, causal=True))
case("dense-d64-192-row-tiles", "Sq200 Sk300 d64 (Gluon: three consumers, a partial 192-row tile)")(
    lambda: _dense(2, 200, 300, 4, 4, 64))
case("dense-d256-causal-skip", "Sq150 Sk170 d256 causal (Gluon: the rescale skip and the schedule fence)")(
    lambda: _dense(1, 150, 170, 2, 2, 256, causal=True))
case("dense-d128-cross", "Sq65 Sk190 d128")(lambda: _dense(2, 65, 190, 4, 4, 128))
case("dense-d256-window", "S130 d256 window (20,7)")(lambda: _dense(1, 130, 130, 2, 2, 256, window_size=(20, 7)))
case("dense-d72-causal-odd", "Sq33 Sk77 d72 causal")(lambda: _dense(2, 33, 77, 4, 2, 72, causal=True))
case("dense-d40-sliced", "strided views, d40")(lambda: _dense(2, 50, 61, 4, 2, 40, layout="sliced"))
case("dense-gqa-alibi-causal", "H6/Hk2 ALiBi causal (pure-causal quirk)")(
    lambda: _dense(2, 90, 130, 6, 2, 64, alibi=True, causal=True))
case("dense-softcap-local", "softcap 5, window (16,16), d128")(
    lambda: _dense(2, 100, 100, 4, 4, 128, softcap=5.0, window_size=(16, 16)))
case("dense-rows-without-keys", "causal Sq150 > Sk40 (empty rows), bf16")(
    lambda: _dense(2, 150, 40, 4, 4, 64, dtype=_bf16(), causal=True))
case("dense-decode-rows", "Sq3 Sk300 (decode tiles) d128 MQA")(lambda: _dense(3, 3, 300, 8, 1, 128))
case("dense-mqa-bf16-d128", "H8/Hk1 S129 bf16 causal")(lambda: _dense(2, 129, 129, 8, 1, 128, dtype=_bf16(), causal=True))
case("dense-d256-gqa-bhsd", "d256 H4/Hk2 Sq200 Sk300 (B, H, S, D) memory, several K/V stages")(
    lambda: _dense(1, 200, 300, 4, 2, 256, layout="bhsd"))
case("dense-gluon-bwd", "Gluon kernels forced on, GQA causal Sq150 Sk170 d128 bf16")(
    lambda: _with_gluon(lambda: _dense(2, 150, 170, 4, 2, 128, dtype=_bf16(), causal=True)))
case("dense-ordered-dq-causal", "deterministic=True d128: dQ reductions in a fixed order, GQA causal Sq300 Sk350 bf16")(
    lambda: _dense(2, 300, 350, 4, 2, 128, dtype=_bf16(), causal=True, deterministic=True))
case("dense-ordered-dq-full", "deterministic=True d128: dQ reductions in a fixed order, Sq333 Sk200 bf16")(
    lambda: _dense(2, 333, 200, 3, 3, 128, dtype=_bf16(), deterministic=True))
case("dense-dq-atomic", "dQ added by the dK/dV kernel with atomics (BwdConfig.dq_atomic), GQA causal")(
    lambda: _with_dq_atomic(lambda: _dense(2, 150, 170, 4, 2, 128, causal=True)))
# Varlen: fwd + bwd
case("varlen-gqa-causal", "lengths with 0 and 1, GQA, causal")(
    lambda: _varlen([5, 0, 70, 33, 1], [9, 12, 0, 80, 40], 4, 2, 64, causal=True))
case("varlen-d128-window-alibi", "window (9,4), ALiBi, d128")(
    lambda: _varlen([17, 1, 90], [150, 65, 91], 4, 4, 128, window_size=(9, 4), alibi=True))
case("varlen-paged-p16", "paged K/V page 16, forward")(lambda: _paged_varlen(16))
case("varlen-paged-p7", "paged K/V page 7, forward")(lambda: _paged_varlen(7))
case("varlen-seqused-leftpad", "low-level seqused_k + leftpad_k")(lambda: _seqused_leftpad())
# kv cache
case("kv-decode", "Sq1 append 1, GQA 8/2, d128")(lambda: _kvcache())
case("kv-decode-no-append", "Sq1 no append, bf16")(lambda: _kvcache(seqlen_new=0, dtype=_bf16()))
case("kv-paged16-chunk", "page 16, Sq2 append 3, causal")(lambda: _kvcache(page=16, seqlen_q=2, seqlen_new=3, causal=True))
case("kv-paged64-decode", "page 64, decode")(lambda: _kvcache(page=64, capacity=256))
case("kv-rotary-gptj-causal", "rotary 64 interleaved, Sq2 append 2, causal")(
    lambda: _kvcache(rotary_dim=64, seqlen_q=2, seqlen_new=2, causal=True))
case("kv-rotary-neox-partial", "rotary 32 of d64, not interleaved, Sq4 append 4")(
    lambda: _kvcache(rotary_dim=32, rotary_interleaved=False, seqlen_q=4, seqlen_new=4, dim=64))
case("kv-split3", "num_splits=3, capacity 500")(lambda: _kvcache(capacity=500, num_splits=3))
case("kv-batch-idx-leftpad-alibi", "cache_batch_idx + cache_leftpad + ALiBi")(
    lambda: _kvcache(batch_idx=True, leftpad=True, alibi=True, seqlen_q=2, seqlen_new=1, causal=True))
case("kv-window-softcap", "no append, window (30,0), softcap 4")(
    lambda: _kvcache(seqlen_new=0, seqlen_q=2, window_size=(30, 0), softcap=4.0))
case("kv-prefill-d256", "Sq20 append 20 (prefill tiles), d256, causal")(
    lambda: _kvcache(seqlen_q=20, seqlen_new=20, dim=256, heads=4, causal=True))
# Dropout: fwd + bwd (S_dmask too)
case("dropout-dense", "p=0.17 causal, S_dmask")(lambda: _dense(2, 70, 90, 4, 2, 64, dropout_p=0.17, causal=True))
case("dropout-varlen", "p=0.1, varlen")(lambda: _varlen([30, 0, 45], [20, 10, 60], 4, 2, 64, dropout_p=0.1))
# Malformed index values (host checks off, as on a GPU outside strict mode; docs/api.md §6): rows and pages out of
# range count as empty and appends outside the cache are dropped. Under memcheck no access may leave a tensor; the
# kv-cache cases also check a sentinel region after each cache.
case("bad-index-varlen-past-end", "cu_seqlens_q/k last entries past the rows, fwd + bwd")(
    lambda: _malformed(lambda: _bad_varlen([0, 40, 97], [0, 50, 131], 90, 120)))
case("bad-index-varlen-negative", "negative cu_seqlens entries, fwd + bwd")(
    lambda: _malformed(lambda: _bad_varlen([0, -7, 90], [0, -3, 120], 90, 120)))
case("bad-index-paged-varlen", "paged varlen, block ids >= num_blocks and < 0, pages 16 and 7")(
    lambda: _malformed(lambda: _bad_paged_varlen(16) + _bad_paged_varlen(7)))
case("bad-index-kv-batch-idx", "cache_batch_idx >= cache batch and < 0, with an append")(
    lambda: _malformed(lambda: _bad_kvcache(batch_idx=[1, 5, -2])))
case("bad-index-kv-paged", "kv-cache block ids >= num_blocks and < 0, with an append, pages 16 and 8")(
    lambda: _malformed(lambda: _bad_kvcache(page=16) + _bad_kvcache(page=8)))
case("bad-index-kv-seqlens", "cache_seqlens < 0 and past the capacity, with an append")(
    lambda: _malformed(lambda: _bad_kvcache(seqlens=[-5, 70, 300])))
# Rotary module
case("rotary-emb-fwd-bwd", "apply_rotary_emb, tensor offsets, partial, fwd+bwd")(lambda: _rotary_emb())
case("rotary-varlen-inplace", "apply_rotary varlen, in place, conjugate")(lambda: _rotary_varlen())
case("rotary-qkv-inplace", "apply_rotary_emb_qkv_ (GQA layout), fwd+bwd")(lambda: _rotary_qkv())


def _malformed(body):
    from flashtriton.testing import unchecked_indices

    with unchecked_indices():
        return body()


def _bad_varlen(cu_q, cu_k, total_q, total_k):
    """flash_attn_varlen_func forward + backward on malformed cu_seqlens; every row lies in exactly one clamped
    sequence, so every result row is written."""
    import torch

    import flashtriton

    q = _randn(total_q, 4, 64, requires_grad=True)
    k, v = _randn(total_k, 2, 64, requires_grad=True), _randn(total_k, 2, 64, requires_grad=True)
    cu_seqlens_q, cu_seqlens_k = (torch.tensor(cu, dtype=torch.int32, device=DEVICE) for cu in (cu_q, cu_k))
    max_q, max_k = (max(b - a for a, b in zip(cu, cu[1:])) + 8 for cu in (cu_q, cu_k))
    out = flashtriton.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    return [out, *grads]


def _bad_paged_varlen(page):
    """Paged flash_attn_varlen_func whose block tables name pages past the pool and negative pages."""
    import flashtriton

    lens_q, lens_k = [3, 20, 9], [50, 20, 97]
    table, num_pages = _paged_table(len(lens_k), -(-max(lens_k) // page), spare=0)
    table[0, 1], table[1, 0], table[2, -1] = num_pages, -1, num_pages + 1000
    k_cache, v_cache = _guarded(num_pages, page, 2, 64), _guarded(num_pages, page, 2, 64)
    q = _randn(sum(lens_q), 4, 64)
    out = flashtriton.flash_attn_varlen_func(q, k_cache.tensor, v_cache.tensor, _cumulative(lens_q),
                                             _cumulative(lens_k), max(lens_q), max(lens_k), causal=True,
                                             block_table=table)
    return [out, k_cache.check(), v_cache.check()]


def _bad_kvcache(page=0, batch_idx=None, seqlens=None, capacity=256, seqlen_new=3):
    """flash_attn_with_kvcache with an append on malformed index values, caches inside sentinel regions."""
    import torch

    import flashtriton

    batch = 3
    lengths = torch.tensor(seqlens or [10, 100, 200], dtype=torch.int32, device=DEVICE)
    inputs = dict(cache_seqlens=lengths)
    if page:
        table, num_pages = _paged_table(batch, -(-capacity // page), spare=0)
        table[0, 0], table[1, 100 // page], table[2, 200 // page] = -1, num_pages, num_pages + 7
        inputs["block_table"] = table
        cache_shape = (num_pages, page, 2, 64)
    else:
        cache_shape = (batch if batch_idx is None else 2, capacity, 2, 64)
    if batch_idx is not None:
        inputs["cache_batch_idx"] = torch.tensor(batch_idx, dtype=torch.int32, device=DEVICE)
    k_cache, v_cache = _guarded(*cache_shape), _guarded(*cache_shape)
    k, v = _randn(batch, seqlen_new, 2, 64), _randn(batch, seqlen_new, 2, 64)
    q = _randn(batch, 1, 8, 64)
    out, lse = flashtriton.flash_attn_with_kvcache(q, k_cache.tensor, v_cache.tensor, k, v, **inputs,
                                                   return_softmax_lse=True)
    return [out, lse, k_cache.check(), v_cache.check()]


class _guarded:
    """A random fp16 tensor inside a larger buffer whose regions before and after it hold a sentinel; check()
    raises if either region changed and returns the tensor."""
    GUARD = 4096

    def __init__(self, *shape):
        import torch

        numel = 1
        for size in shape:
            numel *= size
        self.buffer = torch.full((numel + 2 * self.GUARD,), 777.0, dtype=torch.float16, device=DEVICE)
        self.tensor = self.buffer[self.GUARD:self.GUARD + numel].view(shape)
        self.tensor.copy_(_randn(*shape))

    def check(self):
        guards = (self.buffer[:self.GUARD], self.buffer[-self.GUARD:])
        if not all(bool((region == 777.0).all()) for region in guards):
            raise AssertionError("a kernel wrote into the sentinel region around a cache")
        return self.tensor


def _with_gluon(body):
    from flashtriton.testing import forced_gluon

    with forced_gluon():
        return body()


def _with_dq_atomic(body):
    from flashtriton.testing import forced_dq_atomic

    with forced_dq_atomic():
        return body()


def _bf16():
    import torch

    return torch.bfloat16


def _seqused_leftpad():
    from flashtriton.flash_attn_interface import _flash_attn_varlen_forward

    lens_q, slots = [6, 30], [50, 40]
    import torch

    q, k, v = _randn(sum(lens_q), 4, 64), _randn(sum(slots), 2, 64), _randn(sum(slots), 2, 64)
    seqused = torch.tensor([37, 40], dtype=torch.int32, device=DEVICE)
    leftpad = torch.tensor([5, 0], dtype=torch.int32, device=DEVICE)
    out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, _cumulative(lens_q), _cumulative(slots), max(lens_q),
                                                max(slots), 0.0, 0.125, True, leftpad_k=leftpad, seqused_k=seqused)
    return [out, lse]


def _rotary_emb():
    import torch

    from flashtriton.layers.rotary import apply_rotary_emb

    x = _randn(2, 37, 3, 80, requires_grad=True)
    angles = torch.rand(60, 24, device=DEVICE) * 6.28  # rotary_dim 48 of 80
    offsets = torch.tensor([0, 20], dtype=torch.int32, device=DEVICE)
    out = apply_rotary_emb(x, angles.cos().half(), angles.sin().half(), seqlen_offsets=offsets)
    (grad,) = torch.autograd.grad(out, (x,), torch.randn_like(out))
    return [out, grad]


def _rotary_varlen():
    import torch

    from flashtriton.ops.triton.rotary import apply_rotary

    lengths = [5, 0, 17, 9]
    x = _randn(sum(lengths) + 3, 4, 64)
    angles = torch.rand(40, 32, device=DEVICE) * 6.28
    out = apply_rotary(x, angles.cos().half(), angles.sin().half(), seqlen_offsets=3, cu_seqlens=_cumulative(lengths),
                       max_seqlen=max(lengths), interleaved=True, inplace=True, conjugate=True)
    return [out]


def _rotary_qkv():
    import torch

    from flashtriton.layers.rotary import apply_rotary_emb_qkv_

    qkv = _randn(2, 33, 4 + 2 * 2, 64, requires_grad=True)
    work = qkv.clone()
    angles = torch.rand(33, 16, device=DEVICE) * 6.28
    out = apply_rotary_emb_qkv_(work, angles.cos().half(), angles.sin().half(), num_heads_q=4)
    (grad,) = torch.autograd.grad(out, (qkv,), torch.randn_like(out))
    return [out, grad]


# ----------------------------------------------------------------------------------------------------------------


def select(names, only):
    if not only:
        return list(names)
    patterns = [p for item in only for p in item.split(",") if p]
    return [name for name in names if any(p in name for p in patterns)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="Needs a CUDA GPU and compiled kernels (TRITON_INTERPRET unset). Used by tools/sanitize.sh.")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only cases whose name contains NAME (repeatable, or comma-separated)")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--poison", action="store_true",
                        help="NaN-poison output buffers (plain runs only: it hides unwritten outputs from initcheck)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: rehearse the cases through Triton's interpreter (needs TRITON_INTERPRET=1; slow)")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device

    names = select(CASES, args.only)
    if args.list:
        for name in names:
            print(f"{name:28s} {CASES[name][0]}")
        return 0
    if not names:
        print(f"sanitize_cases.py: no case matches {args.only}; --list shows the names", file=sys.stderr)
        return 2
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if DEVICE == "cuda" and interpreted:
        print("sanitize_cases.py: TRITON_INTERPRET is set; unset it so the compiled kernels run", file=sys.stderr)
        return 2
    if DEVICE == "cpu" and not interpreted:
        print("sanitize_cases.py: --device cpu needs TRITON_INTERPRET=1 (otherwise no kernel runs)", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print("sanitize_cases.py: needs PyTorch with CUDA", file=sys.stderr)
        return 2
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("sanitize_cases.py: needs a CUDA GPU (torch.cuda.is_available() is False); nothing was run",
              file=sys.stderr)
        return 2
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from flashtriton.ops import hopper
    from flashtriton.testing import poisoned_outputs

    failures = 0
    for name in names:
        what, body = CASES[name]
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        gluon_launches = (hopper.fwd_launch_count, hopper.bwd_launch_count)
        try:
            with poisoned_outputs(args.poison):
                tensors = body()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            unwritten = [i for i, t in enumerate(tensors) if t.is_floating_point() and bool(t.detach().isnan().any())]
            if unwritten:
                raise AssertionError(f"NaN in result(s) {unwritten}")
        except Exception as error:  # noqa: BLE001 - report every case, keep going
            failures += 1
            message = str(error).strip().splitlines()[0] if str(error).strip() else ""
            print(f"FAIL {name:28s} {time.perf_counter() - start:7.2f}s  {type(error).__name__}: {message[:200]}",
                  flush=True)
            continue
        ran_gluon = "".join(f"  [Gluon Hopper {kind}]" for kind, before, after in (
            ("forward", gluon_launches[0], hopper.fwd_launch_count),
            ("backward", gluon_launches[1], hopper.bwd_launch_count)) if after > before)
        print(f"ok   {name:28s} {time.perf_counter() - start:7.2f}s  {what}{ran_gluon}", flush=True)
    print(f"{len(names) - failures} ok, {failures} failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

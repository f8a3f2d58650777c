"""Strict mode (docs/api.md §6): FLASHTRITON_STRICT=1 at import, flashtriton.set_strict_checks or
flashtriton.strict_checks() make calls on a GPU run the index-value checks that CPU calls always run, on a host copy
of their index tensors made in one transfer, with the same messages. Off (the default), a GPU call reads no index
value on the host. Calls made while a CUDA graph is being captured are never checked.

The CPU tests stand in for a GPU call with objects whose `device` is cuda (only shapes and the device of q and k are
read) and CPU index tensors; the tests marked gpu run the real thing.
"""

import importlib.util
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import flashtriton
from flashtriton.ops import backend, checks
from flashtriton.testing import assert_checks_ok, compare_varlen_with_reference, cu_seqlens, poisoned_outputs

COMPILED_GPU = torch.cuda.is_available() and not backend.KERNELS_INTERPRETED
gpu_only = pytest.mark.skipif(not COMPILED_GPU,
                              reason="needs a CUDA GPU running the compiled Triton kernels (TRITON_INTERPRET unset)")

H, HK, D = 2, 1, 16
PAGE, NUM_PAGES = 4, 5


@pytest.fixture(autouse=True)
def _restore_strict():
    previous = checks.strict_checks_enabled()
    yield
    checks.set_strict_checks(previous)


def _int32(values):
    return torch.tensor(values, dtype=torch.int32)


# ------------------------------------------------------------------------------------------------------------
# The switch
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value,expected", [(None, False), ("", False), ("0", False), (" off ", False),
                                            ("False", False), ("no", False), ("1", True), ("true", True),
                                            ("ON", True), ("yes", True)])
def test_parse_strict(value, expected):
    assert checks.parse_strict(value) is expected


def test_parse_strict_rejects_other_values():
    with pytest.raises(ValueError, match=re.escape("FLASHTRITON_STRICT must be 1 (strict index checks on) or 0 "
                                                   "(off), got '2'")):
        checks.parse_strict("2")


@pytest.mark.parametrize("value,expected", [(None, False), ("0", False), ("1", True)])
def test_checks_module_reads_the_variable_at_import(monkeypatch, value, expected):
    """A fresh copy of ops/checks.py takes its setting from FLASHTRITON_STRICT when it is executed."""
    if value is None:
        monkeypatch.delenv("FLASHTRITON_STRICT", raising=False)
    else:
        monkeypatch.setenv("FLASHTRITON_STRICT", value)
    spec = importlib.util.spec_from_file_location("fresh_checks", checks.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    assert fresh.strict_checks_enabled() is expected
    monkeypatch.setenv("FLASHTRITON_STRICT", "1" if not expected else "0")
    assert fresh.strict_checks_enabled() is expected, "read once, at import"


def test_import_with_strict_variable():
    """`FLASHTRITON_STRICT=1 python -c 'import flashtriton'` starts in strict mode."""
    env = dict(os.environ, FLASHTRITON_STRICT="1")
    code = "import flashtriton; print(flashtriton.strict_checks_enabled())"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_setter_returns_the_previous_setting():
    checks.set_strict_checks(False)
    assert flashtriton.set_strict_checks(True) is False
    assert flashtriton.strict_checks_enabled() is True
    assert flashtriton.set_strict_checks(False) is True
    assert flashtriton.strict_checks_enabled() is False
    with pytest.raises(TypeError, match="set_strict_checks\\(enabled\\) takes a bool, got int"):
        flashtriton.set_strict_checks(1)
    assert flashtriton.strict_checks_enabled() is False


def test_context_manager_restores_the_setting():
    checks.set_strict_checks(False)
    with flashtriton.strict_checks():
        assert checks.strict_checks_enabled()
        with flashtriton.strict_checks(False):
            assert not checks.strict_checks_enabled()
        assert checks.strict_checks_enabled()
    assert not checks.strict_checks_enabled()
    with pytest.raises(KeyError):
        with flashtriton.strict_checks():
            raise KeyError("inside")
    assert not checks.strict_checks_enabled()


def test_which_calls_read_index_values():
    for strict in (False, True):
        for capturing in (False, True):
            assert checks.reads_index_values("cpu", strict, capturing)
            assert checks.reads_index_values("cuda", strict, capturing) == (strict and not capturing)


# ------------------------------------------------------------------------------------------------------------
# The host copy
# ------------------------------------------------------------------------------------------------------------


def test_host_copy_keeps_names_shapes_dtypes_and_values(monkeypatch):
    transfers = []
    original_cpu = torch.Tensor.cpu

    def counted_cpu(self, *args, **kwargs):
        transfers.append(self.shape)
        return original_cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counted_cpu)
    block_table = _int32([[0, 7, 1], [2, -3, 4]])[:, ::2]  # rows strided, last dim not contiguous
    tensors = dict(cu=_int32([0, 3, 8]), seqlens=torch.tensor([5, 2**40], dtype=torch.int64), none=None,
                   block_table=block_table, empty=_int32([]))
    host = checks.copy_index_tensors_to_host(tensors)
    assert list(host) == list(tensors)
    assert host["none"] is None
    for name, tensor in tensors.items():
        if tensor is not None:
            assert host[name].device.type == "cpu"
            assert host[name].dtype == tensor.dtype and host[name].shape == tensor.shape
            assert torch.equal(host[name], tensor)
    assert len(transfers) == 1, "one transfer for all of a call's index tensors"
    assert checks.copy_index_tensors_to_host(dict(a=None)) == dict(a=None)


# ------------------------------------------------------------------------------------------------------------
# GPU calls, simulated: q and k report a cuda device, the index tensors are CPU tensors
# ------------------------------------------------------------------------------------------------------------


def _on_cuda(tensor: torch.Tensor):
    return SimpleNamespace(device=torch.device("cuda"), shape=tensor.shape)


def _varlen(cu_q=(0, 3, 8), cu_k=(0, 4, 10), max_q=5, max_k=6, block_table=None, leftpad_k=None, seqused_k=None):
    """The arguments of check_varlen_index_values: q (8, H, D), k (10, HK, D) or, paged, NUM_PAGES pages."""
    q = torch.empty(8, H, D)
    k = torch.empty(10, HK, D) if block_table is None else torch.empty(NUM_PAGES, PAGE, HK, D)
    optional = [None if x is None else _int32(x) for x in (block_table, leftpad_k, seqused_k)]
    return [q, k, _int32(cu_q), _int32(cu_k), max_q, max_k, *optional]


def _kvcache(cache_seqlens=(3, 6), seqlen_new=2, cache_batch_idx=None, cache_leftpad=None, block_table=None):
    """The arguments of check_kvcache_index_values: batch 2, caches of 3 rows of 8 keys or NUM_PAGES pages."""
    q = torch.empty(2, 1, H, D)
    k_cache = torch.empty(3, 8, HK, D) if block_table is None else torch.empty(NUM_PAGES, PAGE, HK, D)
    seqlens = None if cache_seqlens is None else _int32(cache_seqlens)
    optional = [None if x is None else _int32(x) for x in (cache_batch_idx, cache_leftpad, block_table)]
    return [q, k_cache, seqlen_new, seqlens, *optional]


BAD_CALLS = {
    "cu-q-start": (checks.check_varlen_index_values, _varlen(cu_q=(1, 3, 8))),
    "cu-k-decreasing": (checks.check_varlen_index_values, _varlen(cu_k=(0, 7, 4), max_k=7)),
    "cu-q-past-rows": (checks.check_varlen_index_values, _varlen(cu_q=(0, 3, 9), max_q=6)),
    "max-seqlen-q-short": (checks.check_varlen_index_values, _varlen(max_q=4)),
    "paged-block-id-past-pool": (checks.check_varlen_index_values, _varlen(block_table=[[0, 3], [1, 5]])),
    "seqused-k-past-length": (checks.check_varlen_index_values, _varlen(seqused_k=(4, 7))),
    "leftpad-k-past-seqused": (checks.check_varlen_index_values, _varlen(seqused_k=(2, 6), leftpad_k=(3, 0))),
    "max-seqlen-k-below-used-keys": (checks.check_varlen_index_values,
                                     _varlen(seqused_k=(4, 6), leftpad_k=(0, 1), max_k=4)),
    "kv-batch-idx-past-cache": (checks.check_kvcache_index_values, _kvcache(cache_batch_idx=(0, 3))),
    "kv-seqlens-negative": (checks.check_kvcache_index_values, _kvcache(cache_seqlens=(-1, 2))),
    "kv-seqlens-past-capacity": (checks.check_kvcache_index_values, _kvcache(cache_seqlens=(3, 7))),
    "kv-leftpad-past-seqlens": (checks.check_kvcache_index_values, _kvcache(cache_leftpad=(4, 0))),
    "kv-paged-block-id-past-pool": (checks.check_kvcache_index_values,
                                    _kvcache(cache_seqlens=(1, 5), block_table=[[0, 9], [1, 5]])),
    "kv-paged-past-capacity": (checks.check_kvcache_index_values,
                               _kvcache(cache_seqlens=(1, 7), block_table=[[0, 1], [2, 3]])),
}
# flash_attn's paged-capacity check reads cache_seqlens on every device (docs/api.md §5.2), strict or not.
UPSTREAM_HOST_READ = {"kv-paged-block-id-past-pool", "kv-paged-past-capacity"}


def _message(check_fn, args) -> str:
    with pytest.raises(RuntimeError) as excinfo:
        check_fn(*args)
    return str(excinfo.value)


@pytest.fixture
def copies(monkeypatch):
    """Calls of checks.copy_index_tensors_to_host (the one host transfer of a strict GPU call); capture is off."""
    calls = []
    original = checks.copy_index_tensors_to_host

    def spy(tensors):
        calls.append(sorted(name for name, tensor in tensors.items() if tensor is not None))
        return original(tensors)

    monkeypatch.setattr(checks, "copy_index_tensors_to_host", spy)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return calls


@pytest.mark.parametrize("name", BAD_CALLS)
def test_strict_gpu_calls_raise_the_cpu_message(copies, name):
    check_fn, args = BAD_CALLS[name]
    cpu_message = _message(check_fn, args)
    assert copies == [], "CPU tensors are read in place"
    checks.set_strict_checks(True)
    assert _message(check_fn, [_on_cuda(args[0]), _on_cuda(args[1]), *args[2:]]) == cpu_message
    assert len(copies) == 1


def test_strict_gpu_calls_with_valid_values_pass(copies):
    checks.set_strict_checks(True)
    valid = [(checks.check_varlen_index_values, _varlen()),
             (checks.check_varlen_index_values, _varlen(block_table=[[0, 3], [1, 2]], seqused_k=(4, 5))),
             (checks.check_varlen_index_values, _varlen(seqused_k=(4, 6), leftpad_k=(4, 0))),
             (checks.check_kvcache_index_values, _kvcache(cache_batch_idx=(2, 0), cache_leftpad=(3, 0))),
             (checks.check_kvcache_index_values, _kvcache(cache_seqlens=(1, 5), block_table=[[0, 9], [1, 4]])),
             (checks.check_kvcache_index_values, _kvcache(cache_seqlens=None, seqlen_new=0))]
    for check_fn, args in valid:
        check_fn(_on_cuda(args[0]), _on_cuda(args[1]), *args[2:])
    assert copies == [["cu_seqlens_k", "cu_seqlens_q"], ["block_table", "cu_seqlens_k", "cu_seqlens_q", "seqused_k"],
                      ["cu_seqlens_k", "cu_seqlens_q", "leftpad_k", "seqused_k"],
                      ["cache_batch_idx", "cache_leftpad", "cache_seqlens"], ["block_table", "cache_seqlens"], []]


def _host_read(*args, **kwargs):
    raise AssertionError("an index value was read on the host")


@pytest.mark.parametrize("strict,capturing", [(False, False), (True, True)], ids=["default", "strict-capturing"])
def test_unchecked_gpu_calls_read_no_index_value(monkeypatch, strict, capturing):
    """Default mode, and strict mode under CUDA graph capture: bad values pass untouched, nothing is read or copied
    (default mode does not even ask whether a capture is under way)."""
    checks.set_strict_checks(strict)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", (lambda: capturing) if strict else _host_read)
    monkeypatch.setattr(checks, "copy_index_tensors_to_host", _host_read)
    for method in ("cpu", "tolist", "item", "__int__", "__index__", "nonzero", "numpy"):
        monkeypatch.setattr(torch.Tensor, method, _host_read)
    for name, (check_fn, args) in BAD_CALLS.items():
        if name not in UPSTREAM_HOST_READ:
            check_fn(_on_cuda(args[0]), _on_cuda(args[1]), *args[2:])


def test_strict_mode_reads_cpu_calls_in_place(copies):
    """CPU calls are checked the same way in both modes, without a copy."""
    checks.set_strict_checks(True)
    args = _varlen(cu_k=(0, 7, 4), max_k=7)
    with pytest.raises(RuntimeError, match=re.escape("got cu_seqlens_k[2] = 4 < cu_seqlens_k[1] = 7")):
        flashtriton.flash_attn_varlen_func(torch.randn(8, H, D).half(), torch.randn(10, HK, D).half(),
                                           torch.randn(10, HK, D).half(), *args[2:6])
    assert copies == []


# ------------------------------------------------------------------------------------------------------------
# On a GPU
# ------------------------------------------------------------------------------------------------------------


def _gpu_varlen_inputs(lens_q=(3, 17, 40), lens_k=(5, 33, 40)):
    q = torch.randn(sum(lens_q), H, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(sum(lens_k), HK, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    return q, k, v, cu_seqlens(lens_q, "cuda"), cu_seqlens(lens_k, "cuda"), max(lens_q), max(lens_k)


@pytest.mark.gpu
@gpu_only
def test_gpu_strict_mode_rejects_malformed_cu_seqlens():
    q, k, v, cu_q, cu_k, max_q, max_k = _gpu_varlen_inputs()
    bad_k = cu_k.clone()
    bad_k[2] = bad_k[1] - 1
    cpu = [t.cpu() for t in (q, k, v, cu_q, bad_k)]
    cpu_message = _message(flashtriton.flash_attn_varlen_func, [*cpu, max_q, max_k])
    with flashtriton.strict_checks():
        gpu_message = _message(flashtriton.flash_attn_varlen_func, [q, k, v, cu_q, bad_k, max_q, max_k])
        bad_q = cu_q.clone()
        bad_q[-1] = q.shape[0] + 1
        with pytest.raises(RuntimeError, match=re.escape(f"cu_seqlens_q must end at most at q.shape[0] (total_q) = "
                                                         f"{q.shape[0]}, got cu_seqlens_q[3] = {q.shape[0] + 1}")):
            flashtriton.flash_attn_varlen_func(q, k, v, bad_q, cu_k, max_q + 1, max_k)
    assert gpu_message == cpu_message
    assert "cu_seqlens_k must be non-decreasing" in gpu_message


@pytest.mark.gpu
@gpu_only
def test_gpu_default_mode_does_not_synchronize():
    """A valid varlen forward and backward in default mode run with torch's sync debug mode set to raise."""
    checks.set_strict_checks(False)
    q, k, v, cu_q, cu_k, max_q, max_k = _gpu_varlen_inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    warm_up = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    torch.autograd.grad(warm_up, (q, k, v), dout)  # compiles the kernels outside the check
    torch.cuda.synchronize()
    with poisoned_outputs():
        torch.cuda.set_sync_debug_mode("error")
        try:
            out, lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                                             return_attn_probs=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert_checks_ok(compare_varlen_with_reference(out, lse, q, k, v, cu_q, cu_k, max_k, grads, dout, causal=True))


@pytest.mark.gpu
@gpu_only
def test_gpu_strict_mode_skips_the_checks_under_graph_capture():
    """Strict mode: checked eagerly, unchecked (no synchronization) inside a CUDA graph capture; the replay is right."""
    q, k, v, cu_q, cu_k, max_q, max_k = _gpu_varlen_inputs()
    with flashtriton.strict_checks():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                             return_attn_probs=True)
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_checks_ok(compare_varlen_with_reference(out, lse, q, k, v, cu_q, cu_k, max_k))

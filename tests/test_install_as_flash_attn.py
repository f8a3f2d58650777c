"""flashtriton.install_as_flash_attn() (docs/api.md §10): code written against flash_attn imports it unchanged.

The proof is a real third-party library from PyPI, ring-flash-attn (a test extra): it imports flash_attn's
low-level _flash_attn_forward / _flash_attn_backward at import time and runs each block of a sequence split over
processes through them, the backward with the whole sequence's out and softmax_lse. Its ring and zigzag
attention on 2 gloo CPU processes must match flashtriton's single-process result, forward and backward, on both
CPU paths (the interpreted Triton kernels and the reference path), and the float64 reference.
"""

import dataclasses
import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashtriton
from flashtriton import bert_padding
from flashtriton.flash_attn_interface import _flash_attn_backward, _flash_attn_forward
from flashtriton.layers import rotary as layers_rotary
from flashtriton.ops import backend
from flashtriton.ops.triton import rotary as triton_rotary
from flashtriton.reference import attention_reference
from flashtriton.testing import Case, assert_checks_ok, check_error, compare_with_reference

ROOT = Path(__file__).resolve().parents[1]
PROVIDED = ["flash_attn", "flash_attn.flash_attn_interface", "flash_attn.bert_padding", "flash_attn.layers",
            "flash_attn.layers.rotary", "flash_attn.ops", "flash_attn.ops.triton", "flash_attn.ops.triton.rotary"]


def _drop_flash_attn_modules():
    for name in [name for name in sys.modules if name == "flash_attn" or name.startswith("flash_attn.")]:
        del sys.modules[name]


@pytest.fixture(autouse=True)
def clean_modules():
    """Every test starts and ends without flash_attn modules in this process."""
    _drop_flash_attn_modules()
    yield
    _drop_flash_attn_modules()


def test_flash_attn_imports_resolve_to_flashtriton():
    module = flashtriton.install_as_flash_attn()
    import flash_attn
    import flash_attn.layers.rotary
    from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from flash_attn.bert_padding import pad_input, unpad_input
    from flash_attn.flash_attn_interface import _flash_attn_backward as backward_op
    from flash_attn.flash_attn_interface import _flash_attn_forward as forward_op
    from flash_attn.layers.rotary import RotaryEmbedding, apply_rotary_emb
    from flash_attn.ops.triton.rotary import apply_rotary

    assert module is flash_attn
    assert flash_attn_func is flashtriton.flash_attn_func
    assert flash_attn_varlen_func is flashtriton.flash_attn_varlen_func
    assert flash_attn_with_kvcache is flashtriton.flash_attn_with_kvcache
    assert (forward_op, backward_op) == (_flash_attn_forward, _flash_attn_backward)
    assert (pad_input, unpad_input) == (bert_padding.pad_input, bert_padding.unpad_input)
    assert (RotaryEmbedding, apply_rotary_emb) == (layers_rotary.RotaryEmbedding, layers_rotary.apply_rotary_emb)
    assert apply_rotary is triton_rotary.apply_rotary
    assert flash_attn.layers.rotary is layers_rotary
    assert flash_attn.flash_attn_interface.flash_attn_func is flashtriton.flash_attn_func
    assert flash_attn.__version__ == flashtriton.__version__
    assert tuple(int(part) for part in flash_attn.__version__.split(".")[:2]) >= (2, 7)
    assert all(name in sys.modules for name in PROVIDED)
    # what transformers' availability check calls (it also asks importlib.metadata, which this does not change)
    assert importlib.util.find_spec("flash_attn") is not None


def test_calling_it_twice_returns_the_same_modules():
    first = flashtriton.install_as_flash_attn()
    modules = {name: sys.modules[name] for name in PROVIDED}
    assert flashtriton.install_as_flash_attn() is first
    assert all(sys.modules[name] is module for name, module in modules.items())


def test_other_flash_attn_submodules_are_not_found():
    flashtriton.install_as_flash_attn()
    with pytest.raises(ModuleNotFoundError, match="flash_attn.modules"):
        importlib.import_module("flash_attn.modules.mha")
    assert importlib.util.find_spec("flash_attn.losses") is None


def test_a_real_flash_attn_already_imported_is_refused():
    real = types.ModuleType("flash_attn")
    real.__file__ = "/site-packages/flash_attn/__init__.py"
    sys.modules["flash_attn"] = real
    with pytest.raises(RuntimeError, match=r"flash_attn \(/site-packages/flash_attn/__init__.py\)"):
        flashtriton.install_as_flash_attn()
    assert sys.modules["flash_attn"] is real
    assert "flash_attn.flash_attn_interface" not in sys.modules


def test_a_real_flash_attn_submodule_already_imported_is_refused():
    sys.modules["flash_attn.flash_attn_interface"] = types.ModuleType("flash_attn.flash_attn_interface")
    with pytest.raises(RuntimeError, match="flash_attn.flash_attn_interface"):
        flashtriton.install_as_flash_attn()
    assert "flash_attn" not in sys.modules


def test_a_real_flash_attn_installed_but_not_imported_is_shadowed(tmp_path, monkeypatch):
    package = tmp_path / "flash_attn"
    package.mkdir()
    for name in ("__init__.py", "flash_attn_interface.py", "modules.py"):
        (package / name).write_text("raise AssertionError('a file of the installed flash_attn was executed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    flashtriton.install_as_flash_attn()
    from flash_attn.flash_attn_interface import flash_attn_func

    assert flash_attn_func is flashtriton.flash_attn_func
    with pytest.raises(ModuleNotFoundError, match="flash_attn.modules"):
        importlib.import_module("flash_attn.modules")


def test_the_wheel_ships_no_flash_attn_package():
    import setuptools
    tomllib = pytest.importorskip("tomllib")

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = setuptools.find_packages(str(ROOT), include=include)
    assert "flashtriton.integrations" in packages
    assert all(name == "flashtriton" or name.startswith("flashtriton.") for name in packages), packages


# ------------------------------------------------------------------------------------------------------------
# ring-flash-attn on 2 gloo CPU processes
# ------------------------------------------------------------------------------------------------------------

WORLD = 2
RING_CASES = {  # name -> (function, causal)
    "ring": ("ring_flash_attn.ring_flash_attn", "ring_flash_attn_func", False),
    "ring-causal": ("ring_flash_attn.ring_flash_attn", "ring_flash_attn_func", True),
    "zigzag-causal": ("ring_flash_attn.zigzag_ring_flash_attn", "zigzag_ring_flash_attn_func", True),
}


def _shards(tensor, rank, zigzag):
    """This rank's rows of a (B, S, H, D) tensor: chunk `rank` of WORLD, or with zigzag chunks rank and
    2 * WORLD - 1 - rank of 2 * WORLD (each rank then holds as much causal work as the others)."""
    if not zigzag:
        return tensor.chunk(WORLD, dim=1)[rank]
    chunks = tensor.chunk(2 * WORLD, dim=1)
    return torch.cat([chunks[rank], chunks[2 * WORLD - 1 - rank]], dim=1)


def _unshard(pieces, zigzag):
    if not zigzag:
        return torch.cat(pieces, dim=1)
    halves = [piece.chunk(2, dim=1) for piece in pieces]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=1)


def _import_ring_modules():
    """ring_flash_attn's attention modules. The package's __init__ also imports its Hugging Face adapter, which
    imports transformers at import time; the attention modules need only torch and flash_attn, so the package
    is entered without running its __init__."""
    spec = importlib.util.find_spec("ring_flash_attn")
    package = types.ModuleType("ring_flash_attn")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["ring_flash_attn"] = package
    return {name: importlib.import_module(module) for name, (module, _, _) in RING_CASES.items()}


def _ring_worker(rank, cpu_paths, directory):
    """One rank: every RING_CASES function forward and backward on this rank's shards, on each CPU path; results
    to a file."""
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=WORLD)
    try:
        flashtriton.install_as_flash_attn()
        modules = _import_ring_modules()
        q, k, v, dout = torch.load(f"{directory}/inputs.pt")
        results = {}
        for cpu_path in cpu_paths:
            backend.KERNELS_INTERPRETED = cpu_path == "interpreter"
            for name, (_, function, causal) in RING_CASES.items():
                zigzag = name.startswith("zigzag")
                local = [_shards(t, rank, zigzag).detach().clone().requires_grad_() for t in (q, k, v)]
                out = getattr(modules[name], function)(*local, causal=causal)
                out.backward(_shards(dout, rank, zigzag))
                results[cpu_path, name] = [out.detach(), *(t.grad for t in local)]
        torch.save(results, f"{directory}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(importlib.util.find_spec("ring_flash_attn") is None,
                    reason="ring-flash-attn is not installed (pip install --no-deps ring-flash-attn; a test extra)")
def test_ring_flash_attn_matches_flashtriton(monkeypatch, tmp_path):
    # one pair of processes runs every CPU path: starting them is most of this test's time
    cpu_paths = ["interpreter", "reference"] if backend.KERNELS_INTERPRETED else ["reference"]
    case = Case(batch=1, seqlen_q=16, seqlen_k=16, num_heads=2, num_heads_k=2, head_dim=16, dtype=torch.float16)
    q, k, v = (torch.randn(1, 16, 2, 16).to(torch.float16) for _ in range(3))
    dout = torch.randn_like(q)
    torch.save((q, k, v, dout), tmp_path / "inputs.pt")
    mp.spawn(_ring_worker, args=(cpu_paths, str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    for cpu_path in cpu_paths:
        monkeypatch.setattr(backend, "KERNELS_INTERPRETED", cpu_path == "interpreter")
        for name, (_, _, causal) in RING_CASES.items():
            zigzag = name.startswith("zigzag")
            ring = [_unshard([r[cpu_path, name][i] for r in ranks], zigzag) for i in range(4)]
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = flashtriton.flash_attn_func(*inputs, causal=causal)
            out.backward(dout)
            single = [out.detach(), *(t.grad for t in inputs)]
            for label, ours, theirs in zip(("out", "dq", "dk", "dv"), single, ring):
                torch.testing.assert_close(theirs.float(), ours.float(), atol=3e-2, rtol=3e-2,
                                           msg=lambda m: f"{cpu_path} {name} {label}: {m}")
            _, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, 16 ** -0.5, causal, -1, -1, 0.0, None, False)
            checks = compare_with_reference(dataclasses.replace(case, causal=causal), ring[0], lse, q, k, v, None,
                                            ring[1:], dout)
            # ring-flash-attn returns dq cast to bfloat16 whatever the input dtype: its dq is held to the float64
            # gradient within twice what that cast alone costs
            inputs64 = [t.double().requires_grad_() for t in (q, k, v)]
            out64, _ = attention_reference(*inputs64, causal=causal, compute_dtype=torch.float64)
            dq64 = torch.autograd.grad(out64, inputs64[0], dout.double())[0]
            checks = [c for c in checks if c.name != "dq"]
            checks.append(check_error("dq", ring[1], dq64, dq64.to(torch.bfloat16), atol=1e-3))
            assert_checks_ok(checks, f"{cpu_path} {name} (ring-flash-attn)")

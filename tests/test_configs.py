"""Pure functions of flashtriton.configs (tile tables, split-KV heuristic), checked on the CPU."""

import pytest
import torch

from flashtriton import configs
from flashtriton.ops.backend import splits_for


def test_num_splits_heuristic_splits_only_small_grids():
    assert configs.num_splits_heuristic(num_programs=4096, num_key_blocks=512, num_sms=132) == 1
    assert configs.num_splits_heuristic(num_programs=32, num_key_blocks=1, num_sms=132) == 1
    splits = configs.num_splits_heuristic(num_programs=32, num_key_blocks=512, num_sms=132)
    assert 2 <= splits <= 128
    # The chosen count fills the machine at least 85% as well as the best one allowed.
    efficiency = lambda s: (32 * s / 132) / -(-32 * s // 132)  # noqa: E731
    assert efficiency(splits) >= 0.85 * max(efficiency(s) for s in range(1, 129))


@pytest.mark.parametrize("programs,blocks", [(1, 4096), (8, 1024), (64, 256), (100, 3)])
def test_num_splits_heuristic_stays_in_bounds(programs, blocks):
    splits = configs.num_splits_heuristic(programs, blocks, 132)
    assert 1 <= splits <= min(128, blocks)


def test_decode_rows_get_small_tiles():
    assert configs.fwd_config("sm90", 128, False, 1).block_m == configs.DECODE_MAX_ROWS
    assert configs.fwd_config("sm90", 128, False, 4096).block_m >= 64
    assert configs.fwd_config("interpreter", 128, False, 1).block_m == 64


def test_block_d_is_a_power_of_two_at_least_16():
    assert [configs.block_d(d) for d in (1, 16, 17, 40, 128, 129, 256)] == [16, 16, 32, 64, 128, 256, 256]


def test_paged_decode_splits_for_more_programs_per_sm():
    """Paged caches count PAGED_PROGRAMS_PER_SM programs per SM, and key blocks of the page-sized tile."""
    q = torch.empty(1, 1, 32, 128)
    block_n = configs.paged_config(configs.fwd_config("interpreter", 128, False, 1), 16).block_n
    assert block_n == 16
    paged = splits_for(q, 8, 1, 131072, 0, page_size=16)
    expected = configs.num_splits_heuristic(8, 131072 // block_n,
                                            configs.multiprocessor_count(q.device) * configs.PAGED_PROGRAMS_PER_SM)
    assert paged == expected > splits_for(q, 8, 1, 131072, 0)


def test_paged_decode_tiles_pipeline_deeper_when_the_tile_shrinks_to_the_page():
    """A decode tile cut to a 64-token page takes PAGED_DECODE_STAGES; pages holding whole tiles and
    prefill tiles keep their stages."""
    decode = configs.fwd_config("sm90", 128, False, 1)
    shrunk = configs.forward_launch_config("sm90", 128, False, 1, page_size=64)
    assert (shrunk.block_n, shrunk.num_stages) == (64, configs.PAGED_DECODE_STAGES) != (decode.block_n,
                                                                                        decode.num_stages)
    assert configs.forward_launch_config("sm90", 128, False, 1, page_size=256) == decode
    prefill = configs.fwd_config("sm90", 128, False, 4096)
    assert configs.forward_launch_config("sm90", 128, False, 4096, page_size=64).num_stages == prefill.num_stages


def test_tma_off_switch_clears_every_config(monkeypatch):
    """FLASHTRITON_TMA=0 (configs.TMA_ALLOWED) turns tensor descriptors off in forward and backward configs."""
    assert configs.fwd_config("sm90", 128).use_tma and configs.bwd_config("sm90", 128).use_tma
    monkeypatch.setattr(configs, "TMA_ALLOWED", False)
    for head_dim in (64, 128, 256):
        assert not configs.fwd_config("sm90", head_dim).use_tma
        assert not configs.fwd_config("sm90", head_dim, causal=True, dropout=True).use_tma
        assert not configs.bwd_config("sm90", head_dim).use_tma


def test_tma_compatible_needs_16_byte_strides_and_a_contiguous_last_dim():
    from flashtriton.ops.launching import tma_compatible

    base = torch.empty(2, 64, 4, 64, dtype=torch.float16)
    assert tma_compatible(base)
    assert tma_compatible(base[:, 3:])                       # row offset of 3 * 256 elements: aligned
    assert not tma_compatible(base[..., 1:33])               # base pointer 2 bytes past alignment
    assert not tma_compatible(base.transpose(1, 3))          # last dim not contiguous
    assert not tma_compatible(torch.empty(2, 8, 4, 20, dtype=torch.float16)[..., :12])  # head stride 40 bytes
    assert tma_compatible(torch.empty(2, 8, 4, 12, dtype=torch.float32))            # head stride 48 bytes


def test_checked_descriptors_equal_the_validated_ones():
    """launching.descriptor_builder skips TensorDescriptor's checks but must build the same object; a class of
    other fields, or one whose __post_init__ adds or changes attributes (another Triton version), keeps its own
    constructor."""
    import dataclasses

    from flashtriton.ops.launching import descriptor_builder
    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon import language as gl

    tensor = torch.empty(2, 96, 4, 64, dtype=torch.bfloat16)[:, 5:]
    block, layout = [1, 64, 1, 64], gl.NVMMASharedLayout.get_default_for([1, 64, 1, 64], gl.bfloat16)
    build = descriptor_builder(hopper.TensorDescriptor)
    validated = hopper.TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), block, layout)
    for _ in range(3):  # the first call compares the two ways, the later ones skip the checks
        checked = build(tensor, list(tensor.shape), list(tensor.stride()), block, layout)
        assert type(checked) is hopper.TensorDescriptor and checked.base is tensor
        assert {k: v for k, v in vars(checked).items() if k != "base"} == \
            {k: v for k, v in vars(validated).items() if k != "base"}

    @dataclasses.dataclass
    class Derived:
        base: object
        shape: list
        strides: list
        block_shape: list
        layout: object

        def __post_init__(self):
            self.rank = len(self.shape)

    build_derived = descriptor_builder(Derived)
    assert all(build_derived(tensor, [1], [1], [1], None).rank == 1 for _ in range(3))

    @dataclasses.dataclass
    class Renamed:
        tensor: object
        shape: list
        strides: list
        block_shape: list
        layout: object

    class Plain:
        pass

    assert descriptor_builder(Renamed) is Renamed
    assert descriptor_builder(Plain) is Plain


def test_device_guard_is_a_no_op_off_the_gpu_and_on_the_current_device():
    from flashtriton.ops.launching import device_guard

    with device_guard(torch.empty(1)):
        pass
    if torch.cuda.is_available():
        current = torch.cuda.current_device()
        with device_guard(torch.empty(1, device=f"cuda:{current}")):
            assert torch.cuda.current_device() == current


def test_wrapped_compile_step_disables_line_info_unless_the_user_chose():
    """launching.compiled_without_line_info: only the kernel's compile step sees TRITON_DISABLE_LINE_INFO set (and
    Triton's knob with it); afterwards the process's setting is back; a user's own setting is left alone; wrapping
    twice wraps once; an object without a compile step (an interpreted kernel) is left as it is."""
    import os

    from triton import knobs

    from flashtriton.ops.launching import LINE_INFO_VARIABLE, compiled_without_line_info

    class Kernel:
        def __init__(self):
            self.seen = []

        def _do_compile(self, key):
            self.seen.append((key, os.environ.get(LINE_INFO_VARIABLE), knobs.compilation.disable_line_info))
            return key

    saved = os.environ.pop(LINE_INFO_VARIABLE, None)
    try:
        kernel, interpreted = Kernel(), object()
        compiled_without_line_info(kernel, interpreted)
        compiled_without_line_info(kernel)
        assert kernel._do_compile("first") == "first"
        assert kernel.seen == [("first", "1", True)]
        assert LINE_INFO_VARIABLE not in os.environ and not knobs.compilation.disable_line_info
        os.environ[LINE_INFO_VARIABLE] = "0"
        kernel._do_compile("mine")
        assert kernel.seen[-1] == ("mine", "0", False)
        assert os.environ[LINE_INFO_VARIABLE] == "0"
    finally:
        os.environ.pop(LINE_INFO_VARIABLE, None)
        if saved is not None:
            os.environ[LINE_INFO_VARIABLE] = saved


def test_compiler_key_ahead_starts_only_where_compiles_can_happen(monkeypatch):
    """launching.compiler_key_ahead: with a CUDA build of torch, compiled kernels and an empty cache, a daemon
    thread computes Triton's key once (a stand-in key function counts the calls); interpreted kernels, a CPU build
    of torch and a key already computed each start nothing."""
    import functools
    import threading

    import triton.runtime.cache

    from flashtriton.ops.launching import compiler_key_ahead, compiler_key_computed

    calls = []

    @functools.lru_cache
    def stand_in_key():
        calls.append(threading.current_thread().name)
        return "key"

    monkeypatch.setattr(triton.runtime.cache, "triton_key", stand_in_key)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert compiler_key_ahead(True) is None
    monkeypatch.setattr(torch.version, "cuda", None)
    assert compiler_key_ahead(False) is None
    assert calls == [] and compiler_key_computed() is False
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    thread = compiler_key_ahead(False)
    assert thread is not None and thread.daemon
    thread.join(timeout=30)
    assert calls == ["flashtriton-triton-key"] and stand_in_key.cache_info().currsize == 1
    assert compiler_key_computed() is True
    assert compiler_key_ahead(False) is None


def test_import_computes_the_compiler_key_ahead_on_cuda_builds_only():
    """In a fresh process without TRITON_INTERPRET, importing flashtriton starts the key's thread exactly where
    torch is a CUDA build (CI's CPU build: no thread, key not computed; the H200: the key cached once the thread
    ends)."""
    import os
    import subprocess
    import sys

    script = ("import threading, torch, flashtriton\n"
              "from triton.runtime.cache import triton_key\n"
              "started = [t for t in threading.enumerate() if t.name == 'flashtriton-triton-key']\n"
              "[t.join(60) for t in started]\n"
              "print(torch.version.cuda is not None, len(started), triton_key.cache_info().currsize)\n")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    cuda_build, started, cached = result.stdout.split()
    expected = "1" if cuda_build == "True" else "0"
    assert (started, cached) == (expected, expected), result.stdout


def test_every_compiled_kernel_is_wrapped_to_compile_without_line_info():
    """Outside the interpreter (a fresh process without TRITON_INTERPRET: kernels are Triton's JITFunctions, which
    a CPU-only machine can create), every flashtriton kernel entry point compiles without line info once the
    launchers are imported."""
    import os
    import subprocess
    import sys

    script = ("import flashtriton, flashtriton.ops.backend, flashtriton.ops.hopper, flashtriton.ops.kvcache, "
              "flashtriton.ops.triton.rotary\n"
              "from flashtriton.kernel_inspect import flashtriton_kernels\n"
              "kernels = flashtriton_kernels()\n"
              "compiled = {n for n, k in kernels.items() if hasattr(k, '_do_compile')}\n"
              "bare = sorted(n for n in compiled if not getattr(kernels[n]._do_compile, 'without_line_info', False))\n"
              "print(len(compiled), bare)\n")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    count, bare = result.stdout.split(maxsplit=1)
    assert int(count) >= 12 and bare.strip() == "[]", result.stdout

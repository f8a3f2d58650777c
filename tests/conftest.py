"""Test setup. One test-only patch of Triton's interpreter lives here, for speed only: the interpreter re-patches
triton.language on every call of a @triton.jit helper (~2.5 ms each); inside a running kernel the language is
already patched, so nested calls skip it. Results never depend on a test-only patch: the library computes bf16
products right in the interpreter itself (flashtriton.kernels.common.mma), and tests/test_interpreter_bf16.py
fails if a patch of the interpreter's dot comes back here.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings


import flashtriton.ops.backend as backend

INTERPRETED = backend.KERNELS_INTERPRETED


def _patch_interpreter() -> None:
    from triton.runtime import interpreter

    grid_call = interpreter.GridExecutor.__call__
    device_call = interpreter.InterpretedFunction.__call__
    patched_in_this_launch = set()

    def grid_call_tracked(self, *args, **kwargs):
        patched_in_this_launch.clear()
        return grid_call(self, *args, **kwargs)

    def device_call_fast(self, *args, **kwargs):
        if self.fn not in patched_in_this_launch:
            patched_in_this_launch.add(self.fn)
            return device_call(self, *args, **kwargs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = grid_call_tracked
    interpreter.InterpretedFunction.__call__ = device_call_fast


if INTERPRETED:
    _patch_interpreter()

# Fuzzing profiles (tests/test_fuzz.py): `ci` keeps the interpreter run to a few minutes; `long` is for a GPU
# or a patient CPU (`pytest --hypothesis-profile=long`).
# `ci` is derandomized (the same examples every run, so CI is reproducible); `long` draws new ones each run,
# FLASHTRITON_FUZZ_EXAMPLES per test (default 400; fewer to fit a time-limited GPU call).
_FUZZ_SETTINGS = dict(deadline=None, print_blob=True,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=25, derandomize=True, **_FUZZ_SETTINGS)
settings.register_profile("long", max_examples=int(os.environ.get("FLASHTRITON_FUZZ_EXAMPLES", "400")),
                          derandomize=False, **_FUZZ_SETTINGS)
settings.load_profile("ci")


@pytest.fixture
def benchmark_script():
    """Loads benchmarks/<name>.py of this checkout as a module: benchmark_script("bench_host")."""

    def load(name: str):
        path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def force_tma():
    """Tensor descriptors on in forward and backward configs (flashtriton.testing.forced_tma), so CPU runs
    exercise the TMA code paths sm90 runs."""
    from flashtriton.testing import forced_tma

    with forced_tma():
        yield


@pytest.fixture
def force_dq_atomic():
    """dQ by atomics in the dK/dV kernel (flashtriton.testing.forced_dq_atomic)."""
    from flashtriton.testing import forced_dq_atomic

    with forced_dq_atomic():
        yield


def pytest_report_header(config):
    mode = "Triton interpreter" if INTERPRETED else "compiled Triton on CUDA / reference on CPU"
    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    import numpy
    import triton

    return [f"flashtriton kernels: {mode}; CUDA device: {cuda}; TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}",
            f"torch {torch.__version__}, triton {triton.__version__}, numpy {numpy.__version__}"]

"""Test setup. Two test-only patches of Triton's interpreter live here, never in the library:

1. bf16 tl.dot: Triton 3.6-3.9's interpreter multiplies bf16 operands as their uint16 storage
   (an integer matmul). We convert bf16 operands to fp32 first, which is what the GPU computes.
2. Speed: the interpreter re-patches triton.language on every call of a @triton.jit helper
   (~2.5 ms each). Inside a running kernel the language is already patched, so nested calls skip it.
"""

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings


import flashtriton.ops.backend as backend

INTERPRETED = backend.KERNELS_INTERPRETED


def _patch_interpreter() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    builder_cls = interpreter.InterpreterBuilder
    original_dot = builder_cls.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16 or b.dtype == tl.bfloat16:
            a = interpreter.TensorHandle(interpreter._convert_float(a.data, a.dtype, tl.float32, None).view(np.float32),
                                         tl.float32) if a.dtype == tl.bfloat16 else a
            b = interpreter.TensorHandle(interpreter._convert_float(b.data, b.dtype, tl.float32, None).view(np.float32),
                                         tl.float32) if b.dtype == tl.bfloat16 else b
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = create_dot

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
    return [f"flashtriton kernels: {mode}; CUDA device: {cuda}; TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}"]

"""Opt-in patches of Triton's interpreter, applied by `flashtriton validate` only when it runs the kernels there.

Importing flashtriton never applies them. tests/conftest.py keeps its own copy for the test suite.

1. bf16 tl.dot: Triton 3.6-3.9's interpreter multiplies bf16 operands as their uint16 storage (an
   integer matmul). The patch converts bf16 operands to fp32 first, which is what the GPU computes.
2. Speed: the interpreter re-patches triton.language on every call of a @triton.jit helper (~2.5 ms
   each). Inside a running kernel the language is already patched, so nested calls skip it.
"""

from __future__ import annotations

BF16_DOT_PATCH = "bf16 tl.dot patched to fp32"
NESTED_CALL_PATCH = "nested @triton.jit calls skip re-patching triton.language (speed only)"

_APPLIED_MARK = "_flashtriton_patched"


def apply_interpreter_patches() -> list[str]:
    """Patch Triton's interpreter once per process; returns the descriptions of the patches in effect."""
    from triton.runtime import interpreter

    if not getattr(interpreter, _APPLIED_MARK, False):
        _patch_bf16_dot(interpreter)
        _patch_nested_calls(interpreter)
        setattr(interpreter, _APPLIED_MARK, True)
    return [BF16_DOT_PATCH, NESTED_CALL_PATCH]


def _patch_bf16_dot(interpreter) -> None:
    import numpy as np
    import triton.language as tl

    builder_cls = interpreter.InterpreterBuilder
    original_dot = builder_cls.create_dot

    def as_fp32(handle):
        if handle.dtype != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, handle.dtype, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, as_fp32(a), as_fp32(b), d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = create_dot


def _patch_nested_calls(interpreter) -> None:
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

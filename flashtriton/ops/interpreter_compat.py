"""Triton's interpreter (the kernels' CPU path, TRITON_INTERPRET=1) under numpy 2.4 and newer.

The interpreter holds every scalar as a one-element numpy array and, while a kernel runs, gives triton.language's
tensor an `__index__` that calls `int()` on that array. numpy 2.4 refuses `int()` of an array with a dimension
("only 0-dimensional arrays can be converted to Python scalars"), so under it every `range()` over a runtime bound
fails in Triton 3.6's interpreter. `install` wraps the interpreter's tensor patch so that `__index__` reads the one
element instead (`.item()`, which every numpy version takes); it changes nothing where numpy still converts such
arrays, and nothing if the interpreter is laid out otherwise (the tests then say so: tests/test_interpreter_compat.py).
"""

from __future__ import annotations

import numpy


def converts_one_element_arrays() -> bool:
    """Whether this numpy converts an array of one element and one dimension with int() (before 2.4: yes)."""
    try:
        int(numpy.zeros(1, dtype=numpy.int32))
    except TypeError:
        return False
    return True


def _index_of_scalar(tensor) -> int:
    """A scalar tensor of the interpreter (a one-element array) as a Python int."""
    return int(tensor.handle.data.item())


def install() -> bool:
    """Make the interpreter's scalar `__index__` read the element (see the module docstring); True where it now does
    (or numpy still converts such arrays), False where the interpreter has no tensor patch to wrap."""
    if converts_one_element_arrays():
        return True
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None:
        return False
    if getattr(patch_tensor, "reads_the_element", False):
        return True

    def patch_tensor_reading_the_element(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", _index_of_scalar)

    patch_tensor_reading_the_element.reads_the_element = True
    interpreter._patch_lang_tensor = patch_tensor_reading_the_element
    return True

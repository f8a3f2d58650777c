"""ops/interpreter_compat: Triton's interpreter takes range() over a runtime bound under any numpy (2.4 and newer
refuse int() of the one-element arrays it holds scalars in), and the wrapped tensor patch reads the element."""

import numpy
import pytest
import torch
import triton
import triton.language as tl

from flashtriton.ops import backend, interpreter_compat

pytestmark = pytest.mark.skipif(not backend.KERNELS_INTERPRETED, reason="needs TRITON_INTERPRET=1 at import")


@triton.jit
def _count_to_loaded_bound(Bounds, Out, offset):
    """Out[b] = the number of iterations of a loop from offset to Bounds[b] (runtime bounds on both ends)."""
    b = tl.program_id(0)
    count = 0
    for _ in range(offset, tl.load(Bounds + b)):
        count += 1
    tl.store(Out + b, count)


def test_range_over_runtime_bounds_runs_in_the_interpreter():
    bounds = torch.tensor([3, 0, 17], dtype=torch.int32)
    out = torch.full((3, ), -1, dtype=torch.int32)
    _count_to_loaded_bound[(3, )](bounds, out, 1)
    assert out.tolist() == [2, 0, 16]


def test_installed_where_numpy_refuses_the_conversion():
    from triton.runtime import interpreter

    assert interpreter_compat.install()
    refuses = not interpreter_compat.converts_one_element_arrays()
    assert refuses == (tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4))
    assert getattr(interpreter._patch_lang_tensor, "reads_the_element", False) == refuses


def test_wrapped_patch_reads_the_element(monkeypatch):
    from triton.runtime import interpreter

    class Scope:
        def __init__(self):
            self.attributes = {}

        def set_attr(self, obj, name, value):
            self.attributes[name] = value

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", lambda tensor, scope: scope.set_attr(tensor, "T", None))
    monkeypatch.setattr(interpreter_compat, "converts_one_element_arrays", lambda: False)
    assert interpreter_compat.install() and interpreter_compat.install()
    scope = Scope()
    interpreter._patch_lang_tensor(object, scope)
    assert set(scope.attributes) == {"T", "__index__"}

    class Handle:
        data = numpy.array([7], dtype=numpy.int32)

    class Scalar:
        handle = Handle()

    assert scope.attributes["__index__"](Scalar()) == 7
    # installing twice wraps once
    wrapped = interpreter._patch_lang_tensor
    assert interpreter_compat.install() and interpreter._patch_lang_tensor is wrapped

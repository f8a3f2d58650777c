"""ops/launching.launch: a launch whose arguments have the kinds of an earlier one reuses the compiled kernel Triton
picked then. That is sound only if two arguments of one kind (launching.argument_kind) always get the same
specialization from Triton's binder; this checks it against Triton's own function (native_specialize_impl, which
runs without a GPU) on the values where Triton's rules change. On a GPU, FLASHTRITON_VERIFY_PLANS=1 additionally
makes every planned launch compare with Triton's binder (`bash tools/gpu_check.sh plans` runs the kernels' tests so)."""

import itertools

import pytest
import torch

from flashtriton.ops import launching

native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
BaseBackend = pytest.importorskip("triton.backends.compiler").BaseBackend


def triton_specialization(arg):
    return native(BaseBackend, arg, False, True, True)


def _integers():
    edges = [0, 1, 2, 15, 16, 17, 32, 48, 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, 2 ** 32, 2 ** 63 - 1,
             2 ** 63, 2 ** 63 + 16, 2 ** 64 - 1, 2 ** 64 - 16]
    values = set(edges + [-e for e in edges] + list(range(-40, 41)))
    return sorted(v for v in values if -(2 ** 63) <= v < 2 ** 64)  # what Triton specializes at all


def _tensors():
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base, base[1:], base[2:], base[4:], base[8:]]
    for dtype in (torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8, torch.float8_e4m3fn):
        whole = torch.zeros(64, dtype=dtype)
        tensors += [whole, whole[1:], whole[16:]]
    return tensors


def _descriptors():
    gluon_hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    gl = pytest.importorskip("triton.experimental.gluon.language")
    descriptors = []
    for dtype, element in ((torch.bfloat16, gl.bfloat16), (torch.float16, gl.float16)):
        tensor = torch.zeros(2, 256, 4, 128, dtype=dtype)
        for block in ([1, 64, 1, 128], [1, 128, 1, 64]):
            layout = gl.NVMMASharedLayout.get_default_for(block, element)
            for view in (tensor, tensor[1:]):
                descriptors.append(gluon_hopper.TensorDescriptor(view, list(view.shape), list(view.stride()), block,
                                                                 layout))
    return descriptors


def _assert_kinds_determine_specialization(values):
    by_kind = {}
    for value in values:
        kind = launching.argument_kind(value)
        assert kind is not None, f"{type(value)} has no kind"
        specialization = triton_specialization(value)
        seen = by_kind.setdefault(kind, (value, specialization))
        assert seen[1] == specialization, (f"{seen[0]!r} and {value!r} share the kind {kind} but Triton specializes "
                                           f"them as {seen[1]} and {specialization}")
    return by_kind


def test_integer_kinds_determine_triton_specialization():
    by_kind = _assert_kinds_determine_specialization(_integers())
    # the kinds do separate what Triton separates: 1, multiples of 16, the three integer types
    assert len({spec for _, spec in by_kind.values()}) >= 6


def test_tensor_float_bool_none_kinds_determine_triton_specialization():
    _assert_kinds_determine_specialization(_tensors() + [0.0, 1.0, -2.5, 1e30, True, False, None])


def test_tuple_kinds_determine_triton_specialization():
    items = [1, 16, 17, None, 0.5, True, torch.zeros(4), torch.zeros(4)[1:]]
    _assert_kinds_determine_specialization([pair for pair in itertools.product(items, repeat=2)]
                                           + [((1, 16), None), ((17, (None, 32)),)])


def test_tensor_descriptor_kinds_determine_triton_specialization():
    by_kind = _assert_kinds_determine_specialization(_descriptors())
    assert len(by_kind) >= 4


def test_triton_tensor_descriptor_kinds_determine_triton_specialization():
    """The Triton kernels' host descriptors (triton.tools.tensor_descriptor: no layout), as the Triton forward's
    TMA_HOST launches pass them."""
    TensorDescriptor = pytest.importorskip("triton.tools.tensor_descriptor").TensorDescriptor
    descriptors = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tensor = torch.zeros(2, 256, 4, 128, dtype=dtype)
        for block in ([1, 64, 1, 128], [1, 128, 1, 64]):
            for view in (tensor, tensor[1:]):
                descriptors.append(TensorDescriptor(view, list(view.shape), list(view.stride()), block))
    assert len(_assert_kinds_determine_specialization(descriptors)) >= 6


def test_kinds_are_distinct_across_types():
    """1 and True, 0 and 0.0 and False, None and a tensor: never one kind (a dict key must not merge them, equal as
    they compare)."""
    values = [1, True, 0, 0.0, None, torch.zeros(2)]
    kinds = [launching.argument_kind(value) for value in values]
    assert len(set(kinds)) == len(kinds)


def test_unknown_arguments_have_no_kind():
    assert launching.argument_kind("text") is None
    assert launching.argument_kind((1, object())) is None
    assert launching.argument_kind(torch.float32) is None


def test_interpreted_or_foreign_kernels_launch_their_own_way():
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    launching.launch(Recorder(), (3,), 1, 2, FLAG=True)
    launching.launch(Recorder(), (3,), 1, 2, FLAG=True)
    assert calls == [((3,), (1, 2), {"FLAG": True})] * 2


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="launch plans serve compiled kernels (CUDA)")


@cuda
@pytest.mark.parametrize("causal", [False, True])
def test_repeated_calls_launch_planned_kernels_with_the_same_results(monkeypatch, causal):
    """The second call of a shape launches without Triton's binder (and, with Triton 3.6's launcher, without its Python
    wrapper); forward and backward give bitwise what the same calls give through Triton's binder (plans switched off;
    deterministic=True: dQ is added in a fixed order)."""
    import flashtriton

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16)

    def step():
        out = flashtriton.flash_attn_func(q, k, v, causal=causal, deterministic=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        return out, *grads

    from flashtriton.ops import call_plans

    monkeypatch.setattr(call_plans, "CALL_PLANS_ALLOWED", False)  # the launches themselves, not a call plan's
    monkeypatch.setattr(launching, "PLANS_ALLOWED", False)
    expected = step()
    monkeypatch.setattr(launching, "PLANS_ALLOWED", True)
    step()
    before, direct_before = launching.plan_hits, launching.direct_launches
    results = step()
    assert launching.plan_hits > before
    # planned launches call their C launchers (launching.c_launcher) where Triton's launcher is the known one
    if any(plan.direct is not None for plans in launching._plans.values() for plan in plans.values()):
        assert launching.direct_launches > direct_before
    for got, want in zip(results, expected):
        assert torch.equal(got, want)


class _Param:
    def __init__(self, name, is_constexpr):
        self.name, self.is_constexpr, self.default = name, is_constexpr, None


class _StandInKernel:
    """What launching.launch reads of a Triton JIT function (x, then the constexpr BLOCK); kernel[grid](...) records
    its arguments and returns a stand-in compiled kernel, which has no launcher: a planned launch would fail."""
    device_caches = {}
    arg_names = ["x", "BLOCK"]
    params = [_Param("x", False), _Param("BLOCK", True)]

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs)) or object()


def test_unhashable_keyword_arguments_take_the_binder(monkeypatch):
    """A launch whose keyword arguments cannot be a dict key goes through kernel[grid] every time, no plan kept."""
    monkeypatch.setattr(launching.torch.cuda, "current_device", lambda: 0)
    kernel = _StandInKernel()
    launching.launch(kernel, (1,), 3, BLOCK=[16])
    launching.launch(kernel, (1,), 3, BLOCK=[16])
    assert kernel.calls == [((3,), {"BLOCK": [16]})] * 2 and not launching._plans.get(kernel)


def test_constexprs_given_by_position_are_never_planned(monkeypatch):
    """BLOCK=64 and BLOCK=128 have one kind (multiples of 16) but compile apart: a launch that passes a constexpr by
    position keeps going through the binder, so each value gets its own compiled kernel."""
    monkeypatch.setattr(launching.torch.cuda, "current_device", lambda: 0)
    kernel = _StandInKernel()
    for block in (64, 128, 64):
        launching.launch(kernel, (1,), 3, block)
    assert kernel.calls == [((3, block), {}) for block in (64, 128, 64)] and not launching._plans.get(kernel)

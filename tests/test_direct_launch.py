"""ops/launching.c_launcher: planned launches call the compiled kernel's C launcher directly, with each host
descriptor's TMA map encoded once per base address. The C launcher must receive exactly what Triton's own Python
wrapper (CudaLauncher.__call__ and wrap_handle_tensordesc) gives it: checked here with Triton's wrapper over a
recording launcher, on CPU. On a GPU, tests/test_launch_plans.py's planned calls launch directly and give bitwise
what launches through Triton's binder give."""

import types

import pytest
import torch

from flashtriton.ops import launching

driver = pytest.importorskip("triton.backends.nvidia.driver")
gluon_hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
gl = pytest.importorskip("triton.experimental.gluon.language")

DESCRIPTOR_SIGNATURE = "tensordesc<bf16[1, 64, 1, 128]>"


def descriptor(tensor, rows=64):
    block = [1, rows, 1, tensor.shape[-1]]
    return gluon_hopper.TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), block,
                                         gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


class Recorder:
    """A stand-in C launcher: records each launch's arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def stand_in_compiled(signature: dict, metas: list, recorder, cooperative=False, pdl=True, scratch=0):
    """A compiled kernel whose `run` is Triton's CudaLauncher over `recorder` (built without compiling one)."""
    run = object.__new__(driver.CudaLauncher)
    run.num_ctas = 1
    run.global_scratch_size, run.global_scratch_align = scratch, 1
    run.profile_scratch_size, run.profile_scratch_align = 0, 1
    run.launch_cooperative_grid, run.launch_pdl = cooperative, pdl
    run.launch = driver.wrap_handle_tensordesc(recorder, signature, metas)
    return types.SimpleNamespace(run=run, function=0xF00, packed_metadata=(4, 1, 65536))


@pytest.fixture
def encodings(monkeypatch):
    """make_tensordesc_arg replaced (it needs a GPU) by a stand-in whose 'map' names its inputs; returns the list
    of its calls."""
    calls = []

    def encode(arg, meta):
        calls.append((arg.base.data_ptr(), meta["id"]))
        return [("map", arg.base.data_ptr(), meta["id"], tuple(arg.block_shape)), *arg.shape, *arg.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", encode)
    monkeypatch.setattr(launching, "_C_FUNCTIONS", (types.BuiltinFunctionType, Recorder))
    return calls


SIGNATURE = {"q_desc": DESCRIPTOR_SIGNATURE, "Lse": "*fp32", "n": "i32", "k_desc": DESCRIPTOR_SIGNATURE,
             "second": "constexpr", "group": ("*fp32", "i32"), "BLOCK": "constexpr", "o_desc": DESCRIPTOR_SIGNATURE}
METAS = [dict(id=0), dict(id=1), dict(id=2)]


def arguments(q, k, o, lse):
    return (descriptor(q), lse, 7, descriptor(k, 128), None, (lse, 3), 64, descriptor(o))


@pytest.mark.parametrize("cooperative,pdl", [(False, True), (True, False)])
def test_direct_launches_pass_what_tritons_wrapper_passes(encodings, cooperative, pdl):
    tensors = [torch.zeros(2, 256, 4, 128, dtype=torch.bfloat16) for _ in range(3)] + [torch.zeros(8)]
    others = [torch.zeros(2, 256, 4, 128, dtype=torch.bfloat16) for _ in range(3)] + [torch.zeros(8)]
    through_triton, direct = Recorder(), Recorder()
    triton_compiled = stand_in_compiled(SIGNATURE, METAS, through_triton, cooperative, pdl)
    direct_compiled = stand_in_compiled(SIGNATURE, METAS, direct, cooperative, pdl)
    launcher = launching.c_launcher(direct_compiled)
    assert launcher is not None and launcher.c_launch is direct
    for args in (arguments(*tensors), arguments(*others), arguments(*tensors)):
        triton_compiled.run(3, 2, 1, 0xBEEF, triton_compiled.function, triton_compiled.packed_metadata, None, None,
                            None, *args)
        launcher(3, 2, 1, 0xBEEF, direct_compiled, args)
    assert len(direct.calls) == 3 and direct.calls == through_triton.calls
    # Triton's wrapper encodes three descriptors on every launch (9), the direct launches once per base address
    # (6: the third launch repeats the first one's tensors)
    assert len(encodings) == 9 + 6


def test_kept_maps_are_bounded_and_follow_the_address(encodings):
    recorder = Recorder()
    launcher = launching.c_launcher(stand_in_compiled(SIGNATURE, METAS, recorder))
    compiled = stand_in_compiled(SIGNATURE, METAS, recorder)
    pool = torch.zeros(4 * launching.MAPS_PER_DESCRIPTOR, 256, 4, 128, dtype=torch.bfloat16)
    lse = torch.zeros(8)
    for index in range(3 * launching.MAPS_PER_DESCRIPTOR):
        view = pool[index:index + 2]
        launcher(1, 1, 1, 0, compiled, arguments(view, view, view, lse))
        assert recorder.calls[-1][13][1] == view.data_ptr()  # the map of this launch's own address
    assert all(len(maps) <= launching.MAPS_PER_DESCRIPTOR for maps in launcher.maps)


def test_launchers_this_code_does_not_know_take_tritons_way(encodings, monkeypatch):
    recorder = Recorder()
    assert launching.c_launcher(stand_in_compiled(SIGNATURE, METAS, recorder, scratch=128)) is None
    assert launching.c_launcher(types.SimpleNamespace(run=lambda *args: None)) is None
    assert launching.c_launcher(stand_in_compiled(SIGNATURE, [None, None, None], recorder)) is None
    plain = stand_in_compiled({"x": "*fp32", "n": "i32"}, [], recorder)
    assert plain.run.launch is recorder and launching.c_launcher(plain).descriptors == ()
    monkeypatch.setattr(launching, "DIRECT_ALLOWED", False)
    assert launching.c_launcher(stand_in_compiled(SIGNATURE, METAS, recorder)) is None

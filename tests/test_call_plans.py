"""ops/call_plans: a dense forward's launches recorded once and run again for the same signature. On CPU the plan's
parts run with stand-in compiled kernels; on a GPU the forward itself: a planned call gives the whole forward's
results bitwise, on the Gluon and the Triton kernels, and FLASHTRITON_VERIFY_PLANS=1 (tools/gpu_check.sh plans)
compares every planned forward of the kernels' tests with the whole one."""

import dataclasses

import pytest
import torch

import flashtriton
from flashtriton import configs
from flashtriton.ops import backend, call_plans, launching


@dataclasses.dataclass
class _Descriptor:
    """Fields of a host tensor descriptor (call_plans replaces base)."""
    base: torch.Tensor
    shape: list
    strides: list
    block_shape: list
    layout: str


class _Compiled:
    """A compiled kernel's launch interface; run records its arguments."""
    function = "function"
    packed_metadata = "metadata"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


def _launch_record(compiled, args, kwargs=None, tail=("NUM_WARPS",), defaults=(4,)):
    return (launching._Plan(compiled, list(tail), defaults), (3,), args, kwargs or {})


def _call_tensors():
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    out, lse, rng_state = torch.empty(1, 8, 2, 16), torch.empty(1, 2, 8), torch.zeros(2, dtype=torch.int64)
    return q, k, v, out, lse, rng_state


def test_plan_repeats_the_launch_with_the_new_call_tensors(monkeypatch):
    """The planned launch gets the new call's q, k, v and fresh outputs where the recorded one had the first call's,
    descriptors rebuilt over them with the recorded fields, scalars, tuples and the keyword tail as recorded."""
    monkeypatch.setattr(call_plans, "_current_stream", lambda device: "stream")
    compiled = _Compiled()
    q, k, v, out, lse, rng_state = _call_tensors()
    descriptor = _Descriptor(q, [1, 8, 2, 16], [256, 32, 16, 1], [1, 64, 1, 16], "nvmma")
    args = (descriptor, k, (v, None, 7), out, lse, 0.5, (rng_state, 3))
    plan = call_plans.make_plan([_launch_record(compiled, args, {"NUM_WARPS": 8})], q, k, v, out, lse, rng_state, ())
    assert plan is not None
    q2, k2, v2 = (torch.randn(1, 8, 2, 16) for _ in range(3))
    out2, lse2, s_dmask, rng2 = plan.run(q2, k2, v2, backend.new_empty)
    assert out2.shape == out.shape and lse2.shape == lse.shape and s_dmask.numel() == 0 and rng2.tolist() == [0, 0]
    (grid_x, grid_y, grid_z, stream, function, metadata, *hooks, d, kk, vv, o, ll, scale, rng_tuple, warps), = \
        compiled.runs
    assert (grid_x, grid_y, grid_z, stream, function, metadata, hooks) == (3, 1, 1, "stream", "function", "metadata",
                                                                           [None] * 3)
    assert type(d) is _Descriptor and d.base is q2 and (d.shape, d.strides, d.block_shape, d.layout) == (
        descriptor.shape, descriptor.strides, descriptor.block_shape, descriptor.layout)
    assert kk is k2 and vv[0] is v2 and vv[1:] == (None, 7) and o is out2 and ll is lse2 and scale == 0.5
    assert rng_tuple[0] is rng2 and rng_tuple[1] == 3 and warps == 8
    assert descriptor.base is q  # the recorded descriptor is left as it was


@pytest.mark.parametrize("record", ["unknown tensor", "unplanned launch", "no launch", "tensor keyword",
                                    "other operation"])
def test_no_plan_where_a_launch_cannot_be_repeated(record):
    """A launch with a tensor the call did not pass or return (scratch, a copy of an input), one that went through
    Triton's way only, a call without launches, or one that did other work on tensors: no plan."""
    compiled = _Compiled()
    q, k, v, out, lse, rng_state = _call_tensors()
    launches = {"unknown tensor": [_launch_record(compiled, (q, torch.empty(4)))],
                "unplanned launch": [_launch_record(compiled, (q, k)), None],
                "no launch": [],
                "tensor keyword": [_launch_record(compiled, (q, ), {"SCRATCH": torch.empty(4)}, ("SCRATCH", ),
                                                  (None, ))],
                "other operation": [_launch_record(compiled, (q, out))]}[record]
    other = ("copy_.default", ) if record == "other operation" else ()
    assert call_plans.make_plan(launches, q, k, v, out, lse, rng_state, (), other) is None
    assert call_plans.make_plan([_launch_record(compiled, (q, out))], q, k, v, out, lse, rng_state, ()) is not None


def test_recording_notes_work_other_than_allocations_and_views():
    """What a plan would not repeat (a copy, a reduction, an in-place update) is noted; allocations and views are
    not, nor the NaN fill of poisoned outputs."""
    with call_plans.recording() as (_, watch):
        a = torch.empty(3, 4)
        torch.zeros(2, dtype=torch.int64)
        a.unsqueeze(0)[:, 1:].view(2, 4).t()
    assert watch.other == []
    with call_plans.recording(poisoned=True) as (_, watch):
        torch.empty(3).fill_(float("nan"))
    assert watch.other == []
    with call_plans.recording() as (_, watch):
        a = torch.empty(3, 4)
        a.fill_(0.0)
        a.t().contiguous()
        a.sum()
    assert watch.other == ["fill_.Scalar", "clone.default", "sum.default"]


def test_a_signature_keeps_its_first_plan_and_verification_compares(monkeypatch):
    """keep_forward_plan keeps the first plan of a signature (or that it has none); a later, different plan for it
    raises (what FLASHTRITON_VERIFY_PLANS=1 checks on every planned forward)."""
    monkeypatch.setattr(call_plans, "_forward_plans", {})
    compiled = _Compiled()
    q, k, v, out, lse, rng_state = _call_tensors()
    first = call_plans.make_plan([_launch_record(compiled, (q, out, 16))], q, k, v, out, lse, rng_state, ())
    same = call_plans.make_plan([_launch_record(compiled, (q, out, 16))], q, k, v, out, lse, rng_state, ())
    other = call_plans.make_plan([_launch_record(compiled, (q, out, 32))], q, k, v, out, lse, rng_state, ())
    call_plans.keep_forward_plan("signature", first)
    call_plans.keep_forward_plan("signature", same)
    assert call_plans._forward_plans["signature"] is first
    with pytest.raises(RuntimeError, match="call plan"):
        call_plans.keep_forward_plan("signature", other)
    call_plans.keep_forward_plan("no plan", None)
    monkeypatch.setattr(launching, "VERIFY_PLANS", False)
    monkeypatch.setattr(launching, "_hooks_present", lambda: False)
    assert call_plans.forward_plan("signature") is first and call_plans.forward_plan("no plan") is None
    assert not call_plans.records_forward("signature") and not call_plans.records_forward("no plan")
    assert call_plans.records_forward("new") and not call_plans.records_forward(None)


def test_cpu_calls_and_options_outside_plans_have_no_signature():
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    options = (0.25, True, -1, 0, 0.0, None, False, None, (None, None, None))
    assert call_plans.forward_signature(q, k, v, 0.0, *options) is None  # CPU tensors run no compiled kernel
    if torch.cuda.is_available():
        q, k, v = (t.cuda() for t in (q, k, v))
        assert call_plans.forward_signature(q, k, v, 0.0, *options) is not None
        assert call_plans.forward_signature(q, k, v, 0.1, *options) is None  # dropout
        assert call_plans.forward_signature(q, k, v, 0.0, *options[:5], torch.ones(2, device="cuda"),
                                            *options[6:]) is None  # ALiBi


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon-if-sm90", "triton"])
@pytest.mark.parametrize("shape", [(2, 300, 4, 128), (1, 64, 8, 64)], ids=["2x300x4x128", "1x64x8x64"])
def test_planned_forward_gives_the_whole_forwards_results(monkeypatch, gluon, shape):
    """The second call of a signature runs its plan and gives the first call's out and lse bitwise (the forward is
    deterministic); a new signature (another dtype) plans anew."""
    monkeypatch.setattr(call_plans, "_forward_plans", {})
    monkeypatch.setattr(configs, "GLUON_ALLOWED", gluon and configs.GLUON_ALLOWED)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    first = flashtriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    hits = call_plans.call_plan_hits
    second = flashtriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert call_plans.call_plan_hits == hits + (not launching.VERIFY_PLANS)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    # new inputs of the same signature: the planned call reads them, not the first call's
    q2 = torch.randn_like(q)
    planned = flashtriton.flash_attn_func(q2, k, v, causal=True)
    monkeypatch.setattr(call_plans, "CALL_PLANS_ALLOWED", False)
    assert torch.equal(planned, flashtriton.flash_attn_func(q2, k, v, causal=True))

"""ops/call_plans: a call's operations and launches recorded once and repeated for the same signature. On CPU the
plan's parts run with stand-in compiled kernels; on a GPU the entry points themselves: planned forwards and backwards
give the whole call's results bitwise, on the Gluon and the Triton kernels, and FLASHTRITON_VERIFY_PLANS=1
(tools/gpu_check.sh plans) compares every planned call of the kernels' tests with the whole one."""

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


def _launch_plan(compiled, tail=("NUM_WARPS",), defaults=(4,)):
    return launching._Plan(compiled, list(tail), defaults)


def _record(events_plan, grid, args, kwargs=None):
    """What launching.launch reports to a recording call."""
    launching._record((events_plan, grid, args, kwargs or {}))


def _call(compiled, q, k, extra=None):
    """A call like the entry points': allocations and views, a launch with a descriptor, tuples, scalars and a
    keyword tail, a copy after it; returns (out, stats)."""
    out = torch.empty(q.shape, dtype=q.dtype)
    flat = out.view(-1)
    stats = torch.zeros(2, dtype=torch.int64)
    descriptor = _Descriptor(q, list(q.shape), list(q.stride()), [1, 4, 1, 16], "nvmma")
    _record(_launch_plan(compiled), (3,), (descriptor, k, (flat, None, 7), 0.5, (stats, 3)
                                           ) + (() if extra is None else (extra, )), {"NUM_WARPS": 8})
    copy = torch.empty(q.shape, dtype=q.dtype)
    copy.copy_(k)
    return out, (stats, copy)


def test_plan_repeats_the_call_on_new_tensors(monkeypatch):
    """The plan's launch gets the new call's tensors and fresh allocations (and views of them) where the recorded one
    had the first call's, the descriptor rebuilt over the new tensor with the recorded fields, scalars, tuples and
    the keyword tail as recorded; its operations (the copy) run on the new tensors; the result is the new call's."""
    monkeypatch.setattr(call_plans, "_current_stream", lambda device: "stream")
    compiled = _Compiled()
    q, k = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    with call_plans._Recorder() as recorder:
        first = _call(compiled, q, k)
    plan = call_plans.make_plan(recorder.events, (q, k), first, (0, 0, 0))
    assert plan is not None and len(compiled.runs) == 0  # _record only notes the launch
    q2, k2 = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    out2, (stats2, copy2) = plan.run((q2, k2))
    (grid_x, grid_y, grid_z, stream, function, metadata, *hooks, d, kk, flat, scale, stats_arg, warps), = compiled.runs
    assert (grid_x, grid_y, grid_z, stream, function, metadata, hooks) == (3, 1, 1, "stream", "function", "metadata",
                                                                           [None] * 3)
    assert type(d) is _Descriptor and d.base is q2 and (d.shape, d.strides, d.block_shape, d.layout) == (
        [1, 8, 2, 16], [256, 32, 16, 1], [1, 4, 1, 16], "nvmma")
    assert kk is k2 and flat[0]._base is out2 and flat[1:] == (None, 7) and scale == 0.5 and warps == 8
    assert stats_arg[0] is stats2 and stats_arg[1] == 3 and stats2.tolist() == [0, 0]
    assert out2.shape == q.shape and out2 is not first[0] and torch.equal(copy2, k2)


@pytest.mark.parametrize("case", ["tensor from elsewhere", "unplanned launch", "no launch", "other operation"])
def test_no_plan_where_the_call_cannot_be_repeated(case):
    """A launch with a tensor that is neither the call's nor made during it, one that went through Triton's way only
    (no compiled kernel known), a call without launches, or an operation outside the repeatable ones: no plan."""
    compiled = _Compiled()
    q, k = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    elsewhere = torch.empty(4)
    with call_plans._Recorder() as recorder:
        if case == "no launch":
            result = torch.empty(3)
        else:
            result = _call(compiled, q, k, extra=elsewhere if case == "tensor from elsewhere" else None)
            if case == "unplanned launch":
                launching._record(None)
            if case == "other operation":
                q.sum()
    assert call_plans.make_plan(recorder.events, (q, k), result, (0, 0, 0)) is None


def test_a_signature_keeps_its_first_plan_and_verification_compares(monkeypatch):
    """keep() keeps the first plan of a signature (or that it has none); a later, different plan for it raises
    (what FLASHTRITON_VERIFY_PLANS=1 checks on every planned call)."""
    monkeypatch.setattr(call_plans, "_plans", {})
    compiled = _Compiled()
    q, k = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    plans = []
    for extra in (None, None, 5):
        with call_plans._Recorder() as recorder:
            result = _call(compiled, q, k, extra=extra)
        plans.append(call_plans.make_plan(recorder.events, (q, k), result, (0, 0, 0)))
    call_plans.keep(("fwd", 1), plans[0])
    call_plans.keep(("fwd", 1), plans[1])
    assert call_plans._plans[("fwd", 1)] is plans[0]
    with pytest.raises(RuntimeError, match=r"call plan of fwd .* step 3 \(a launch\) differs"):
        call_plans.keep(("fwd", 1), plans[2])
    call_plans.keep(("fwd", 2), None)
    monkeypatch.setattr(launching, "VERIFY_PLANS", False)
    monkeypatch.setattr(launching, "_hooks_present", lambda: False)
    assert call_plans.plan_for(("fwd", 1)) is plans[0] and call_plans.plan_for(("fwd", 2)) is None


def test_a_nan_fill_repeats_as_itself():
    """Poisoned outputs are filled with NaN (testing.poisoned_outputs): two recordings of such a call are one plan
    (NaN != NaN must not read as a different plan), and other fill values are another."""
    compiled = _Compiled()
    q, k = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    plans = []
    for value in (float("nan"), float("nan"), 0.0):
        with call_plans._Recorder() as recorder:
            out, stats = _call(compiled, q, k)
            out.fill_(value)
        plans.append(call_plans.make_plan(recorder.events, (q, k), (out, stats), (0, 0, 0)))
    assert plans[0].same_as(plans[1]) and not plans[0].same_as(plans[2])


@pytest.mark.parametrize("change", ["table entry", "table entry deleted", "attribute"])
def test_config_changes_are_another_environment(monkeypatch, change):
    """A config table changed in place (tests and tuning sweeps set entries) or a configs attribute replaced is
    another environment, so no call plan made before the change runs after it; undoing the change is another one
    again (a plan made then is recorded anew)."""
    before = call_plans._environment()
    key = next(iter(configs.HOPPER_FWD))
    if change == "table entry":
        monkeypatch.setitem(configs.HOPPER_FWD, key, dataclasses.replace(configs.HOPPER_FWD[key], stages=3))
    elif change == "table entry deleted":
        monkeypatch.delitem(configs.HOPPER_FWD, key)
    else:
        monkeypatch.setattr(configs, "L2_GROUP_BYTES", {False: 0, True: 0})
    during = call_plans._environment()
    monkeypatch.undo()
    assert len({before, during, call_plans._environment()}) == 3
    assert call_plans._environment() == call_plans._environment()  # nothing else moves it


def test_config_tables_refuse_uncounted_changes():
    """Bulk changes of a config table would not be counted: they raise."""
    for change in (lambda t: t.update({}), lambda t: t.pop(next(iter(t))), lambda t: t.clear(),
                   lambda t: t.setdefault(0, None), lambda t: t.popitem()):
        with pytest.raises(TypeError, match="item assignment"):
            change(configs.HOPPER_BWD)
    assert len(configs.HOPPER_BWD) == len(configs.HOPPER_BWD_HEAD_DIMS)


def test_a_signatures_second_call_records_and_later_ones_run_the_plan(monkeypatch):
    """run_planned: the first call of a signature runs whole without recording, the second whole while recording,
    later ones run the plan; a call without a signature always runs whole."""
    monkeypatch.setattr(call_plans, "_plans", {})
    monkeypatch.setattr(call_plans, "_seen", {})
    monkeypatch.setattr(launching, "VERIFY_PLANS", False)
    monkeypatch.setattr(launching, "_hooks_present", lambda: False)
    monkeypatch.setattr(call_plans, "signature", lambda entry, tensors, options: (entry, options))
    log = []

    class Plan:
        def run(self, tensors):
            log.append("plan")
            return "planned"

    def make_plan(events, tensors, result, counters):
        log.append("made")
        return Plan()

    monkeypatch.setattr(call_plans, "make_plan", make_plan)

    def whole(value):
        log.append("recording" if launching._recorder is not None else "whole")
        return value

    results = [call_plans.run_planned("fwd", whole, (torch.zeros(1), ), (1, ), "whole") for _ in range(4)]
    assert results == ["whole", "whole", "planned", "planned"]
    assert log == ["whole", "recording", "made", "plan", "plan"]
    log.clear()
    assert call_plans.run_planned("fwd", whole, None, (1, ), "whole") == "whole" and log == ["whole"]


def test_cpu_calls_have_no_signature():
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    assert call_plans.signature("fwd", (q, k, v), ()) is None  # CPU tensors run no compiled kernel
    if torch.cuda.is_available():
        q, k, v = (t.cuda() for t in (q, k, v))
        assert call_plans.signature("fwd", (q, k, v), ()) is not None
        assert call_plans.signature("fwd", (q, k.cpu(), v), ()) is None
        # one tensor passed as q and k is another signature than two tensors
        assert call_plans.signature("fwd", (q, q, v), ()) != call_plans.signature("fwd", (q, k, v), ())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon-if-sm90", "triton"])
@pytest.mark.parametrize("shape", [(2, 300, 4, 128), (1, 64, 8, 64)], ids=["2x300x4x128", "1x64x8x64"])
def test_planned_calls_give_the_whole_calls_results(monkeypatch, gluon, shape):
    """The third call of a signature runs its plan (the second recorded it) and gives the whole call's results
    bitwise: the forward's out and lse, and through autograd (deterministic=True) the backward's gradients; new inputs
    of the signature are read (not the recorded call's); a call without plans agrees bitwise."""
    monkeypatch.setattr(call_plans, "_plans", {})
    monkeypatch.setattr(configs, "GLUON_ALLOWED", gluon and configs.GLUON_ALLOWED)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flashtriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)  # a signature's first call: whole
    first = flashtriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)  # whole, recording
    hits = call_plans.call_plan_hits
    second = flashtriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert call_plans.call_plan_hits == hits + (not launching.VERIFY_PLANS)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])

    def step(inputs, dout):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = flashtriton.flash_attn_func(*leaves, causal=True, deterministic=True)
        return (out, *torch.autograd.grad(out, leaves, dout))

    dout = torch.randn_like(q)
    q2 = torch.randn_like(q)
    for _ in range(2):  # whole, then whole and recording
        step((q, k, v), dout)
    results = [step((q, k, v), dout), step((q2, k, v), dout)]
    monkeypatch.setattr(call_plans, "CALL_PLANS_ALLOWED", False)
    for inputs, planned in zip(((q, k, v), (q2, k, v)), results):
        whole = step(inputs, dout)
        assert all(torch.equal(a, b) for a, b in zip(planned, whole))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("new_tokens", [0, 1], ids=["decode", "append-and-decode"])
def test_planned_kvcache_calls_give_the_whole_calls_results(monkeypatch, new_tokens):
    """flash_attn_with_kvcache repeated with one signature runs its plan: the same out and lse bitwise as the whole
    call, and the same appended caches."""
    monkeypatch.setattr(call_plans, "_plans", {})
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    caches = [torch.randn(2, 512, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    new = [torch.randn(2, new_tokens, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)] \
        if new_tokens else [None, None]
    seqlens = torch.tensor([100, 300], dtype=torch.int32, device="cuda")

    def call():
        k_cache, v_cache = (c.clone() for c in caches)
        out, lse = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, k=new[0], v=new[1], cache_seqlens=seqlens,
                                                       causal=True, return_softmax_lse=True)
        return out, lse, k_cache, v_cache

    call()
    call()
    hits = call_plans.call_plan_hits
    planned = call()
    assert call_plans.call_plan_hits == hits + (not launching.VERIFY_PLANS)
    monkeypatch.setattr(call_plans, "CALL_PLANS_ALLOWED", False)
    assert all(torch.equal(a, b) for a, b in zip(planned, call()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_planned_varlen_calls_read_each_calls_sequences(monkeypatch):
    """flash_attn_varlen_func's plan is made for shapes and longest lengths, not for the sequences: a planned call
    with other cu_seqlens of the same shapes (lengths 100, 200 then 200, 100) gives what the whole call gives,
    forward and backward (deterministic=True)."""
    monkeypatch.setattr(call_plans, "_plans", {})
    q, k, v = (torch.randn(300, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)

    def step(lengths):
        cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32, device="cuda")
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flashtriton.flash_attn_varlen_func(*leaves, cu, cu, 200, 200, causal=True, deterministic=True)
        return (out, *torch.autograd.grad(out, leaves, dout))

    for _ in range(2):  # whole, then whole and recording
        step((100, 200))
    hits = call_plans.call_plan_hits
    planned = step((200, 100))
    assert call_plans.call_plan_hits >= hits + 2 * (not launching.VERIFY_PLANS)  # forward and backward
    monkeypatch.setattr(call_plans, "CALL_PLANS_ALLOWED", False)
    assert all(torch.equal(a, b) for a, b in zip(planned, step((200, 100))))

"""Call plans: what a call with one signature did on the host, kept so that later calls with that signature do the
same again without re-deriving it (checks, configs, grids, tile counts, descriptors' validation, argument kinds).

A signature (`signature`) is everything an entry point (backend.mha_fwd / mha_bwd / mha_varlen_fwd / mha_varlen_bwd,
kvcache.mha_fwd_kvcache) reads to decide what to launch: the shapes, strides, dtypes, devices, 16-byte alignment
and identity pattern of its tensors, its scalar options, and the functions and switches that tests and users may
replace (`_environment`). The first call with a signature runs whole; the second runs whole while a recorder
(`_Recorder`) notes, in order, each launch (launching.launch reports it, with its launch plan) and each aten
operation on tensors (a dispatch mode). Where every launch had a launch plan (its compiled kernel known), every
operation is one a plan may repeat (`_REPEATABLE`) and every tensor is one of the call's or made by a noted
operation, the events become a CallPlan: later calls of that signature repeat the operations on their own tensors
and run the compiled kernels with them. Anything else (an operation outside the list, a tensor from elsewhere,
interpreted kernels) leaves the signature without a plan: its calls run whole every time. FLASHTRITON_CALL_PLANS=0
turns call plans off; FLASHTRITON_VERIFY_PLANS=1 records every call and raises where one did anything else than
its signature's plan.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import launching

CALL_PLANS_ALLOWED = os.environ.get("FLASHTRITON_CALL_PLANS", "1") != "0"
MAX_CALL_PLANS = 1024  # signatures past it run whole (nothing else changes)

_plans: dict = {}  # signature -> CallPlan, or _NONE for a signature that has none
_seen: dict = {}  # signatures met once (their second call records)
_NONE = object()
call_plan_hits = 0  # calls that ran from their plan (tests read it)

# the aten operations a plan may repeat: allocations, views (no data moves), the copies and fills the launchers do
# around their kernels, and the index arithmetic of kv-cache calls (keys each row attends, clamped pads). Each is a
# function of its tensors on the device; an operation whose result the host reads (item, a copy to the CPU, a
# comparison) is none of them, so a call that decides anything from tensor values gets no plan
_REPEATABLE = frozenset((
    "empty.memory_format", "empty_strided.default", "zeros.default", "unsqueeze.default", "squeeze.dim",
    "slice.Tensor", "select.int", "as_strided.default", "view.default", "_unsafe_view.default", "t.default",
    "transpose.int", "permute.default", "expand.default", "alias.default", "copy_.default",
    "fill_.Scalar", "zero_.default", "full.default", "add.Tensor", "add.Scalar", "clamp.default",
    "clamp_min.default"))
# the launch counters of ops/hopper.py (tests read them to know which kernels ran); a plan advances them as its call did
_COUNTERS = ("fwd_launch_count", "tail_merge_count", "bwd_launch_count", "bwd_dq_launch_count")


class _NoPlan(Exception):
    """A recorded event that a plan cannot repeat."""


class _Slot:
    """The `index`-th tensor of a replay: the call's tensors first, then each noted operation's result."""

    __slots__ = ("index", )

    def __init__(self, index: int):
        self.index = index


class _DescriptorSlot:
    """A host tensor descriptor over the `index`-th tensor: the recorded one's fields with its base replaced (the
    signature fixes its shape and strides)."""

    __slots__ = ("index", "kind", "fields")

    def __init__(self, index: int, descriptor):
        self.index = index
        self.kind = type(descriptor)
        self.fields = {name: value for name, value in descriptor.__dict__.items() if name != "base"}


_CONSTANT_KINDS = (int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _template(value, slots: dict):
    """value with tensors replaced by their slots (slots: id(tensor) -> index); _NoPlan for a tensor without one."""
    kind = type(value)
    if kind is torch.Tensor:
        index = slots.get(id(value))
        if index is None:
            raise _NoPlan
        return _Slot(index)
    if kind is tuple or kind is list:
        return kind(_template(item, slots) for item in value)
    if kind is dict:
        return {name: _template(item, slots) for name, item in value.items()}
    if value is None or kind in _CONSTANT_KINDS:
        return value
    if hasattr(value, "block_shape") and type(getattr(value, "base", None)) is torch.Tensor and \
            "base" in getattr(value, "__dict__", ()):
        index = slots.get(id(value.base))
        if index is None:
            raise _NoPlan
        return _DescriptorSlot(index, value)
    raise _NoPlan


def _has_slot(template) -> bool:
    kind = type(template)
    return kind is _Slot or kind is _DescriptorSlot or (
        (kind is tuple or kind is list) and any(_has_slot(item) for item in template)) or (
        kind is dict and any(_has_slot(item) for item in template.values()))


def _filled(template, values: list):
    kind = type(template)
    if kind is _Slot:
        return values[template.index]
    if kind is _DescriptorSlot:
        descriptor = object.__new__(template.kind)
        descriptor.__dict__.update(template.fields, base=values[template.index])
        return descriptor
    if kind is tuple or kind is list:
        return kind(_filled(item, values) for item in template)
    if kind is dict:
        return {name: _filled(item, values) for name, item in template.items()}
    return template


def _same(a, b) -> bool:
    """Templates that repeat alike (slots by index, descriptors by kind and fields)."""
    if type(a) is not type(b):
        return False
    if type(a) is _Slot:
        return a.index == b.index
    if type(a) is _DescriptorSlot:
        return a.index == b.index and a.kind is b.kind and a.fields == b.fields
    if type(a) in (tuple, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return a.keys() == b.keys() and all(_same(a[name], b[name]) for name in a)
    return a == b or (a != a and b != b)  # NaN (poisoned outputs' fill value) repeats as NaN


# the torch functions that do what these aten operations do with the same arguments, without the aten operation's
# own argument parsing (about twice a plain call's host time)
_FAST_FORMS = {"empty.memory_format": torch.empty, "empty_strided.default": torch.empty_strided,
               "zeros.default": torch.zeros, "unsqueeze.default": torch.Tensor.unsqueeze,
               "squeeze.dim": torch.Tensor.squeeze, "select.int": torch.Tensor.select,
               "as_strided.default": torch.Tensor.as_strided, "view.default": torch.Tensor.view,
               "t.default": torch.Tensor.t, "transpose.int": torch.Tensor.transpose,
               "permute.default": torch.Tensor.permute, "expand.default": torch.Tensor.expand,
               "copy_.default": torch.Tensor.copy_, "fill_.Scalar": torch.Tensor.fill_,
               "zero_.default": torch.Tensor.zero_}


class _Operation:
    """A noted aten operation: its result becomes the next slot. Arguments without tensors are kept filled
    (`args`); `dynamic` names the positions that take the replay's tensors."""

    __slots__ = ("function", "call", "args", "dynamic", "kwargs")

    def __init__(self, function, args, kwargs, slots: dict):
        self.function = function
        self.call = _FAST_FORMS.get(_operation_name(function), function)
        templates = [_template(arg, slots) for arg in args]
        self.kwargs = _template(kwargs, slots)
        if _has_slot(self.kwargs):
            raise _NoPlan  # no repeatable operation takes a tensor by keyword
        self.args = [None if _has_slot(t) else t for t in templates]
        self.dynamic = tuple((position, t) for position, t in enumerate(templates) if _has_slot(t))

    def run(self, values: list, stream) -> None:
        args = self.args.copy()
        for position, template in self.dynamic:
            args[position] = _filled(template, values)
        values.append(self.call(*args, **self.kwargs))

    def same_as(self, other) -> bool:
        return (type(other) is _Operation and self.function is other.function and _same(self.args, other.args)
                and _same(self.kwargs, other.kwargs) and _same(self.dynamic, other.dynamic))


class _Launch:
    """A noted launch: its compiled kernel and grid, the arguments that do not change (`static`, the launcher's
    keyword tail included) and those that hold tensors (`dynamic`: (position, template)), and the launch plan's C
    launcher where it has one (launching.c_launcher)."""

    __slots__ = ("compiled", "grid", "static", "dynamic", "direct")

    def __init__(self, plan, grid: tuple, args: tuple, kwargs: dict, slots: dict):
        self.compiled = plan.compiled
        self.direct = plan.direct
        self.grid = (*grid, 1, 1)[:3]
        templates = [_template(arg, slots) for arg in args]
        tail = [kwargs.get(name, default) for name, default in zip(plan.tail_names, plan.tail_defaults)]
        if any(_has_slot(_template(value, slots)) for value in tail):
            raise _NoPlan
        self.static = [None if _has_slot(t) else t for t in templates] + tail
        self.dynamic = tuple((position, t) for position, t in enumerate(templates) if _has_slot(t))

    def run(self, values: list, stream) -> None:
        args = self.static.copy()
        for position, template in self.dynamic:
            args[position] = _filled(template, values)
        launching.run_compiled(self.compiled, self.direct, *self.grid, stream, args)

    def same_as(self, other) -> bool:
        return (type(other) is _Launch and self.compiled is other.compiled and self.grid == other.grid
                and _same(self.static, other.static) and _same(self.dynamic, other.dynamic))


class CallPlan:
    """A call's steps (_Operation and _Launch, in order), its result (a template over the slots) and the launch
    counters it advanced ((name, delta))."""

    __slots__ = ("steps", "result", "counters")

    def __init__(self, steps: tuple, result, counters: tuple):
        self.steps = steps
        self.result = result
        self.counters = counters

    def run(self, tensors: tuple):
        """What the call of `tensors` (the signature's, in its order) returns."""
        values = list(tensors)
        stream = _current_stream(tensors[0].device)
        for step in self.steps:
            step.run(values, stream)
        if self.counters:
            from . import hopper

            for name, delta in self.counters:
                setattr(hopper, name, getattr(hopper, name) + delta)
        return _filled(self.result, values)

    def same_as(self, other: "CallPlan") -> bool:
        return (_same(self.result, other.result) and self.counters == other.counters
                and len(self.steps) == len(other.steps) and all(a.same_as(b) for a, b in zip(self.steps, other.steps)))


def _current_stream(device: torch.device):
    from triton.runtime import driver

    return driver.active.get_current_stream(device.index)


class _Recorder(TorchDispatchMode):
    """Notes the aten operations (a dispatch mode) and, through launching._recorder, the launches of one thread's
    call, in order: ("operation", function, args, kwargs, result) and (launch plan or None, grid, args, kwargs)."""

    def __init__(self):
        super().__init__()
        self.events = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        self.events.append(("operation", func, args, kwargs, result))
        return result

    def __enter__(self):
        self.previous, launching._recorder = launching._recorder, (threading.get_ident(), self.events)
        return super().__enter__()

    def __exit__(self, *exc):
        launching._recorder = self.previous
        return super().__exit__(*exc)


def _operation_name(function) -> str:
    name = function.__name__
    return name if "." in name else f"{name}.default"


def make_plan(events: list, tensors: tuple, result, counters_before: tuple) -> Optional[CallPlan]:
    """The CallPlan of a call of `tensors` that did `events` (a _Recorder's) and returned `result`, or None where a
    plan cannot repeat it."""
    slots = {id(tensor): index for index, tensor in enumerate(tensors) if tensor is not None}
    steps, operations = [], 0
    try:
        for event in events:
            if event is None or event[0] is None:  # a launch through Triton's way only: no compiled kernel known
                return None
            if event[0] == "operation":
                _, function, args, kwargs, output = event
                if _operation_name(function) == "detach.default" and type(args[0]) is torch.Tensor:
                    # the dispatch mode's own detach of what an operation returns: the same tensor to a kernel
                    slots[id(output)] = _template(args[0], slots).index
                    continue
                if _operation_name(function) not in _REPEATABLE or type(output) is not torch.Tensor:
                    return None
                steps.append(_Operation(function, args, kwargs, slots))
                slots[id(output)] = len(tensors) + operations  # events holds output: its id stays its own
                operations += 1
            else:
                plan, grid, args, kwargs = event
                steps.append(_Launch(plan, grid, args, kwargs, slots))
        result_template = _template(result, slots)
    except _NoPlan:
        return None
    if not any(type(step) is _Launch for step in steps):
        return None
    from . import hopper

    counters = tuple((name, after - before) for name, before, after in
                     zip(_COUNTERS, counters_before, (getattr(hopper, name) for name in _COUNTERS)) if after != before)
    return CallPlan(tuple(steps), result_template, counters)


_modules: tuple = ()  # the modules _environment reads, imported on its first call (they import this one)


def _environment() -> tuple:
    """The replaceable functions and switches the entry points' decisions go through (tests replace them; a plan made
    under other ones must not run). The objects themselves, so that a replaced one is never mistaken for another;
    for configs (tables changed in place, too), its count of changes."""
    global _modules
    if not _modules:
        import triton

        from .. import configs
        from . import backend, checks, hopper, kvcache

        _modules = (triton, configs, backend, checks, hopper, kvcache)
    triton, configs, backend, checks, hopper, kvcache = _modules
    return (configs.changes, kvcache.new_empty, kvcache.launch_fwd, kvcache.launch, checks._strict,
            checks.copy_index_tensors_to_host, checks.index_tensors_to_check, torch.cuda.is_current_stream_capturing,
            backend.launch_fwd, backend.launch_bwd, backend.new_empty, backend.POISON_OUTPUTS,
            backend.KERNELS_INTERPRETED, backend.runs_triton, backend.splits_for, backend.launch, hopper.launch_fwd,
            hopper.launch_bwd, hopper.gluon_runs, hopper.is_hopper, hopper._multiprocessors, hopper.PROGRAMS_CAP,
            hopper.order_fits, hopper.launch, launching.PLANS_ALLOWED, launching.launch, checks._major_capability,
            torch.version.cuda, triton.knobs.runtime.debug)


def signature(entry: str, tensors: tuple, options: tuple) -> Optional[tuple]:
    """The key of a call plan of `entry` over `tensors` (None entries allowed) and hashable `options`, or None for a
    call that has none: call plans off, a tensor that is not a plain CUDA tensor on the current device (a plan
    launches on the current device), or one in autograd's graph (a plan's operations would not record it)."""
    if not CALL_PLANS_ALLOWED:
        return None
    device = torch.cuda.current_device() if tensors[0].is_cuda else None
    described, first_position = [], {}
    for position, tensor in enumerate(tensors):
        if tensor is None:
            described.append(None)
            continue
        if type(tensor) is not torch.Tensor or tensor.device.index != device or tensor.device.type != "cuda" or \
                (tensor.requires_grad and torch.is_grad_enabled()):
            return None
        # one tensor passed twice (q as k, say) is one slot of the plan: another call must pass one twice too
        same_as = first_position.setdefault(id(tensor), position)
        described.append((tensor.shape, tensor.stride(), tensor.dtype, tensor.data_ptr() & 15 == 0, same_as))
    return (entry, device, tuple(described), options, _environment())


def plan_for(key) -> Optional[CallPlan]:
    """The plan to run for a signature, or None: none (yet, or possible), or the call must run whole
    (FLASHTRITON_VERIFY_PLANS=1, or a launch hook or Triton's debug mode: they need Triton's launch path)."""
    plan = _plans.get(key) if key is not None else None
    if plan is None or plan is _NONE or launching.VERIFY_PLANS or launching._hooks_present():
        return None
    global call_plan_hits
    call_plan_hits += 1
    return plan


def run_planned(entry: str, whole, tensors: Optional[tuple], options: tuple, *args):
    """whole(*args), or the plan of its signature (entry, `tensors` (None: never planned), `options`): the first call
    of a signature runs whole, the second runs whole and records, later ones run its plan. (Recording costs more
    than a whole call: a signature met once, as varlen batches of ever new longest lengths are, never pays it.)"""
    key = None if tensors is None else signature(entry, tensors, options)
    plan = plan_for(key)
    if plan is not None:
        return plan.run(tensors)
    if key is None or (key in _plans and not launching.VERIFY_PLANS):
        return whole(*args)
    if _seen.pop(key, None) is None and not launching.VERIFY_PLANS:
        if len(_seen) >= MAX_CALL_PLANS:
            _seen.clear()
        _seen[key] = True
        return whole(*args)
    from . import hopper

    counters = tuple(getattr(hopper, name) for name in _COUNTERS)
    with _Recorder() as recorder:
        result = whole(*args)
    keep(key, make_plan(recorder.events, tensors, result, counters))
    return result


def keep(key, plan: Optional[CallPlan]) -> None:
    """Keep the plan of a signature (None: it has none). A signature that has a plan must get the same one again
    (FLASHTRITON_VERIFY_PLANS=1 records every call)."""
    kept = _plans.get(key)
    if kept is None:
        if len(_plans) < MAX_CALL_PLANS:
            _plans[key] = _NONE if plan is None else plan
    elif kept is not _NONE and (plan is None or not plan.same_as(kept)):
        raise RuntimeError(f"the call plan of {key[0]} differs from what the whole call did: {len(kept.steps)} planned "
                           f"steps, {'none' if plan is None else len(plan.steps)} now; {_first_difference(kept, plan)}")


def _first_difference(kept: CallPlan, plan: Optional[CallPlan]) -> str:
    """Where two plans of a signature part (for keep's error)."""
    if plan is None:
        return "the call had no plan"
    for index, (a, b) in enumerate(zip(kept.steps, plan.steps)):
        if not a.same_as(b):
            what = _operation_name(a.function) if type(a) is _Operation else "a launch"
            return f"step {index} ({what}) differs"
    return "their results or launch counters differ" if len(kept.steps) == len(plan.steps) else "one has more steps"

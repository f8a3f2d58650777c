"""Call plans: what a dense forward with one signature launched, kept so that the next call with that signature runs
the same compiled kernels again without re-deriving them (configs, grids, tile counts, checks, argument kinds).

A signature (`forward_signature`) is everything backend.mha_fwd reads to decide what to launch: the shapes, strides,
dtypes, devices and 16-byte alignment of q, k and v, the scalar options, the current device, and the functions and
switches that tests and users may replace (`_environment`). The first call with a signature runs the whole forward
while launching.launch records its launches (`recording`). Where every launch went through a launch plan (its
compiled kernel known) and every tensor argument is q, k, v, out, lse or rng_state, or a host tensor descriptor over
one of them, the launches become a CallPlan: the next call allocates the outputs as the first did, puts its tensors
into the recorded arguments and runs the compiled kernels. Anything else (scratch of a cut tail or of split-KV
partials, a copy of an input, any aten operation besides allocations and views (_OperationWatch), interpreted
kernels, ALiBi, sinks, dropout, FP8) leaves the signature without a plan,
and its calls run the whole forward every time. FLASHTRITON_CALL_PLANS=0 turns call plans off;
FLASHTRITON_VERIFY_PLANS=1 runs the whole forward on every hit as well and raises where it launches anything else.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import launching

CALL_PLANS_ALLOWED = os.environ.get("FLASHTRITON_CALL_PLANS", "1") != "0"
MAX_CALL_PLANS = 512  # signatures past it run the whole forward (nothing else changes)

_forward_plans: dict = {}  # signature -> CallPlan, or _NONE for a signature that has none
call_plan_hits = 0  # forwards that ran from their plan (tests read it)


class _NoPlan(Exception):
    """A recorded launch that a plan cannot repeat."""


class _Slot:
    """The `index`-th tensor of a call (q, k, v, out, lse, rng_state) in a recorded argument."""

    __slots__ = ("index", )

    def __init__(self, index: int):
        self.index = index


class _DescriptorSlot:
    """A host tensor descriptor over the `index`-th tensor of a call: the recorded one with its base replaced (the
    signature fixes its shape and strides)."""

    __slots__ = ("index", "fields")

    def __init__(self, index: int, descriptor):
        self.index = index
        self.fields = dict(descriptor.__dict__)


def _template(value, tensors: tuple):
    """value with the call's tensors replaced by slots; _NoPlan where a tensor is none of them."""
    kind = type(value)
    if kind is torch.Tensor:
        for index, tensor in enumerate(tensors):
            if value is tensor:
                return _Slot(index)
        raise _NoPlan
    if kind is tuple:
        return tuple(_template(item, tensors) for item in value)
    if value is None or kind in (int, float, bool, str):
        return value
    base = getattr(value, "base", None)
    if hasattr(value, "block_shape") and type(base) is torch.Tensor and "base" in getattr(value, "__dict__", ()):
        for index, tensor in enumerate(tensors):
            if base is tensor:
                return _DescriptorSlot(index, value)
    raise _NoPlan


def _has_slot(template) -> bool:
    kind = type(template)
    return kind is _Slot or kind is _DescriptorSlot or (kind is tuple and any(_has_slot(item) for item in template))


def _filled(template, tensors: tuple, descriptor_classes: dict):
    kind = type(template)
    if kind is _Slot:
        return tensors[template.index]
    if kind is _DescriptorSlot:
        descriptor = object.__new__(descriptor_classes[template])
        descriptor.__dict__.update(template.fields, base=tensors[template.index])
        return descriptor
    if kind is tuple:
        return tuple(_filled(item, tensors, descriptor_classes) for item in template)
    return template


class _Launch:
    """One recorded launch: its compiled kernel and grid, the arguments that do not change (`static`, the
    launcher's keyword tail included) and those that hold the call's tensors (`dynamic`: (position, template))."""

    __slots__ = ("compiled", "grid", "static", "dynamic", "descriptor_classes")

    def __init__(self, plan, grid: tuple, args: tuple, kwargs: dict, tensors: tuple):
        self.compiled = plan.compiled
        self.grid = (*grid, 1, 1)[:3]
        templates = [_template(arg, tensors) for arg in args]
        tail = [kwargs.get(name, default) for name, default in zip(plan.tail_names, plan.tail_defaults)]
        if any(_has_slot(_template(value, tensors)) for value in tail):
            raise _NoPlan
        self.static = [None if _has_slot(t) else t for t in templates] + tail
        self.dynamic = tuple((position, t) for position, t in enumerate(templates) if _has_slot(t))
        self.descriptor_classes = {}
        for (position, template), arg in zip(self.dynamic, (args[position] for position, _ in self.dynamic)):
            self._descriptor_classes(template, arg)

    def _descriptor_classes(self, template, arg) -> None:
        if type(template) is _DescriptorSlot:
            self.descriptor_classes[template] = type(arg)
        elif type(template) is tuple:
            for item, value in zip(template, arg):
                self._descriptor_classes(item, value)

    def run(self, tensors: tuple, stream) -> None:
        args = self.static.copy()
        for position, template in self.dynamic:
            args[position] = _filled(template, tensors, self.descriptor_classes)
        compiled = self.compiled
        compiled.run(*self.grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)

    def same_as(self, other: "_Launch") -> bool:
        """Whether other launches the same compiled kernel on the same grid with the same arguments (tensors by
        their slots, descriptors by their fields)."""
        def same(a, b) -> bool:
            if type(a) is not type(b):
                return False
            if type(a) is _Slot:
                return a.index == b.index
            if type(a) is _DescriptorSlot:
                return a.index == b.index and {k: v for k, v in a.fields.items() if k != "base"} == {
                    k: v for k, v in b.fields.items() if k != "base"}
            if type(a) is tuple:
                return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
            return a == b
        return (self.compiled is other.compiled and self.grid == other.grid and len(self.static) == len(other.static)
                and all(same(a, b) for a, b in zip(self.static, other.static))
                and len(self.dynamic) == len(other.dynamic)
                and all(p == q and same(a, b) for (p, a), (q, b) in zip(self.dynamic, other.dynamic)))


class CallPlan:
    """A forward's outputs ((shape, dtype) of out and lse), its launches, and the launch counters it advanced
    ((module, name, delta): the counters tests read to know which kernels ran)."""

    __slots__ = ("outputs", "launches", "counters")

    def __init__(self, outputs: tuple, launches: tuple, counters: tuple):
        self.outputs = outputs
        self.launches = launches
        self.counters = counters

    def run(self, q, k, v, new_empty):
        """(out, lse, S_dmask, rng_state) of the forward of q, k, v, as backend.mha_fwd returns them."""
        (out_shape, out_dtype), (lse_shape, lse_dtype) = self.outputs
        device = q.device
        out = new_empty(out_shape, out_dtype, device)
        lse = new_empty(lse_shape, lse_dtype, device)
        rng_state = torch.zeros(2, dtype=torch.int64, device=device)
        tensors = (q, k, v, out, lse, rng_state)
        stream = _current_stream(device)
        for launch in self.launches:
            launch.run(tensors, stream)
        for module, name, delta in self.counters:
            setattr(module, name, getattr(module, name) + delta)
        return out, lse, torch.empty(0, dtype=q.dtype, device=device), rng_state

    def same_as(self, other: "CallPlan") -> bool:
        return (self.outputs == other.outputs and self.counters == other.counters
                and len(self.launches) == len(other.launches)
                and all(a.same_as(b) for a, b in zip(self.launches, other.launches)))


def _current_stream(device: torch.device):
    from triton.runtime import driver

    return driver.active.get_current_stream(device.index)


def _environment() -> tuple:
    """The replaceable functions and switches the forward's decisions go through (tests replace them; a plan made
    under other ones must not run). The objects themselves, so that a replaced one is never mistaken for another."""
    import triton

    from .. import configs
    from . import backend, checks, hopper

    return (backend.launch_fwd, backend.new_empty, backend.POISON_OUTPUTS, backend.KERNELS_INTERPRETED,
            backend.runs_triton, backend.splits_for, backend.launch, hopper.launch_fwd, hopper.gluon_runs,
            hopper.is_hopper, hopper._multiprocessors, hopper.PROGRAMS_CAP, hopper.launch, configs.GLUON_ALLOWED,
            configs.TMA_ALLOWED, configs.fwd_config, configs.forward_launch_config, launching.PLANS_ALLOWED,
            launching.launch, checks._major_capability, torch.version.cuda, triton.knobs.runtime.debug)


def forward_signature(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                      alibi_slopes, return_softmax, learnable_sink, descales) -> Optional[tuple]:
    """The key of backend.mha_fwd's call plan, or None for a call that never has one."""
    if (not CALL_PLANS_ALLOWED or dropout_p != 0.0 or return_softmax or alibi_slopes is not None
            or learnable_sink is not None or descales != (None, None, None) or type(q) is not torch.Tensor
            or type(k) is not torch.Tensor or type(v) is not torch.Tensor or not q.is_cuda
            or q.device.index != torch.cuda.current_device()):  # the plan launches on the current device
        return None
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            k.device, v.device, q.data_ptr() & 15 == 0, k.data_ptr() & 15 == 0, v.data_ptr() & 15 == 0,
            float(softmax_scale), bool(causal), int(window_size_left), int(window_size_right), float(softcap),
            _environment())


def forward_plan(signature) -> Optional[CallPlan]:
    """The plan to run for a forward signature, or None: none (yet, or possible), or the forward must run whole
    (FLASHTRITON_VERIFY_PLANS=1, or a launch hook or Triton's debug mode: they need Triton's launch path)."""
    plan = _forward_plans.get(signature) if signature is not None else None
    if plan is None or plan is _NONE or launching.VERIFY_PLANS or launching._hooks_present():
        return None
    global call_plan_hits
    call_plan_hits += 1
    return plan


def records_forward(signature) -> bool:
    """Whether the whole forward of this signature should record its launches for a plan (or, verifying, to
    compare with the plan it has)."""
    return signature is not None and (signature not in _forward_plans or launching.VERIFY_PLANS)


# the aten operations a planned forward may do besides its launches: allocations, views, and the NaN fill of
# outputs while tests poison them (backend.new_empty, which the plan calls as well)
_ALLOWED_OPERATIONS = frozenset(("empty.memory_format", "empty_strided.default", "zeros.default", "unsqueeze.default",
                                 "squeeze.dim", "slice.Tensor", "select.int", "as_strided.default", "view.default",
                                 "_unsafe_view.default", "t.default", "transpose.int", "permute.default",
                                 "expand.default", "alias.default", "detach.default"))


class _OperationWatch(TorchDispatchMode):
    """Notes whether any aten operation other than _ALLOWED_OPERATIONS (and fill_ while outputs are poisoned) runs:
    a copy, a reduction or an in-place update that a plan made of launches would not repeat."""

    def __init__(self, poisoned: bool):
        super().__init__()
        self.poisoned = poisoned
        self.other = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__ if "." in func.__name__ else f"{func.__name__}.default"
        if name not in _ALLOWED_OPERATIONS and not (self.poisoned and name.startswith("fill_.")):
            self.other.append(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def recording(poisoned: bool = False):
    """Collect this thread's launching.launch launches (launching._recorder) while the body runs, and whether it did
    other work on tensors (_OperationWatch); yields (launches, watch)."""
    launches: list = []
    watch = _OperationWatch(poisoned)
    previous, launching._recorder = launching._recorder, (threading.get_ident(), launches)
    try:
        with watch:
            yield launches, watch
    finally:
        launching._recorder = previous


def counter_values() -> tuple:
    """The launch counters of ops/hopper.py, whose advance a plan repeats."""
    from . import hopper

    return tuple(getattr(hopper, name) for name in _COUNTERS)


_COUNTERS = ("fwd_launch_count", "tail_merge_count")


def make_plan(launches: list, q, k, v, out, lse, rng_state, counters_before: tuple,
              other_operations: tuple = ()) -> Optional[CallPlan]:
    """The CallPlan of a forward that launched `launches` (launching's records), did `other_operations` (aten
    operations outside _ALLOWED_OPERATIONS) and returned out, lse and rng_state, or None where a plan cannot repeat
    it."""
    from . import hopper

    if other_operations or not launches or any(record is None or record[0] is None for record in launches):
        return None
    tensors = (q, k, v, out, lse, rng_state)
    try:
        planned = tuple(_Launch(plan, grid, args, kwargs, tensors) for plan, grid, args, kwargs in launches)
    except _NoPlan:
        return None
    counters = tuple((hopper, name, after - before) for name, before, after in
                     zip(_COUNTERS, counters_before, counter_values()) if after != before)
    return CallPlan(((tuple(out.shape), out.dtype), (tuple(lse.shape), lse.dtype)), planned, counters)


def keep_forward_plan(signature, plan: Optional[CallPlan]) -> None:
    """Keep the plan of a signature (None too: the signature has none). With FLASHTRITON_VERIFY_PLANS=1 a
    signature that has a plan already must have got the same one again."""
    if signature is None:
        return
    kept = _forward_plans.get(signature)
    if kept is None:
        if len(_forward_plans) < MAX_CALL_PLANS:
            _forward_plans[signature] = _NONE if plan is None else plan
    elif kept is not _NONE and (plan is None or not plan.same_as(kept)):
        raise RuntimeError("the call plan of a forward differs from what the whole forward launched: "
                           f"{len(kept.launches)} planned launches")


_NONE = object()  # kept for a signature whose forward a plan cannot repeat

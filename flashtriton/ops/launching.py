"""Small helpers every launcher uses: the device guard, ceiling division, ALiBi's batch stride, the tensor-descriptor
test, host descriptors built without re-validation, kernels compiled without line info, Triton's compiler key
computed ahead, and launch plans (a repeated launch without Triton's binder)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import types
from typing import Optional

import torch

_NO_GUARD = contextlib.nullcontext()


def device_guard(tensor: torch.Tensor):
    """Run launches on the tensor's CUDA device whatever the current device is; nothing for CPU tensors or when it
    is the current device already (the usual case: switching costs two device exchanges per launch)."""
    if not tensor.is_cuda or tensor.device.index == torch.cuda.current_device():
        return _NO_GUARD
    return torch.cuda.device(tensor.device)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def alibi_batch_stride(alibi_slopes) -> int:
    """The batch stride of ALiBi slopes: (batch, heads) slopes' first stride, 0 for (heads,) slopes or none."""
    return alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0


def tma_compatible(tensor: torch.Tensor) -> bool:
    """A tensor TMA descriptors can address: 16-byte aligned base and strides, contiguous last dim.

    Every row and head of it then starts 16-byte aligned too, as in-kernel descriptors need.
    """
    *outer, last = tensor.stride()
    elements_per_16_bytes = 16 // tensor.element_size()
    return last == 1 and tensor.data_ptr() % 16 == 0 and not any(s % elements_per_16_bytes for s in outer)


def descriptor_builder(descriptor_class):
    """A function (base, shape, strides, block_shape, layout) -> descriptor_class instance that skips the class's
    __post_init__ checks (alignment, strides, block shape: ~3 us per descriptor, seven per backward launch) for
    callers that checked their tensors with tma_compatible. The first call builds through the constructor and
    compares: where the class is not the plain dataclass of these fields, or its __post_init__ sets or changes
    anything (another Triton version), every call keeps using the constructor, so nothing is built wrong."""
    fields = [field.name for field in dataclasses.fields(descriptor_class)] if dataclasses.is_dataclass(
        descriptor_class) else []
    defaults = {field.name: field.default for field in dataclasses.fields(descriptor_class)
                if field.default is not dataclasses.MISSING} if fields else {}
    if fields[:5] != ["base", "shape", "strides", "block_shape", "layout"] or set(fields[5:]) - set(defaults) or \
            hasattr(descriptor_class, "__slots__"):
        return descriptor_class

    def unchecked(base, shape, strides, block_shape, layout):
        descriptor = object.__new__(descriptor_class)
        descriptor.__dict__.update(defaults, base=base, shape=shape, strides=strides, block_shape=block_shape,
                                   layout=layout)
        return descriptor

    fast = []  # [bool] once the first call compared the two ways

    def build(base, shape, strides, block_shape, layout):
        if fast == [True]:
            return unchecked(base, shape, strides, block_shape, layout)
        validated = descriptor_class(base, shape, strides, block_shape, layout)
        if not fast:
            fast.append(_same_attributes(validated, unchecked(base, list(shape), list(strides), list(block_shape),
                                                              layout)))
        return validated

    return build


def _same_attributes(a, b) -> bool:
    """Both objects hold the same attributes: tensors by identity, everything else by equality."""
    first, second = vars(a), vars(b)
    return first.keys() == second.keys() and all(
        x is y or (not torch.is_tensor(x) and not torch.is_tensor(y) and x == y)
        for x, y in ((first[key], second[key]) for key in first))


LINE_INFO_VARIABLE = "TRITON_DISABLE_LINE_INFO"


def compiled_without_line_info(*kernels) -> None:
    """Make each Triton / Gluon kernel compile without source-line debug info (Triton's TRITON_DISABLE_LINE_INFO),
    for its own compiles only: the other kernels of the process keep Triton's default. Line info is for profilers'
    source views; without it LLVM, PTX generation and ptxas have less to carry (the d128 Gluon forward compiled
    offline: 2.5 against 3.1 s, the cubin 77 against 293 KB; BENCHMARKS.md's cold-start section has the GPU
    reading). Setting TRITON_DISABLE_LINE_INFO yourself (0 for ncu's source view) keeps your choice. The setting is
    part of Triton's cache key, so cached kernels stay consistent.

    Wraps the kernel object's compile step (JITFunction._do_compile, run only where the in-memory cache misses), so
    launches pay nothing; kernels without one (the interpreter's) are left as they are, and so is a Triton whose
    JITFunction lacks it (its compiles then keep line info: slower, same code)."""
    from triton import knobs

    for kernel in kernels:
        compile_step = getattr(kernel, "_do_compile", None)
        if compile_step is None or getattr(compile_step, "without_line_info", False):
            continue

        @functools.wraps(compile_step)
        def compile_without(*args, _compile_step=compile_step, **kwargs):
            if LINE_INFO_VARIABLE in os.environ:
                return _compile_step(*args, **kwargs)
            with knobs.compilation.scope():
                knobs.compilation.disable_line_info = True
                return _compile_step(*args, **kwargs)

        compile_without.without_line_info = True
        kernel._do_compile = compile_without


def compiler_key_computed():
    """Whether this process holds Triton's compiler key already (triton.runtime.cache.triton_key, cached by
    functools.lru_cache); None for a Triton that does not cache it."""
    from triton.runtime.cache import triton_key

    return triton_key.cache_info().currsize > 0 if hasattr(triton_key, "cache_info") else None


def compiler_key_ahead(kernels_interpreted: bool):
    """Start Triton's per-process compiler key on a daemon thread; returns the thread, or None where none starts.

    Triton's first compile in a process computes triton.runtime.cache.triton_key(): the sha256 of Triton's own
    sources and of its ~400 MB libtriton (0.35-0.45 s), kept by functools.lru_cache for the rest of the process.
    Started at import, it runs while the process does what comes before its first attention call (CUDA context,
    building the model), so the first compile finds it done. hashlib and file reads release the GIL, and the key is
    the same whichever thread computes it; if the first compile comes first, Triton computes it there too (no wait,
    no harm).

    Only where compiles can happen: a CUDA build of torch, kernels not interpreted (as the kernel objects say:
    backend.KERNELS_INTERPRETED), a Triton whose triton_key is cached and not computed yet (else there is nothing
    to keep). Errors in the thread are dropped: the compile that needs the key computes it again and reports them."""
    if kernels_interpreted or torch.version.cuda is None:
        return None
    if compiler_key_computed() is not False:
        return None
    from triton.runtime.cache import triton_key

    def compute_quietly():
        try:
            triton_key()
        except Exception:  # noqa: BLE001 - the compile that needs the key reports what went wrong
            pass

    thread = threading.Thread(target=compute_quietly, name="flashtriton-triton-key", daemon=True)
    thread.start()
    return thread


# ----------------------------------------------------------------------------------------------------------------
# Launch plans: a repeated launch skips Triton's binder
# ----------------------------------------------------------------------------------------------------------------

_I32_MIN, _I32_MAX, _U64_FROM = -(2 ** 31), 2 ** 31 - 1, 2 ** 63
PLANS_PER_KERNEL = 1024  # past it, new argument kinds launch through Triton's binder (nothing else changes)
PLANS_ALLOWED = os.environ.get("FLASHTRITON_LAUNCH_PLANS", "1") != "0"
# FLASHTRITON_VERIFY_PLANS=1: every planned launch also goes through Triton's binder, which must pick the planned
# compiled kernel (the GPU tests run so; a mismatch raises instead of launching)
VERIFY_PLANS = os.environ.get("FLASHTRITON_VERIFY_PLANS", "0") == "1"


def argument_kinds(args: tuple):
    """What of each kernel argument Triton's specialization reads (triton.runtime.jit's binder: native_specialize_impl),
    as hashable values at least as fine as Triton's: two arguments of one kind always specialize alike (tests/
    test_launch_plans.py checks this against Triton's own function). Integers: 1 (Triton makes it a constant),
    divisibility by 16 and the i32 / i64 / u64 range; tensors: dtype and 16-byte alignment; host tensor descriptors:
    dtype, block shape, layout and alignment; floats and bools: their type; tuples: their items' kinds; None:
    "none". A tuple of kinds, or None where an argument has none (then `launch` takes Triton's binder). One loop
    without a call per argument: it runs on every launch."""
    kinds = []
    append = kinds.append
    for arg in args:
        kind = type(arg)
        if kind is int:
            append(1 if arg == 1 else
                   8 + (arg & 15 == 0) + 2 * (_I32_MIN <= arg <= _I32_MAX) + 4 * (arg >= _U64_FROM))
        elif kind is torch.Tensor:
            append((arg.dtype, arg.data_ptr() & 15 == 0))
        elif arg is None:
            append("none")
        elif kind is float:
            append(float)
        elif kind is tuple:
            items = argument_kinds(arg)
            if items is None:
                return None
            append(items)
        elif kind is bool:
            append(bool)
        elif hasattr(arg, "block_shape") and type(getattr(arg, "base", None)) is torch.Tensor:
            base = arg.base
            append((kind, base.dtype, tuple(arg.block_shape), getattr(arg, "layout", None), base.data_ptr() & 15 == 0))
        else:
            return None
    return tuple(kinds)


def argument_kind(arg):
    """argument_kinds of one argument (None: it has none)."""
    kinds = argument_kinds((arg, ))
    return None if kinds is None else kinds[0]


DIRECT_ALLOWED = os.environ.get("FLASHTRITON_DIRECT_LAUNCHES", "1") != "0"
MAPS_PER_DESCRIPTOR = 8  # encoded TMA maps a direct launch keeps per descriptor argument (by base address)
direct_launches = 0  # planned launches that called the C launcher directly (tests read it)


class DirectLauncher:
    """A compiled kernel's C launcher called without Triton's Python wrapper around it (triton.backends.nvidia.driver:
    CudaLauncher.__call__, which allocates scratch, and wrap_handle_tensordesc's `inner`, which walks every argument
    and encodes a TMA map per host descriptor on every launch). It passes what that wrapper passes: the 13 leading
    values (grid, stream, function, cooperative and PDL flags, no scratch, the kernel's packed metadata, no launch
    metadata or hooks), then the arguments with each host descriptor expanded into (its encoded map, shape, strides).
    Encoded maps are kept per descriptor argument by base address, shape, strides and padding (a map encodes only
    those and the kernel's fixed block and swizzle), MAPS_PER_DESCRIPTOR each, so a repeated call encodes none."""

    __slots__ = ("c_launch", "cooperative", "pdl", "descriptors", "maps")

    def __init__(self, c_launch, cooperative, pdl, descriptors):
        self.c_launch = c_launch
        self.cooperative = cooperative
        self.pdl = pdl
        self.descriptors = descriptors  # ((argument index, its tensordesc metadata), ...) by index
        self.maps = tuple({} for _ in descriptors)

    def __call__(self, grid_x, grid_y, grid_z, stream, compiled, args):
        global direct_launches
        direct_launches += 1
        final = [grid_x, grid_y, grid_z, stream, compiled.function, self.cooperative, self.pdl, None, None,
                 compiled.packed_metadata, None, None, None]
        done = 0
        for (index, meta), maps in zip(self.descriptors, self.maps):
            final.extend(args[done:index])
            final.extend(self._encoded(args[index], meta, maps))
            done = index + 1
        final.extend(args[done:])
        self.c_launch(*final)

    @staticmethod
    def _encoded(descriptor, meta, maps):
        key = (descriptor.base.data_ptr(), tuple(descriptor.shape), tuple(descriptor.strides), descriptor.padding)
        encoded = maps.get(key)
        if encoded is None:
            from triton.backends.nvidia.driver import make_tensordesc_arg

            if len(maps) >= MAPS_PER_DESCRIPTOR:
                maps.clear()
            encoded = maps[key] = make_tensordesc_arg(descriptor, meta)
        return encoded


_WRAPPER_CELLS = ("launcher", "tensordesc_indices", "tensordesc_meta")
_C_FUNCTIONS = (types.BuiltinFunctionType, )  # what a C launcher is (tests add a recording Python function)


def c_launcher(compiled) -> Optional[DirectLauncher]:
    """A DirectLauncher for `compiled` where its `run` is the CudaLauncher this code knows (Triton 3.6's: no global or
    profile scratch to allocate, its `launch` the C function or wrap_handle_tensordesc's closure over it with one
    metadata entry per host descriptor), else None (the launch goes through `run`)."""
    run = getattr(compiled, "run", None)
    if not DIRECT_ALLOWED or type(run).__name__ != "CudaLauncher" or \
            type(run).__module__ != "triton.backends.nvidia.driver" or \
            getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    launch = run.launch
    code, closure = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
    if code is not None and code.co_name == "inner" and closure is not None and \
            tuple(sorted(code.co_freevars)) == tuple(sorted(_WRAPPER_CELLS)):
        cells = {name: cell.cell_contents for name, cell in zip(code.co_freevars, closure)}
        indices, metas = sorted(cells["tensordesc_indices"]), list(cells["tensordesc_meta"])
        if len(indices) != len(metas) or any(meta is None for meta in metas) or \
                not isinstance(cells["launcher"], _C_FUNCTIONS):
            return None
        return DirectLauncher(cells["launcher"], run.launch_cooperative_grid, run.launch_pdl,
                              tuple(zip(indices, metas)))
    if isinstance(launch, _C_FUNCTIONS):
        return DirectLauncher(launch, run.launch_cooperative_grid, run.launch_pdl, ())
    return None


class _Plan:
    """A compiled kernel, how a call's keyword arguments extend its positional ones into the launcher's, and its C
    launcher where it can be called directly (c_launcher)."""

    __slots__ = ("compiled", "tail_names", "tail_defaults", "direct")

    def __init__(self, compiled, tail_names, tail_defaults):
        self.compiled = compiled
        self.tail_names = tail_names
        self.tail_defaults = tail_defaults
        self.direct = c_launcher(compiled)


_plans: dict = {}  # JITFunction -> {launch key: _Plan}
plan_hits = 0  # launches that found their plan (tests read it; verified ones went through the binder as well)
# while ops/call_plans.py records a call: (the recording thread, [each of its launches' (_Plan or None, grid, args,
# kwargs), None for one through Triton's way only (no compiled kernel known)])
_recorder: Optional[tuple] = None


def _record(entry) -> None:
    if _recorder[0] == threading.get_ident():
        _recorder[1].append(entry)


def _plannable(kernel) -> bool:
    return PLANS_ALLOWED and hasattr(kernel, "device_caches") and hasattr(kernel, "arg_names")


def _hooks_present() -> bool:
    from triton import knobs

    runtime = knobs.runtime
    hooks = (runtime.launch_enter_hook, runtime.launch_exit_hook)
    return (any(getattr(hook, "calls", hook is not None) for hook in hooks) or runtime.debug
            or bool(knobs.compilation.instrumentation_mode))


def launch(kernel, grid, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), where a launch of the same kernel with arguments of the same kinds
    (`argument_kinds`, the current device, the same keyword arguments) ran before: then the compiled kernel Triton
    picked that time is launched directly, without Triton's binder, cache key and option parsing (most of a Gluon
    launch's host time). Kernels that are not Triton JIT functions (the interpreter's), a launch hook or debug mode
    (profilers), a grid given as a function, arguments without a kind, constexprs given by position, unhashable
    keyword arguments, or FLASHTRITON_LAUNCH_PLANS=0 take Triton's way every time."""
    if not _plannable(kernel) or type(grid) is not tuple:  # a grid function needs Triton's bound arguments
        kernel[grid](*args, **kwargs)
        if _recorder is not None:
            _record(None)
        return
    device = torch.cuda.current_device()
    kinds = argument_kinds(args)
    key = None if kinds is None else (device, kinds, tuple(kwargs.items()))
    plans = _plans.setdefault(kernel, {})
    try:
        plan = plans.get(key) if key is not None else None
    except TypeError:  # an unhashable keyword argument: Triton's binder decides
        plan = key = None
    global plan_hits
    plan_hits += plan is not None
    if plan is None or VERIFY_PLANS or _hooks_present():
        compiled = kernel[grid](*args, **kwargs)
        if plan is not None and compiled is not plan.compiled:
            raise RuntimeError(f"launch plan of {kernel.__name__} names another compiled kernel than Triton's binder: "
                               f"argument kinds {kinds}")
        # a constexpr given by position specializes on its value, which its kind does not hold: no plan then
        if (plan is None and key is not None and len(plans) < PLANS_PER_KERNEL and not _hooks_present()
                and not any(param.is_constexpr for param in kernel.params[:len(args)])):
            names = kernel.arg_names[len(args):]
            defaults = {param.name: param.default for param in kernel.params}
            plans[key] = _Plan(compiled, names, tuple(defaults[name] for name in names))
        if _recorder is not None:
            kept = plans.get(key) if key is not None else None
            _record((kept if kept is not None and kept.compiled is compiled else None, grid, args, kwargs))
        return
    if _recorder is not None:
        _record((plan, grid, args, kwargs))
    compiled = plan.compiled
    tail = tuple(kwargs.get(name, default) for name, default in zip(plan.tail_names, plan.tail_defaults))
    from triton.runtime import driver

    stream = driver.active.get_current_stream(device)
    run_compiled(compiled, plan.direct, *(*grid, 1, 1)[:3], stream, args + tail)


def run_compiled(compiled, direct: Optional[DirectLauncher], grid_x: int, grid_y: int, grid_z: int, stream,
                 args) -> None:
    """Launch `compiled` with the launcher's positional arguments `args` (keyword tail included): through its C
    launcher where it has one (`direct`, c_launcher's), else through its `run`, as Triton's binder does."""
    if direct is not None:
        direct(grid_x, grid_y, grid_z, stream, compiled, args)
        return
    compiled.run(grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)

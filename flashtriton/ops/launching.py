"""Small helpers every launcher uses: the device guard, ceiling division, the tensor-descriptor test, host
descriptors built without re-validation, kernels compiled without line info, Triton's compiler key computed ahead."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading

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

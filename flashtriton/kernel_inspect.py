"""`flashtriton inspect`: what Triton compiled for one configuration, read from the compiled kernels.

Runs the forward and backward once on CUDA, then for every flashtriton kernel compiled in this process reports
registers, spills, shared memory, warps and stages (CompiledKernel.n_regs / n_spills / metadata), and counts
instructions in its PTX (kernel.asm["ptx"]) and SASS (cuobjdump or nvdisasm on the cubin). Gate: on sm_90 the
forward kernel must use wgmma (HGMMA) and must not spill.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

PTX_PATTERNS = {"wgmma": r"\bwgmma\.mma_async", "mma.sync": r"\bmma\.sync", "ex2": r"\bex2\.approx",
                "ld.local": r"\bld\.local", "st.local": r"\bst\.local"}
SASS_PATTERNS = {"HGMMA": r"\bHGMMA\.", "HMMA": r"\bHMMA\.", "MUFU.EX2": r"\bMUFU\.EX2\b", "LDL": r"\bLDL\b",
                 "STL": r"\bSTL\b"}


@dataclass
class KernelReport:
    name: str
    n_regs: Optional[int]
    n_spills: Optional[int]
    shared_bytes: Optional[int]
    num_warps: Optional[int]
    num_stages: Optional[int]
    ptx_counts: dict = field(default_factory=dict)
    sass_counts: dict = field(default_factory=dict)     # empty when no disassembler was found

    @property
    def is_forward(self) -> bool:
        return self.name.startswith("attn_fwd")


def flashtriton_kernels() -> dict:
    """name -> kernel object of every `*_kernel` entry point in the flashtriton.kernels modules."""
    from . import kernels

    found = {}
    for module_info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{module_info.name}")
        for name, value in vars(module).items():
            if name.endswith("_kernel") and hasattr(value, "run"):
                found[name] = value
    return found


def compiled_kernels(kernel) -> list:
    """The CompiledKernel objects a kernel holds for every device (Triton 3.x JITFunction.device_caches).

    Autotuner and heuristics wrappers are unwrapped through their `.fn`.
    """
    while not hasattr(kernel, "device_caches") and hasattr(kernel, "fn"):
        kernel = kernel.fn
    caches = getattr(kernel, "device_caches", {})
    return [compiled for cache in caches.values() for compiled in cache[0].values()]


def count_patterns(text: str, patterns: dict) -> dict:
    return {name: len(re.findall(pattern, text)) for name, pattern in patterns.items()}


def bundled_tool(name: str) -> Path:
    """Where Triton keeps its own copy of a CUDA binary tool (ptxas, nvdisasm, cuobjdump)."""
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def find_tool(name: str) -> Optional[str]:
    """A CUDA binary tool on PATH, else the one bundled with Triton."""
    found = shutil.which(name)
    if found:
        return found
    bundled = bundled_tool(name)
    return str(bundled) if bundled.is_file() else None


def disassemble(cubin: bytes) -> Optional[str]:
    """SASS text of a cubin via cuobjdump -sass (or nvdisasm); None when neither tool works."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        for tool, args in (("cuobjdump", ["-sass"]), ("nvdisasm", [])):
            path = find_tool(tool)
            if path is None:
                continue
            done = subprocess.run([path, *args, handle.name], capture_output=True, text=True)
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout
    return None


def kernel_report(kernel) -> KernelReport:
    meta = kernel.metadata
    report = KernelReport(kernel.name, getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None),
                          getattr(meta, "shared", None), getattr(meta, "num_warps", None),
                          getattr(meta, "num_stages", None))
    ptx = kernel.asm.get("ptx")
    if ptx:
        report.ptx_counts = count_patterns(ptx, PTX_PATTERNS)
    cubin = kernel.asm.get("cubin")
    sass = disassemble(cubin) if cubin else None
    if sass:
        report.sass_counts = count_patterns(sass, SASS_PATTERNS)
    return report


def run_config(head_dim: int, causal: bool, dtype: torch.dtype, seqlen: int, batch: int = 2, heads: int = 8) -> None:
    """One forward and backward on the current CUDA device, so their kernels get compiled."""
    from .interface import flash_attn_func

    shape = (batch, seqlen, heads, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=causal)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()


def inspect_compiled() -> list[KernelReport]:
    return [kernel_report(kernel) for jit_function in flashtriton_kernels().values()
            for kernel in compiled_kernels(jit_function)]


def gate_failures(reports: list[KernelReport], capability: tuple) -> list[str]:
    """On sm_90: the forward must contain wgmma/HGMMA and must not spill (n_spills, else SASS STL count)."""
    if capability[0] != 9:
        return []
    failures = []
    for report in (r for r in reports if r.is_forward):
        uses_wgmma = report.sass_counts.get("HGMMA", 0) > 0 or report.ptx_counts.get("wgmma", 0) > 0
        if not uses_wgmma:
            failures.append(f"{report.name}: no wgmma/HGMMA on sm_90")
        spills = report.n_spills if report.n_spills is not None else report.sass_counts.get("STL", 0)
        if spills:
            failures.append(f"{report.name}: {spills} register spills")
    if not any(r.is_forward for r in reports):
        failures.append("no compiled forward kernel found")
    return failures


def reports_table(reports: list[KernelReport]) -> str:
    from .bench import markdown_table

    def value(x):
        return "-" if x is None else str(x)

    headers = ["kernel", "regs", "spills", "shared B", "warps", "stages", "PTX wgmma", "SASS HGMMA", "SASS HMMA",
               "MUFU.EX2", "LDL", "STL"]
    rows = [[r.name, value(r.n_regs), value(r.n_spills), value(r.shared_bytes), value(r.num_warps),
             value(r.num_stages), value(r.ptx_counts.get("wgmma")), value(r.sass_counts.get("HGMMA")),
             value(r.sass_counts.get("HMMA")), value(r.sass_counts.get("MUFU.EX2")), value(r.sass_counts.get("LDL")),
             value(r.sass_counts.get("STL"))] for r in reports]
    return markdown_table(headers, rows, [False] + [True] * (len(headers) - 1))

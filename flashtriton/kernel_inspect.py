"""`flashtriton inspect`: what Triton compiled for one configuration, read from the compiled kernels.

Runs the forward and backward once on CUDA, then for every flashtriton kernel compiled in this process reports
registers, spills, shared memory, warps and stages (CompiledKernel.n_regs / n_spills / metadata), and counts
instructions in its PTX (kernel.asm["ptx"]) and SASS (cuobjdump or nvdisasm on the cubin). Gate: on sm_90 the
forward kernels must use wgmma (HGMMA) and must not touch local memory (spills) inside their key-block loops, the
innermost loops that issue HGMMA (hot_loop_local_accesses). Spills elsewhere are reported, not gated: the Gluon
forward keeps a few scalars of its warp-specialized partitions in local memory, reloaded once per tile (offline,
16-24 bytes at d64, d128 causal and d256).
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
    hot_loop_local: Optional[int] = None  # LDL / STL in the innermost HGMMA loops; None: no SASS or no such loop

    @property
    def is_forward(self) -> bool:
        return self.name.startswith("attn_fwd")


def flashtriton_kernels() -> dict:
    """name -> kernel object of every `*_kernel` entry point in the flashtriton.kernels modules (kernels/hopper/
    too)."""
    from . import kernels

    found = {}
    for module_info in pkgutil.walk_packages(kernels.__path__, f"{kernels.__name__}."):
        module = importlib.import_module(module_info.name)
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


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\s+(?:`\((\.L_x_\d+)\)|(0x[0-9a-f]+))")


def parse_sass(sass: str) -> tuple:
    """(instructions, labels) of SASS text (cuobjdump's or nvdisasm's): (address, text) of each instruction in
    order, its text without the address and the trailing `;` (e.g. "@P3 BRA `(.L_x_15)"), and the address of
    each of nvdisasm's branch labels (.L_x_N)."""
    instructions, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        found = _INSTRUCTION.search(line)
        if found:
            address = int(found.group(1), 16)
            labels.update((name, address) for name in pending)
            pending = []
            instructions.append((address, found.group(2)))
    return instructions, labels


def hot_loops(sass: str) -> Optional[list]:
    """The instruction texts of each innermost loop that issues HGMMA (a forward's key-block loops), from SASS text
    (cuobjdump's absolute branch targets or nvdisasm's labels); None when it has no such loop. A loop is a backward
    branch and what lies between its target and it; branches after the function's last HGMMA are left out (the
    out-of-line retry paths of barrier waits, which jump back into the loops), and a loop holding another HGMMA loop
    is not innermost."""
    instructions, labels = parse_sass(sass)
    hgmma = [address for address, text in instructions if "HGMMA" in text]
    if not hgmma:
        return None
    loops = []
    for address, text in instructions:
        branch = _BRANCH.search(text)
        if branch and address < hgmma[-1]:
            target = labels.get(branch.group(1)) if branch.group(1) else int(branch.group(2), 16)
            if target is not None and target < address and any(target <= h <= address for h in hgmma):
                loops.append((target, address))
    innermost = [(low, high) for low, high in loops
                 if not any((low, high) != (a, b) and low <= a and b <= high for a, b in loops)]
    return [[text for address, text in instructions if low <= address <= high] for low, high in innermost] or None


def hot_loop_local_accesses(sass: str) -> Optional[int]:
    """LDL / STL instructions inside the innermost loops that issue HGMMA (hot_loops); None when there is none."""
    loops = hot_loops(sass)
    if loops is None:
        return None
    local = [re.compile(SASS_PATTERNS[name]) for name in ("LDL", "STL")]
    return sum(1 for loop in loops for text in loop if any(pattern.search(text) for pattern in local))


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
        report.hot_loop_local = hot_loop_local_accesses(sass)
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
    """On sm_90: a forward must contain wgmma/HGMMA and must not touch local memory in its key-block loops (SASS:
    hot_loop_local); without SASS (or without such a loop) it must not spill at all (n_spills, else SASS STL)."""
    if capability[0] != 9:
        return []
    failures = []
    for report in (r for r in reports if r.is_forward):
        uses_wgmma = report.sass_counts.get("HGMMA", 0) > 0 or report.ptx_counts.get("wgmma", 0) > 0
        if not uses_wgmma:
            failures.append(f"{report.name}: no wgmma/HGMMA on sm_90")
        if report.hot_loop_local is not None:
            if report.hot_loop_local:
                failures.append(f"{report.name}: {report.hot_loop_local} local-memory accesses (spills) in its "
                                "key-block loop")
            continue
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
               "MUFU.EX2", "LDL", "STL", "loop LDL/STL"]
    rows = [[r.name, value(r.n_regs), value(r.n_spills), value(r.shared_bytes), value(r.num_warps),
             value(r.num_stages), value(r.ptx_counts.get("wgmma")), value(r.sass_counts.get("HGMMA")),
             value(r.sass_counts.get("HMMA")), value(r.sass_counts.get("MUFU.EX2")), value(r.sass_counts.get("LDL")),
             value(r.sass_counts.get("STL")), value(r.hot_loop_local)] for r in reports]
    return markdown_table(headers, rows, [False] + [True] * (len(headers) - 1))

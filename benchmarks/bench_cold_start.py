"""Cold start (GPU): first-call compile time per configuration, and no recompiles on new batch / seqlen.

    python benchmarks/bench_cold_start.py --out DIR [--quick] [--configs NAME,NAME] [--list]

The targets: the first call of a new configuration compiles in <= 2 s median on an H200, and changing only
batch or sequence length never recompiles. Every configuration runs in two fresh child processes
(`python benchmarks/bench_cold_start.py --child SPEC_JSON`, one JSON result line on stdout) sharing a new, empty
TRITON_CACHE_DIR (tempfile.mkdtemp, deleted afterwards unless --keep-cache):

  cold child   import torch, import flashtriton (triton), CUDA context, Triton's driver (timed separately; with an
               empty cache the driver builds its C helper module once, which a real cache keeps per machine), then
               (a) the first call: compiles every kernel of the configuration (torch.cuda.synchronize after),
               (b) the second call with the same inputs (warm),
               (c) the first call after changing only batch and sequence length (other random inputs): the
                   compiled-kernel count (entries of every flashtriton @triton.jit kernel's `device_caches`, as
                   tests/test_varlen.py counts them) must not grow, nor the kernels on disk in the cache dir;
               (e) dense configurations: the first call of the same configuration at another head dim
                   (OTHER_HEAD_DIM), so the compile time of a new configuration without the process's one-time
                   work (Triton's own cache key, driver, imports);
  warm child   the same up to (d): the first call with the on-disk cache the cold child filled (what
               `flashtriton warmup` buys): no compiler, only cache loads.

A configuration with a backward gives two rows: fwd (the forward call) and fwd+bwd (forward then backward,
timed separately and summed). `host stubs` is the part of (a) spent building Triton's C launchers (gcc) and is
included in (a). Summary: the median of (a) over the forward rows, against the 2 s target.

Writes DIR/cold_start.json (metadata + rows + raw child results) and DIR/cold_start.md after every
configuration, and prints the Markdown. Exit status: 0 every child ran; 1 some child failed (results still
written); 2 no CUDA GPU. `--device cpu` runs the same plumbing on CPU with TRITON_INTERPRET=1 and tiny shapes
(no compilation happens there, so its numbers mean nothing; compile counts are n/a).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("flashtriton") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

EXIT_OK, EXIT_CHILD_FAILED, EXIT_CANNOT_RUN = 0, 1, 2
TARGET_S = 2.0  # the target median first-call (compile) time of a new configuration
RESULT_MARKER = "@@cold_start_result@@ "
HEAD_DIMS = (64, 128, 256)


# ----------------------------------------------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------------------------------------------

# (e): the head dim of the configuration compiled next in the same process (kernels not compiled yet there): another
# head dim of the Gluon Hopper forward (configs.HOPPER_FWD)
OTHER_HEAD_DIM = {64: 128, 128: 256, 256: 64}


def dense_config(head_dim: int, causal: bool, dtype: str, backward: bool) -> dict:
    name = f"d{head_dim}-{'causal' if causal else 'full'}-{dtype}{'-bwd' if backward else ''}"
    heads = max(1, 1024 // head_dim)
    return {"name": name, "kind": "dense", "head_dim": head_dim, "causal": causal, "dtype": dtype,
            "backward": backward, "heads": heads,
            # (a)/(b) shape, then (c): only batch and sequence length change (777: not a multiple of 16).
            "shape": {"batch": 2, "seqlen": 512}, "shape2": {"batch": 3, "seqlen": 777},
            "other": {"head_dim": OTHER_HEAD_DIM[head_dim]}}


def varlen_config() -> dict:
    return {"name": "varlen-d128-causal-bf16-bwd", "kind": "varlen", "head_dim": 128, "causal": True,
            "dtype": "bf16", "backward": True, "heads": 8,
            "shape": {"lengths": [300, 512, 77]}, "shape2": {"lengths": [1000, 5, 260, 901, 33]}}


def kvcache_config() -> dict:
    """One decode step: 1 query token, GQA 32/8, appending one token to a contiguous cache."""
    return {"name": "kvcache-decode-d128-bf16", "kind": "kvcache", "head_dim": 128, "causal": True,
            "dtype": "bf16", "backward": False, "heads": 32, "heads_k": 8,
            "shape": {"batch": 8, "capacity": 4096}, "shape2": {"batch": 3, "capacity": 6000}}


def all_configs() -> list:
    """Dense bf16 (forward + backward) first, then decode and varlen, then dense fp16 (forward only)."""
    configs = [dense_config(d, c, "bf16", True) for d in HEAD_DIMS for c in (False, True)]
    configs += [kvcache_config(), varlen_config()]
    configs += [dense_config(d, c, "fp16", False) for d in HEAD_DIMS for c in (False, True)]
    return configs


QUICK = ("d128-full-bf16-bwd", "d64-causal-fp16", "kvcache-decode-d128-bf16", "varlen-d128-causal-bf16-bwd")


def select_configs(names, quick: bool) -> list:
    configs = {c["name"]: c for c in all_configs()}
    if names:
        unknown = [n for n in names if n not in configs]
        if unknown:
            raise SystemExit(f"unknown configurations {unknown}; --list shows them")
        return [configs[n] for n in names]
    return [configs[n] for n in QUICK] if quick else list(configs.values())


def cpu_shapes(spec: dict) -> dict:
    """Tiny shapes for the interpreter plumbing check."""
    spec = dict(spec)
    if spec["kind"] == "dense":
        spec.update(heads=2, shape={"batch": 1, "seqlen": 32}, shape2={"batch": 2, "seqlen": 47})
    elif spec["kind"] == "varlen":
        spec.update(heads=2, shape={"lengths": [20, 12]}, shape2={"lengths": [33, 5, 17]})
    else:
        spec.update(heads=4, heads_k=2, shape={"batch": 2, "capacity": 64}, shape2={"batch": 3, "capacity": 80})
    return spec


# ----------------------------------------------------------------------------------------------------------------
# Child process: everything below until the parent section runs in a fresh interpreter.
# ----------------------------------------------------------------------------------------------------------------

class Child:
    def __init__(self, spec: dict):
        self.spec = spec
        self.result = {"name": spec["name"], "phase": spec["phase"], "status": "ok"}
        self.stub_build_s = None  # seconds in Triton's gcc builds; None until wrap_stub_builds instruments them

    def clock(self, key: str, fn):
        """Run fn, synchronize, record seconds under key; returns fn's value."""
        self.sync()
        start = time.perf_counter()
        value = fn()
        self.sync()
        self.result[key] = time.perf_counter() - start
        return value

    def sync(self):
        torch = sys.modules.get("torch")
        if torch is not None and self.spec["device"] == "cuda" and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    # -- instrumentation -----------------------------------------------------------------------------------------

    def wrap_stub_builds(self):
        """Accumulate the time Triton spends building C modules (driver helpers, kernel launchers) with gcc."""
        try:
            import triton.backends.nvidia.driver as nvidia_driver
        except ImportError:
            return
        original = getattr(nvidia_driver, "compile_module_from_src", None)
        if original is None:
            return

        self.stub_build_s = 0.0

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.stub_build_s += time.perf_counter() - start

        nvidia_driver.compile_module_from_src = timed

    @staticmethod
    def compiled_counts():
        """{kernel: compiled specializations} over flashtriton's @triton.jit kernels; None when interpreted."""
        counts, seen = {}, set()
        for module_name, module in list(sys.modules.items()):
            if not module_name.startswith("flashtriton") or module is None:
                continue
            for attr, value in list(vars(module).items()):
                caches = getattr(value, "device_caches", None)
                if caches is None or id(value) in seen or not isinstance(caches, dict):
                    continue
                seen.add(id(value))
                name = f"{getattr(value, '__module__', module_name)}.{getattr(value, '__name__', attr)}"
                counts[name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]] = sum(
                    len(cache[0]) for cache in caches.values())
        return counts if seen else None

    @staticmethod
    def cache_contents():
        """(entries, kernel binaries) in TRITON_CACHE_DIR: top-level directories, and those holding a .cubin."""
        root = os.environ.get("TRITON_CACHE_DIR")
        entries = [p for p in Path(root).iterdir() if p.is_dir()] if root and Path(root).is_dir() else []
        kernels = sum(1 for p in entries if any(f.suffix in (".cubin", ".hsaco") for f in p.iterdir()))
        return len(entries), kernels

    def snapshot(self, label: str):
        counts = self.compiled_counts()
        entries, kernels = self.cache_contents()
        return {"label": label, "counts": counts, "cache_entries": entries, "cache_kernels": kernels,
                "stub_build_s": self.stub_build_s}

    @staticmethod
    def delta(before: dict, after: dict) -> dict:
        if before["counts"] is None or after["counts"] is None:
            compiled, new = None, None
        else:
            new = {k: v - before["counts"].get(k, 0) for k, v in after["counts"].items()
                   if v != before["counts"].get(k, 0)}
            compiled = sum(new.values())
        return {"compiled": compiled, "kernels": new,
                "new_cache_entries": after["cache_entries"] - before["cache_entries"],
                "new_cache_kernels": after["cache_kernels"] - before["cache_kernels"],
                "stub_build_s": None if before["stub_build_s"] is None or after["stub_build_s"] is None
                else after["stub_build_s"] - before["stub_build_s"]}

    # -- workloads ----------------------------------------------------------------------------------------------

    def make_inputs(self, shape: dict, seed: int):
        import torch

        spec, device = self.spec, self.spec["device"]
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec["dtype"]]
        generator = torch.Generator(device=device).manual_seed(seed)
        grad = spec["backward"]

        def randn(*size, requires_grad=False):
            t = torch.randn(size, generator=generator, device=device, dtype=dtype)
            return t.requires_grad_() if requires_grad else t

        heads, dim = spec["heads"], spec["head_dim"]
        if spec["kind"] == "dense":
            size = (shape["batch"], shape["seqlen"], heads, dim)
            return {"q": randn(*size, requires_grad=grad), "k": randn(*size, requires_grad=grad),
                    "v": randn(*size, requires_grad=grad), "dout": randn(*size)}
        if spec["kind"] == "varlen":
            lengths = shape["lengths"]
            total = sum(lengths)
            cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32,
                              device=device)
            size = (total, heads, dim)
            return {"q": randn(*size, requires_grad=grad), "k": randn(*size, requires_grad=grad),
                    "v": randn(*size, requires_grad=grad), "dout": randn(*size), "cu": cu, "max": max(lengths)}
        batch, capacity, heads_k = shape["batch"], shape["capacity"], spec["heads_k"]
        lengths = torch.randint(capacity // 2, capacity - 1, (batch,), generator=generator, device=device)
        return {"q": randn(batch, 1, heads, dim), "k_cache": randn(batch, capacity, heads_k, dim),
                "v_cache": randn(batch, capacity, heads_k, dim), "k": randn(batch, 1, heads_k, dim),
                "v": randn(batch, 1, heads_k, dim), "cache_seqlens": lengths.to(torch.int32)}

    def forward(self, x):
        import flashtriton

        spec = self.spec
        if spec["kind"] == "dense":
            return flashtriton.flash_attn_func(x["q"], x["k"], x["v"], causal=spec["causal"])
        if spec["kind"] == "varlen":
            return flashtriton.flash_attn_varlen_func(x["q"], x["k"], x["v"], x["cu"], x["cu"], x["max"], x["max"],
                                                      causal=spec["causal"])
        return flashtriton.flash_attn_with_kvcache(x["q"], x["k_cache"], x["v_cache"], k=x["k"], v=x["v"],
                                                   cache_seqlens=x["cache_seqlens"], causal=spec["causal"])

    def backward(self, out, x):
        import torch

        return torch.autograd.grad(out, (x["q"], x["k"], x["v"]), x["dout"])

    def call(self, tag: str, x) -> dict:
        """Forward (and backward) on inputs x, each timed as `{tag}_fwd_s` / `{tag}_bwd_s`; compile deltas."""
        before = self.snapshot(tag)
        out = self.clock(f"{tag}_fwd_s", lambda: self.forward(x))
        after_fwd = self.snapshot(tag)
        self.result[f"{tag}_fwd"] = self.delta(before, after_fwd)
        if self.spec["backward"]:
            self.clock(f"{tag}_bwd_s", lambda: self.backward(out, x))
            self.result[f"{tag}_bwd"] = self.delta(after_fwd, self.snapshot(tag))
        return out

    # -- the run ------------------------------------------------------------------------------------------------

    def run(self):
        spec, result = self.spec, self.result
        start = time.perf_counter()
        import torch
        result["import_torch_s"] = time.perf_counter() - start

        start = time.perf_counter()
        import triton

        import flashtriton
        result["import_flashtriton_s"] = time.perf_counter() - start
        result["versions"] = {"torch": torch.__version__, "triton": triton.__version__,
                              "flashtriton": flashtriton.__version__}
        if spec["device"] == "cuda":
            self.wrap_stub_builds()
            self.clock("cuda_init_s", lambda: torch.zeros(1, device="cuda"))
            self.clock("triton_driver_init_s", lambda: triton.runtime.driver.active.get_current_device())
            result["triton_driver_stub_build_s"] = self.stub_build_s
        first = self.make_inputs(spec["shape"], seed=0)
        self.sync()
        result["cache_before"] = self.snapshot("start")
        from flashtriton.ops.launching import compiler_key_computed

        # Triton's per-process key, started at import (launching.compiler_key_ahead): (a) does not pay it when ready
        result["compiler_key_ready"] = compiler_key_computed()
        self.call("first", first)
        if spec["phase"] == "warm":
            return
        self.call("second", first)
        second = self.make_inputs(spec["shape2"], seed=1)
        self.sync()
        self.call("changed", second)
        if "other" in spec:  # (e) a new configuration in this warm process: its compile time alone
            self.spec = {**spec, **spec["other"]}
            other = self.make_inputs(self.spec["shape"], seed=2)
            self.sync()
            self.call("other", other)
            self.spec = spec


def child_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    child = Child(spec)
    try:
        child.run()
    except Exception as error:  # noqa: BLE001 - reported to the parent
        text = str(error).strip()
        child.result["status"] = f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"
    sys.stdout.flush()
    print(RESULT_MARKER + json.dumps(child.result), flush=True)
    return 0


# ----------------------------------------------------------------------------------------------------------------
# Parent
# ----------------------------------------------------------------------------------------------------------------

def run_child(spec: dict, phase: str, cache_dir: str, device: str, timeout: float) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir)
    for name in ("TRITON_ALWAYS_COMPILE", "TRITON_INTERPRET", "TRITON_KERNEL_OVERRIDE", "TRITON_KERNEL_DUMP"):
        env.pop(name, None)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    paths = [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    child_spec = dict(spec, phase=phase, device=device)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(child_spec)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(REPO_ROOT))
    except subprocess.TimeoutExpired:
        return {"name": spec["name"], "phase": phase, "status": f"timed out after {timeout:.0f} s",
                "process_wall_s": time.perf_counter() - start}
    wall = time.perf_counter() - start
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER):])
            result["process_wall_s"] = wall
            return result
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return {"name": spec["name"], "phase": phase, "status": f"child exited {done.returncode}: {tail}",
            "process_wall_s": wall}


def total(*values):
    return None if any(v is None for v in values) else sum(values)


def rows_of(spec: dict, cold: dict, warm: dict) -> list:
    """The fwd row and, with a backward, the fwd+bwd row of one configuration."""
    modes = ("fwd", "fwd+bwd") if spec["backward"] else ("fwd",)
    status = "ok" if cold.get("status") == "ok" and warm.get("status") == "ok" else \
        "; ".join(f"{r.get('phase')}: {r.get('status')}" for r in (cold, warm) if r.get("status") != "ok")
    rows = []
    for mode in modes:
        parts = ("fwd", "bwd") if mode == "fwd+bwd" else ("fwd",)

        def seconds(result, tag):
            return total(*(result.get(f"{tag}_{part}_s") for part in parts))

        def deltas(result, tag, field):
            values = [(result.get(f"{tag}_{part}") or {}).get(field) for part in parts]
            if field == "kernels":
                merged = {}
                for value in values:
                    for k, v in (value or {}).items():
                        merged[k] = merged.get(k, 0) + v
                return merged if all(v is not None for v in values) else None
            return total(*values)

        rows.append({
            "config": spec["name"], "kind": spec["kind"], "head_dim": spec["head_dim"], "causal": spec["causal"],
            "dtype": spec["dtype"], "mode": mode, "status": status,
            "import_torch_s": cold.get("import_torch_s"), "import_flashtriton_s": cold.get("import_flashtriton_s"),
            "cuda_init_s": cold.get("cuda_init_s"), "triton_driver_init_s": cold.get("triton_driver_init_s"),
            "compiler_key_ready": cold.get("compiler_key_ready"),
            "first_call_s": seconds(cold, "first"),
            "first_call_compiled": deltas(cold, "first", "compiled"),
            "first_call_new_cache_kernels": deltas(cold, "first", "new_cache_kernels"),
            "first_call_stub_build_s": deltas(cold, "first", "stub_build_s"),
            "second_call_s": seconds(cold, "second"),
            "second_call_compiled": deltas(cold, "second", "compiled"),
            "changed_shape_call_s": seconds(cold, "changed"),
            "changed_shape_compiled": deltas(cold, "changed", "compiled"),
            "changed_shape_new_cache_kernels": deltas(cold, "changed", "new_cache_kernels"),
            "changed_shape_new_kernels": deltas(cold, "changed", "kernels"),
            "new_config_call_s": seconds(cold, "other"),
            "new_config_compiled": deltas(cold, "other", "compiled"),
            "warm_cache_first_call_s": seconds(warm, "first"),
            "warm_cache_new_cache_kernels": deltas(warm, "first", "new_cache_kernels"),
            "cold_process_s": cold.get("process_wall_s"), "warm_process_s": warm.get("process_wall_s"),
            "warm_import_torch_s": warm.get("import_torch_s"),
        })
    return rows


def fmt(value, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def summary(rows: list) -> dict:
    fwd = [r["first_call_s"] for r in rows if r["mode"] == "fwd" and r["first_call_s"] is not None]
    both = [r["first_call_s"] for r in rows if r["mode"] == "fwd+bwd" and r["first_call_s"] is not None]
    warm = [r["warm_cache_first_call_s"] for r in rows if r["mode"] == "fwd"
            and r["warm_cache_first_call_s"] is not None]
    new_config = [r["new_config_call_s"] for r in rows if r["mode"] == "fwd" and r["new_config_call_s"] is not None]
    recompiled = [r["config"] + f" ({r['mode']})" for r in rows
                  if (r["changed_shape_compiled"] or 0) > 0 or (r["changed_shape_new_cache_kernels"] or 0) > 0]
    checked = [r for r in rows if r["changed_shape_compiled"] is not None]
    median_fwd = statistics.median(fwd) if fwd else None
    return {"median_first_call_fwd_s": median_fwd, "configs_fwd": len(fwd),
            "median_first_call_fwd_bwd_s": statistics.median(both) if both else None, "configs_fwd_bwd": len(both),
            "median_warm_cache_first_call_fwd_s": statistics.median(warm) if warm else None,
            "median_new_config_fwd_s": statistics.median(new_config) if new_config else None,
            "configs_new_config": len(new_config),
            "target_s": TARGET_S, "target_met": None if median_fwd is None else median_fwd <= TARGET_S,
            "rows_checked_for_recompiles": len(checked), "recompiled_on_shape_change": recompiled}


def markdown(result: dict) -> str:
    from flashtriton.bench import markdown_table

    rows, s = result["rows"], result["summary"]
    meta = ", ".join(f"{k}: {v}" for k, v in result["metadata"].items() if v is not None and k != "args")
    parts = [meta]
    headers = ["config", "mode", "(a) first call s", "compiled", "host stubs s", "(b) second call ms",
               "(c) new batch+seqlen ms", "(c) compiled", "(d) warm-cache first call s",
               "(e) next config, same process s", "status"]
    table = []
    for r in rows:
        recompiled = r["changed_shape_compiled"]
        cell_c = fmt(recompiled, "d")
        if recompiled:
            cell_c += " " + ", ".join(f"{k} +{v}" for k, v in (r["changed_shape_new_kernels"] or {}).items())
        table.append([r["config"], r["mode"], fmt(r["first_call_s"]), fmt(r["first_call_compiled"], "d"),
                      fmt(r["first_call_stub_build_s"]),
                      fmt(None if r["second_call_s"] is None else r["second_call_s"] * 1e3, ".1f"),
                      fmt(None if r["changed_shape_call_s"] is None else r["changed_shape_call_s"] * 1e3, ".1f"),
                      cell_c, fmt(r["warm_cache_first_call_s"], ".3f"), fmt(r["new_config_call_s"]), r["status"]])
    parts.append(markdown_table(headers, table, [False, False] + [True] * 8 + [False]))
    process_headers = ["config", "import torch s", "import flashtriton s", "CUDA init s", "Triton driver init s",
                       "compiler key ready before (a)", "cold process s", "warm process s"]
    process_rows = [[r["config"], fmt(r["import_torch_s"]), fmt(r["import_flashtriton_s"]), fmt(r["cuda_init_s"]),
                     fmt(r["triton_driver_init_s"]), fmt(r.get("compiler_key_ready"), ""),
                     fmt(r["cold_process_s"], ".1f"), fmt(r["warm_process_s"], ".1f")]
                    for r in rows if r["mode"] == "fwd"]
    parts.append("Outside (a), per process (cold child; the driver init builds Triton's C helpers in the empty "
                 "cache):\n\n" + markdown_table(process_headers, process_rows, [False] + [True] * 4 + [False] + [True] * 2))
    verdict = "n/a" if s["target_met"] is None else ("met" if s["target_met"] else "NOT met")
    lines = []
    if result.get("args", {}).get("device") == "cpu":
        lines.append("CPU plumbing check (TRITON_INTERPRET=1, tiny shapes): nothing is compiled, the times below "
                     "mean nothing.")
    lines += [f"Median (a) first forward call over {s['configs_fwd']} configurations: "
             f"{fmt(s['median_first_call_fwd_s'])} s (target <= {TARGET_S:.0f} s: {verdict}).",
             f"Median (a) first forward + backward over {s['configs_fwd_bwd']} configurations: "
             f"{fmt(s['median_first_call_fwd_bwd_s'])} s.",
             f"Median (d) first forward call with a warm on-disk cache: "
             f"{fmt(s['median_warm_cache_first_call_fwd_s'], '.3f')} s.",
             f"Median (e) first forward call of another head dim in the same, already warm process (compilation "
             f"without the process's one-time work) over {s['configs_new_config']} configurations: "
             f"{fmt(s['median_new_config_fwd_s'])} s.",
             "(a) excludes importing torch and flashtriton, creating the CUDA context and starting Triton's driver "
             "(second table); it includes compiling, gcc-building the kernels' launchers (host stubs) and running."]
    if s["recompiled_on_shape_change"]:
        lines.append("Compiled again after changing only batch and seqlen: "
                     + ", ".join(s["recompiled_on_shape_change"]) + ".")
    elif s["rows_checked_for_recompiles"]:
        lines.append(f"No compilation after changing only batch and seqlen ({s['rows_checked_for_recompiles']} "
                     f"rows checked).")
    else:
        lines.append("Compilation counts unavailable (interpreted kernels).")
    if result.get("skipped"):
        lines.append("Skipped (time budget): " + ", ".join(result["skipped"]) + ".")
    parts.append("\n".join(f"- {line}" for line in lines))
    return "\n\n".join(parts) + "\n"


def write(result: dict, out_dir: Path) -> list:
    out_dir.mkdir(parents=True, exist_ok=True)
    result["summary"] = summary(result["rows"])
    json_path, md_path = out_dir / "cold_start.json", out_dir / "cold_start.md"
    json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    md_path.write_text(markdown(result))
    return [json_path, md_path]


def default_out_dir() -> Path:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path(__file__).resolve().parent / "results" / f"{stamp}-cold-start"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for cold_start.json and cold_start.md (default benchmarks/results/<UTC "
                             "time>-cold-start)")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--configs", type=lambda text: [n.strip() for n in text.split(",") if n.strip()],
                        default=None, help="comma-separated configuration names (see --list)")
    parser.add_argument("--list", action="store_true", help="print the configuration names and exit")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: plumbing check with TRITON_INTERPRET=1 and tiny shapes (numbers meaningless)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per child process (default 120)")
    parser.add_argument("--budget", type=float, default=210.0,
                        help="start no new configuration after this many seconds (default 210, so the default run "
                             "ends within about 4 minutes; skipped ones are listed; 0 = no limit)")
    parser.add_argument("--keep-cache", action="store_true", help="keep each configuration's TRITON_CACHE_DIR")
    parser.add_argument("--child", metavar="SPEC_JSON", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    if args.list:
        for config in all_configs():
            print(config["name"] + ("  (quick)" if config["name"] in QUICK else ""))
        return EXIT_OK
    configs = select_configs(args.configs, args.quick)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_cold_start: no CUDA GPU; this benchmark measures Triton compilation for a GPU, nothing "
              "measured (exit 2). `--device cpu` checks the child-process plumbing with the interpreter.",
              file=sys.stderr)
        return EXIT_CANNOT_RUN
    if args.out is None:
        args.out = default_out_dir()
    from flashtriton.bench import git_commit, run_metadata

    # The parent stays off the GPU while children measure; run_metadata (GPU name) is filled in at the end.
    partial_metadata = {"commit": git_commit(), "torch": torch.__version__,
                        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    result = {"metadata": partial_metadata, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                       if k != "child"},
              "rows": [], "children": [], "skipped": []}
    start = time.perf_counter()
    for index, spec in enumerate(configs):
        if args.device == "cpu":
            spec = cpu_shapes(spec)
        elapsed = time.perf_counter() - start
        if args.budget and elapsed > args.budget:
            result["skipped"].append(spec["name"])
            continue
        print(f"[{index + 1}/{len(configs)}] {spec['name']} ({elapsed:.0f} s)", file=sys.stderr, flush=True)
        cache_dir = tempfile.mkdtemp(prefix="flashtriton-cold-")
        try:
            cold = run_child(spec, "cold", cache_dir, args.device, args.timeout)
            warm = run_child(spec, "warm", cache_dir, args.device, args.timeout)
        finally:
            if args.keep_cache:
                print(f"  kept TRITON_CACHE_DIR {cache_dir}", file=sys.stderr)
            else:
                shutil.rmtree(cache_dir, ignore_errors=True)
        result["children"] += [cold, warm]
        result["rows"] += rows_of(spec, cold, warm)
        for child in (cold, warm):
            if child.get("status") != "ok":
                print(f"  {child['phase']}: {child['status']}", file=sys.stderr, flush=True)
        write(result, args.out)  # partial results survive an interrupted run
    result["metadata"] = dict(run_metadata(), script="benchmarks/bench_cold_start.py",
                              elapsed_s=round(time.perf_counter() - start, 1))
    paths = write(result, args.out)
    print(markdown(result))
    for path in paths:
        print(f"wrote {path}")
    failed = any(child.get("status") != "ok" for child in result["children"])
    return EXIT_CHILD_FAILED if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

"""benchmarks/bench_context_parallel.py on 2 gloo CPU processes at toy sizes: ring-flash-attn's zigzag ring and
llama3 varlen attention on flashtriton (through install_as_flash_attn) match flashtriton's single-process result,
forward and backward, and time; PyTorch's context_parallel is refused on CPU (its ring attention runs CUDA's SDPA)."""

import importlib
import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ring_flash_attn") is None,
                                reason="ring-flash-attn is not installed (pip install --no-deps ring-flash-attn)")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_ring_methods_match_one_process(tmp_path, monkeypatch):
    # imported by name (the spawned processes import the worker's module again; sys.path reaches them)
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("bench_context_parallel")
    argv = ["--device", "cpu", "--world", "2", "--tokens", "48", "--check-tokens", "40", "--heads", "4",
            "--heads-k", "2", "--head-dim", "16", "--reps", "1", "--out", str(tmp_path)]
    assert module.main(argv) == 0
    rows = {row["method"]: row for row in json.loads((tmp_path / "context_parallel.json").read_text())["rows"]}
    for method in ("zigzag", "llama3"):
        assert rows[method]["status"] == "ok", rows[method]["status"]
        assert rows[method]["check_error"] < 2e-2
        timing, = rows[method]["timings"]
        assert timing["tokens"] == 48 and timing["fwd_ms"] > 0 and timing["single_fwd_ms"] > 0
    assert rows["torch-cp"]["status"].startswith("unavailable: NotImplementedError")

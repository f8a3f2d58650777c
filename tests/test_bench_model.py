"""benchmarks/bench_model.py at toy sizes on CPU: the flashtriton implementation trains and generates through
transformers, an implementation that cannot run becomes a row with its error, and the outputs are written."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_model.py"
TOY = ["--device", "cpu", "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--intermediate", "64",
       "--vocab", "64", "--batch", "1", "--seqlen", "24", "--steps", "1", "--gen-batch", "2", "--prompt", "5",
       "--new-tokens", "3"]


def load_script():
    spec = importlib.util.spec_from_file_location("bench_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_toy_model_rows(tmp_path):
    bench_model = load_script()
    assert bench_model.main(TOY + ["--impls", "flashtriton,fa4", "--out", str(tmp_path)]) == 0
    rows = {row["impl"]: row for row in json.loads((tmp_path / "model.json").read_text())["rows"]}
    assert rows["flashtriton"]["status"] == "ok"
    assert rows["flashtriton"]["train_tokens_per_s"] > 0 and rows["flashtriton"]["generate_tokens_per_s"] > 0
    assert rows["flashtriton"]["parameters"] > 0
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        assert rows["fa4"]["status"].startswith("unavailable: ")
    assert "| flashtriton |" in (tmp_path / "model.md").read_text()


def test_unknown_implementation_is_refused():
    with pytest.raises(SystemExit):
        load_script().parse_args(["--impls", "flashtriton,magic"])

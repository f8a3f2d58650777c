"""benchmarks/bench_model.py at toy sizes on CPU: the flashtriton implementation trains and generates through
transformers, an implementation that cannot run becomes a row with its error, and the outputs are written."""

import json

import pytest

pytest.importorskip("transformers")

TOY = ["--device", "cpu", "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--intermediate", "64",
       "--vocab", "64", "--batch", "1", "--seqlen", "24", "--steps", "1", "--gen-batch", "2", "--prompt", "5",
       "--new-tokens", "3"]


def test_toy_model_rows(tmp_path, benchmark_script):
    bench_model = benchmark_script("bench_model")
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


def test_unknown_implementation_is_refused(benchmark_script):
    with pytest.raises(SystemExit):
        benchmark_script("bench_model").parse_args(["--impls", "flashtriton,magic"])

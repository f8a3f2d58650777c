"""The feature matrix's harness (flashtriton/bench_features.py) at small sizes: every row builds, flashtriton's call
for it matches the reference through the row's own check, the peers refuse what they cannot express, the
throughput counts the pairs a row computes, and the outputs render. The timings themselves need a GPU
(`flashtriton bench --features`)."""

import pytest
import torch

from flashtriton import bench_features, cli
from flashtriton.bench_features import FEATURES, FeatureRow, make_problem

TOKENS = 64  # query tokens per row here (16k on a GPU)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("feature", FEATURES, ids=[f.name for f in FEATURES])
def test_flashtriton_runs_every_row(feature, causal):
    if causal not in feature.causal_values:
        pytest.skip("one-row rows are not causal (bottom-right causal is the full row)")
    problem = make_problem(feature, causal, torch.float16, "cpu", tokens=TOKENS)
    assert sum(problem.lengths) == (TOKENS if not feature.one_row else problem.k.shape[0] * problem.k.shape[1])
    attention = bench_features.attention_call("flashtriton", problem)
    with torch.no_grad():
        out = attention(problem.q, problem.k, problem.v)
    error, passed = bench_features.reference_check(problem, out)
    assert passed, f"relative error {error}"
    # the check must notice a wrong output
    assert not bench_features.reference_check(problem, out.flip(-1))[1]
    if "bwd" in feature.modes:
        grads = bench_features.timed(attention, problem, "bwd")()
        assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_triton_column_switches_gluon_off_for_the_call():
    from flashtriton import configs

    seen = []
    problem = make_problem(FEATURES[0], False, torch.float16, "cpu", tokens=TOKENS)
    call = bench_features.attention_call("flashtriton-triton", problem)
    allowed = configs.GLUON_ALLOWED
    real = bench_features._flashtriton_call(problem)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench_features, "_flashtriton_call", lambda p: lambda q, k, v: seen.append(
            configs.GLUON_ALLOWED) or real(q, k, v))
        call = bench_features.attention_call("flashtriton-triton", problem)
        call(problem.q, problem.k, problem.v)
    assert seen == [False] and configs.GLUON_ALLOWED == allowed


def test_triton_column_times_its_backward_with_gluon_off(monkeypatch):
    """The backward picks its kernels when autograd runs it, after the forward returned: the timed function itself
    must run with the Gluon kernels off."""
    from flashtriton import bench, configs

    seen = []
    problem = make_problem(FEATURES[0], False, torch.float16, "cpu", tokens=TOKENS)
    monkeypatch.setattr(bench_features, "make_problem", lambda *args: problem)
    monkeypatch.setattr(bench_features, "timed", lambda attention, p, mode: lambda: seen.append(
        (mode, configs.GLUON_ALLOWED)))
    monkeypatch.setattr(bench, "time_ms", lambda function, *args: function() or 1.0)
    bench_features.run_features([FEATURES[0]], ["flashtriton", "flashtriton-triton"], ["bwd"], [torch.float16],
                                device="cpu", causal_values=(False, ))
    assert seen == [("bwd", configs.GLUON_ALLOWED), ("bwd", False)]


@pytest.mark.parametrize("name", ["window-256", "softcap-30", "alibi", "varlen-mixed", "paged-64"])
def test_sdpa_refuses_rows_it_cannot_express(name):
    feature = bench_features.select_features([name])[0]
    problem = make_problem(feature, True, torch.float16, "cpu", tokens=TOKENS)
    for provider in ("sdpa-cudnn", "sdpa-flash"):
        with pytest.raises(bench_features.Unsupported):
            bench_features.attention_call(provider, problem)


def test_fa4_refuses_alibi_or_is_missing():
    problem = make_problem(bench_features.select_features(["alibi"])[0], False, torch.float16, "cpu", tokens=TOKENS)
    with pytest.raises(bench_features.Unsupported):
        bench_features.attention_call("fa4", problem)


def test_sdpa_call_matches_flashtriton_on_gqa():
    """SDPA's call takes the (B, S, H, D) tensors of the row and returns that layout (math backend on CPU)."""
    from torch.nn.attention import SDPBackend

    problem = make_problem(bench_features.select_features(["gqa-32/8"])[0], True, torch.float16, "cpu",
                           tokens=TOKENS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench_features.bench, "_sdpa_backend", lambda provider: SDPBackend.MATH)
        out = bench_features.attention_call("sdpa-flash", problem)(problem.q, problem.k, problem.v)
    assert out.shape == problem.q.shape
    assert bench_features.reference_check(problem, out)[1]


def test_visible_pairs_count_what_each_row_computes():
    plain = make_problem(FEATURES[0], True, torch.float16, "cpu", tokens=TOKENS)
    assert bench_features.visible_pairs(plain) == 16 * TOKENS * (TOKENS + 1) // 2
    window = make_problem(bench_features.Feature("w", window=10, heads=1), True, torch.float16, "cpu", tokens=TOKENS)
    assert bench_features.visible_pairs(window) == sum(min(i, 10) + 1 for i in range(TOKENS))
    full_window = make_problem(bench_features.Feature("w", window=10, heads=1), False, torch.float16, "cpu",
                               tokens=TOKENS)
    assert bench_features.visible_pairs(full_window) == sum(min(i, 10) + 1 + min(TOKENS - 1 - i, 10)
                                                            for i in range(TOKENS))
    varlen = make_problem(bench_features.select_features(["varlen-mixed"])[0], False, torch.float16, "cpu",
                          tokens=TOKENS)
    assert bench_features.visible_pairs(varlen) == 16 * sum(n * n for n in varlen.lengths)
    value, unit = bench_features.throughput(varlen, "bwd", 1.0)
    assert unit == "TF/s" and value == pytest.approx(2.5 * 4 * 128 * 16 * sum(n * n for n in varlen.lengths) / 1e9)
    one_row = make_problem(bench_features.select_features(["one-row"])[0], False, torch.float16, "cpu",
                           tokens=TOKENS)
    assert bench_features.throughput(one_row, "fwd", 1.0)[1] == "TB/s"
    # V's own head dim: 2 (D + Dv) flops per pair forward
    mla = make_problem(bench_features.select_features(["mla-192/128"])[0], False, torch.float16, "cpu", tokens=TOKENS)
    assert mla.q.shape[-1] == mla.k.shape[-1] == 192 and mla.v.shape[-1] == 128
    assert bench_features.throughput(mla, "fwd", 1.0)[0] == pytest.approx(
        2 * (192 + 128) * 10 * TOKENS * TOKENS / 1e9)


def test_sinks_row_passes_its_sinks_and_checks_them():
    """The sinks row hands its learnable_sink to flashtriton and to the reference: an output computed without the
    sinks fails the row's check; SDPA, which has none, refuses the row."""
    from flashtriton import flash_attn_func

    problem = make_problem(bench_features.select_features(["sinks"])[0], True, torch.float16, "cpu", tokens=TOKENS)
    assert problem.learnable_sink.shape == (problem.feature.num_heads,)
    with torch.no_grad():
        out = bench_features.attention_call("flashtriton", problem)(problem.q, problem.k, problem.v)
        without = flash_attn_func(problem.q, problem.k, problem.v, causal=True)
    assert bench_features.reference_check(problem, out)[1]
    assert not bench_features.reference_check(problem, without)[1]
    for provider in ("sdpa-cudnn", "sdpa-flash"):
        with pytest.raises(bench_features.Unsupported):
            bench_features.attention_call(provider, problem)


def test_markdown_puts_peers_over_ours():
    rows = [FeatureRow("plain", True, "bf16", "fwd", "flashtriton", ms=2.0, throughput=500.0, unit="TF/s",
                       rel_error=1e-3, correct=True),
            FeatureRow("plain", True, "bf16", "fwd", "fa4", ms=1.8),
            FeatureRow("plain", True, "bf16", "fwd", "sdpa-cudnn", ms=None, status="unsupported: x")]
    text = bench_features.features_markdown(rows, {"gpu": "fake"})
    line = next(line for line in text.splitlines() if line.startswith("| plain"))
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[4:7] == ["2.000", "1.800", "n/a"]
    assert "500.00 TF/s" in cells and "0.90" in cells and "1.0e-03 ok" in cells


def test_write_results(tmp_path):
    rows = [FeatureRow("plain", False, "bf16", mode, provider, ms=1.0 + (provider == "fa4"))
            for mode in ("fwd", "bwd") for provider in ("flashtriton", "fa4")]
    paths = bench_features.write_results(bench_features.bench.BenchResult(rows, {"gpu": "fake"}), tmp_path)
    assert {p.name for p in paths} >= {"features.json", "features.md"}


def test_select_features_names_the_unknown():
    with pytest.raises(ValueError, match="d77"):
        bench_features.select_features(["plain", "d77"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_cli_features_needs_a_gpu(capsys):
    assert cli.main(["bench", "--features", "--rows", "plain"]) == cli.EXIT_CANNOT_RUN
    assert "no CUDA GPU" in capsys.readouterr().err

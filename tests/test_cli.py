"""The `flashtriton` command on CPU: env, validate (through Triton's interpreter), CUDA-only commands, and the
pure parts of the bench harness (FLOP counter, Markdown tables) and of inspect (instruction counts, gates).

The two `validate --quick` runs (~1.5 min each on 2 cores) start together in one module-scoped fixture.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy
import pytest
import torch

import flashtriton
from flashtriton import bench, cli, env, kernel_inspect

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")

DENSE_PATHS = ("flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func")
VARLEN_PATHS = ("flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
                "flash_attn_varlen_func paged48", "flash_attn_varlen_func paged16")
KVCACHE_PATHS = ("flash_attn_with_kvcache", "flash_attn_with_kvcache paged48")
KVCACHE_VARIANTS = ("decode", "chunk", "rotary", "batch_idx+leftpad", "alibi", "softcap", "gqa", "num_splits 3 vs 1")


def kvcache_cases():
    """(path, variant) of every flash_attn_with_kvcache check; cache_batch_idx/cache_leftpad only contiguous."""
    return [(path, variant) for path in KVCACHE_PATHS for variant in KVCACHE_VARIANTS
            if not ("paged" in path and variant == "batch_idx+leftpad")]


def _command(*args):
    return [sys.executable, "-m", "flashtriton", *args]


@pytest.fixture(scope="module")
def validate_runs(tmp_path_factory):
    """Run `validate --quick` twice at once: a clean run under TRITON_INTERPRET=1 writing a report, and a run with
    the hidden `--inject-fault` flag started *without* TRITON_INTERPRET, so it must re-execute itself under the
    interpreter. --inject-fault multiplies the softmax scale given to the kernels (not to the reference) by 1.01;
    the gates must catch that and exit 1."""
    root = tmp_path_factory.mktemp("validate")
    base_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    launches = {
        "clean": (_command("validate", "--device", "cpu", "--quick", "--report", str(root / "report")),
                  dict(base_env, TRITON_INTERPRET="1")),
        "fault": (_command("validate", "--device", "cpu", "--quick", "--inject-fault"), base_env),
    }
    processes = {}
    for name, (command, environment) in launches.items():
        stdout, stderr = open(root / f"{name}.out", "w"), open(root / f"{name}.err", "w")
        processes[name] = (subprocess.Popen(command, stdout=stdout, stderr=stderr, env=environment), stdout, stderr)
    runs = {}
    for name, (process, stdout, stderr) in processes.items():
        returncode = process.wait(timeout=600)
        stdout.close()
        stderr.close()
        runs[name] = subprocess.CompletedProcess(process.args, returncode, (root / f"{name}.out").read_text(),
                                                 (root / f"{name}.err").read_text())
    runs["report_dir"] = root / "report"
    return runs


def test_validate_quick_passes_and_writes_reports(validate_runs):
    run = validate_runs["clean"]
    assert run.returncode == 0, run.stdout + run.stderr
    assert "kernels: Triton interpreter" in run.stdout
    assert "-bfloat16" in run.stdout, "the interpreter validates bf16"
    assert "PASSED" in run.stdout
    assert re.search(r"\[\s*1/\d+\] api: ", run.stderr), "progress indicator on stderr"
    report_dir = validate_runs["report_dir"]
    markdown = (report_dir / "validate.md").read_text()
    payload = json.loads((report_dir / "validate.json").read_text())
    assert "| section" in markdown and "Verdict: PASSED" in markdown
    assert payload["passed"] is True
    assert {r["section"] for r in payload["results"]} == {"api", "accuracy", "backward", "edge"}
    assert payload["metadata"]["dtypes"] == ["fp16", "bf16"]
    api_cases = [r["case"] for r in payload["results"] if r["section"] == "api"]
    for path in DENSE_PATHS + VARLEN_PATHS:
        for variant in ("base", "causal", "window", "alibi", "softcap"):
            assert any(case.startswith(f"{path} {variant}") for case in api_cases), (path, variant)


def test_validate_report_checks_varlen_paths(validate_runs):
    """The varlen paths are in the report: gradients checked except for paged K/V (forward only), and the
    varlen = dense edge probe."""
    payload = json.loads((validate_runs["report_dir"] / "validate.json").read_text())
    measured = {r["case"]: {m["name"] for m in r["measures"]} for r in payload["results"] if r["section"] == "api"}
    for path in VARLEN_PATHS:
        cases = [case for case in measured if case.rsplit(" ", 2)[0] == path]  # "<path> <variant> <dtype>"
        assert len(cases) >= 5, (path, cases)
        expected = {"out", "lse"} if "paged" in path else {"out", "lse", "dq", "dk", "dv"}
        assert all(measured[case] == expected for case in cases), (path, {c: measured[c] for c in cases})
    edge_cases = [r["case"] for r in payload["results"] if r["section"] == "edge" and r["passed"]]
    assert any(case.startswith("varlen = dense") for case in edge_cases), edge_cases
    assert "dropout" in edge_cases, edge_cases


def test_validate_report_checks_kvcache_paths(validate_runs):
    """flash_attn_with_kvcache, contiguous and paged: out and lse against the reference, both caches after the
    append, and with num_splits 3 and 1 each of those plus their agreement."""
    payload = json.loads((validate_runs["report_dir"] / "validate.json").read_text())
    measured = {r["case"]: {m["name"] for m in r["measures"]} for r in payload["results"] if r["section"] == "api"}
    for path, variant in kvcache_cases():
        cases = [case for case in measured if case.startswith(f"{path} {variant} ")]
        assert len(cases) == 1, (path, variant, cases)
        if variant.startswith("num_splits"):
            expected = {f"{name} (num_splits={splits})" for name in ("out", "lse", "k_cache", "v_cache")
                        for splits in (3, 1)} | {"out num_splits=3 vs 1", "lse num_splits=3 vs 1"}
        else:
            expected = {"out", "lse", "k_cache", "v_cache"}
        assert measured[cases[0]] == expected, (cases[0], measured[cases[0]])


def test_validate_inject_fault_fails_after_reexec(validate_runs):
    run = validate_runs["fault"]
    assert run.returncode == 1, run.stdout + run.stderr
    assert "re-running with TRITON_INTERPRET=1" in run.stderr
    assert "kernels: Triton interpreter" in run.stdout
    assert "FAILED" in run.stdout and "FAIL accuracy" in run.stdout
    for path in VARLEN_PATHS:
        assert f"FAIL api / {path} base" in run.stdout, path
    for path, variant in kvcache_cases():
        assert f"FAIL api / {path} {variant} " in run.stdout, (path, variant)
    assert "FAIL edge / learnable sink" in run.stdout and "FAIL edge / V head dim 32" in run.stdout


def test_inject_fault_is_hidden_from_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["validate", "--help"])
    help_text = capsys.readouterr().out
    assert "--report" in help_text and "inject" not in help_text


def test_env_mentions_versions():
    run = subprocess.run(_command("env"), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    for version in (flashtriton.__version__, torch.__version__):
        assert version in run.stdout
    assert "triton" in run.stdout and "Triton cache dir" in run.stdout and "CPU:" in run.stdout


def test_env_json_has_no_library_gaps(capsys):
    """Dropout, varlen and the KV cache are all implemented: env lists no gap."""
    assert cli.main(["env", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["versions"]["torch"] == torch.__version__
    assert payload["versions"]["numpy (Triton's interpreter)"] == numpy.__version__
    assert payload["library_gaps"] == {}


@needs_no_cuda
@pytest.mark.parametrize("argv, message", [
    (["bench", "--shapes", "quick"], "no CUDA GPU: bench"),
    (["warmup"], "no CUDA GPU: warmup"),
    (["inspect", "--head-dim", "64"], "no CUDA GPU: inspect needs compiled kernels"),
], ids=["bench", "warmup", "inspect"])
def test_cuda_only_commands_exit_2_without_gpu(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_bench_rejects_unknown_provider():
    with pytest.raises(SystemExit) as raised:
        cli.main(["bench", "--providers", "flashtriton,sdpa-magic"])
    assert raised.value.code == 2


# ---- bench.py: FLOPs and tables -----------------------------------------------------------------------------------

def test_attention_flops():
    forward = 4 * 2 * 16 * 1024 * 2048 * 128
    assert bench.attention_flops(2, 16, 1024, 2048, 128, causal=False) == forward
    assert bench.attention_flops(2, 16, 1024, 2048, 128, causal=True) == forward / 2
    assert bench.attention_flops(2, 16, 1024, 2048, 128, causal=False, mode="bwd") == 2.5 * forward
    assert bench.attention_flops(2, 16, 1024, 2048, 128, causal=True, mode="fwd+bwd") == 3.5 * forward / 2
    with pytest.raises(ValueError):
        bench.attention_flops(1, 1, 1, 1, 1, causal=False, mode="sideways")
    assert bench.tflops_per_second(2e12, 1000.0) == pytest.approx(2.0)


def test_relative_linf_counts_nan_as_wrong():
    ref = torch.tensor([1.0, -2.0, 0.5])
    assert bench.relative_linf(ref + torch.tensor([0.0, 0.02, 0.0]), ref) == pytest.approx(0.01)
    assert bench.relative_linf(torch.tensor([1.0, float("nan"), 0.5]), ref) == float("inf")


def _fake_rows():
    def row(provider, mode, tflops, **extra):
        ms = None if tflops is None else 1.0
        return bench.BenchRow(provider, 4, 4096, 16, 128, True, "bf16", mode, ms=ms, tflops=tflops, **extra)

    return [
        row("flashtriton", "fwd", 600.0, max_error=1e-3, rel_error=2e-3, correct=True),
        row("sdpa-flash", "fwd", 300.0),
        row("sdpa-cudnn", "fwd", 400.0),
        row("sdpa-efficient", "fwd", None, status="unavailable: RuntimeError: no kernel"),
        row("flashtriton", "fwd+bwd", 450.0, max_error=0.5, rel_error=0.3, correct=False, peak_mem_mib=300.0),
        row("sdpa-flash", "fwd+bwd", 300.0, peak_mem_mib=200.0),
    ]


def test_markdown_table_pads_and_aligns():
    table = bench.markdown_table(["name", "value"], [["a", 1.5], ["longer", 10]], [False, True])
    lines = table.splitlines()
    assert len({len(line) for line in lines}) == 1
    assert lines[1] == "|--------|------:|"
    assert lines[3] == "| longer |    10 |"


def test_results_markdown_ratios_and_marks():
    text = bench.results_markdown(_fake_rows(), {"gpu": "fake", "commit": None})
    assert "gpu: fake" in text and "commit" not in text
    fwd_line = next(line for line in text.splitlines() if "| fwd " in line)
    assert "2.00x" in fwd_line and "1.50x" in fwd_line and "1.0e-03 ok" in fwd_line
    assert "n/a" in fwd_line, "unavailable provider"
    fwd_bwd_line = next(line for line in text.splitlines() if "| fwd+bwd " in line)
    assert "WRONG" in fwd_bwd_line and "n/a" in fwd_bwd_line, "no cuDNN row: ratio n/a"
    assert "Peak extra memory" in text and "1.50x" in text.split("Peak extra memory")[1]
    assert "sdpa-efficient: unavailable: RuntimeError: no kernel" in text


def test_fa4_is_timed_on_request_only_and_gets_its_ratio_column():
    """fa4 (FlashAttention-4) is a provider --providers accepts but the default leaves out; where it was timed the
    table adds flashtriton / FA4, where it was not the column is absent."""
    assert "fa4" in bench.PROVIDERS and "fa4" not in bench.DEFAULT_PROVIDERS
    assert cli.chosen_providers(cli.build_parser().parse_args(["bench"])) == list(bench.DEFAULT_PROVIDERS)
    assert "fa4" in cli.chosen_providers(cli.build_parser().parse_args(["bench", "--features"]))
    assert "ft/FA4" not in bench.results_markdown(_fake_rows())
    fa4 = bench.BenchRow("fa4", 4, 4096, 16, 128, True, "bf16", "fwd", ms=1.0, tflops=480.0)
    lines = bench.results_markdown(_fake_rows() + [fa4]).splitlines()
    header = next(line for line in lines if "ft/FA4" in line)
    cells = [cell.strip() for cell in next(line for line in lines if "| fwd " in line).split("|")[1:-1]]
    columns = [cell.strip() for cell in header.split("|")[1:-1]]
    assert cells[columns.index("fa4 TF/s")] == "480.0" and cells[columns.index("ft/FA4")] == "1.25x"
    fwd_bwd = [cell.strip() for cell in next(line for line in lines if "| fwd+bwd " in line).split("|")[1:-1]]
    assert fwd_bwd[columns.index("ft/FA4")] == "n/a"


def test_fa4_inputs_keep_the_flash_attn_layout():
    q = torch.randn(2, 5, 3, 4)
    for provider, shape in (("fa4", (2, 5, 3, 4)), ("flashtriton", (2, 5, 3, 4)), ("sdpa-cudnn", (2, 3, 5, 4))):
        assert tuple(bench.provider_inputs(provider, q, q, q, requires_grad=False)[0].shape) == shape


def test_write_results_round_trip(tmp_path):
    result = bench.BenchResult(_fake_rows(), {"gpu": "fake"})
    paths = bench.write_results(result, tmp_path / "out")
    names = {p.name for p in paths}
    assert {"bench.json", "bench.md"} <= names
    try:
        import matplotlib  # noqa: F401
        assert "bench.png" in names
    except ImportError:
        assert "bench.png" not in names
    loaded = bench.load_rows(tmp_path / "out" / "bench.json")
    assert loaded.rows == result.rows and loaded.metadata == {"gpu": "fake"}


def test_git_commit_is_that_of_the_checkout_holding_the_package(tmp_path, monkeypatch):
    """bench.git_commit names the commit of the checkout whose files the package is, and none for a copy of the
    package inside another repository's tree that the repository does not track (its HEAD is not the copy's)."""
    monkeypatch.delenv("FLASHTRITON_COMMIT", raising=False)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("ignored/\n")
    for folder in ("tracked", "ignored"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "bench.py").write_text("")
    subprocess.run(git + ["add", ".gitignore", "tracked"], cwd=tmp_path, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "x"], cwd=tmp_path, check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True,
                          check=True).stdout.strip()

    def commit_of(folder):
        monkeypatch.setattr(bench, "__file__", str(tmp_path / folder / "bench.py"))
        return bench.git_commit()

    assert commit_of("tracked") == head
    assert commit_of("ignored") is None
    # a tracked file changed since HEAD (files copied over an older checkout): HEAD did not run
    (tmp_path / "tracked" / "bench.py").write_text("changed = True\n")
    assert commit_of("tracked") == head + "-dirty"
    monkeypatch.setenv("FLASHTRITON_COMMIT", "abc1234")
    assert commit_of("ignored") == "abc1234"


def test_provider_inputs_keep_the_bshd_memory_layout():
    """Every provider's timed inputs are leaves in (B, S, H, D) memory (the baseline shapes' layout); SDPA sees them as
    (B, H, S, D) views, so no provider pays for a layout copy the others do not."""
    q, k, v = bench.random_inputs(bench.Shape(2, 8, 3, 4), torch.float32, device="cpu")
    for provider in ("flashtriton", "sdpa-flash"):
        for given, taken in zip((q, k, v), bench.provider_inputs(provider, q, k, v, requires_grad=True)):
            assert taken.is_leaf and taken.requires_grad and taken.data_ptr() != given.data_ptr()
            bshd = taken if provider == "flashtriton" else taken.transpose(1, 2)
            assert bshd.is_contiguous() and torch.equal(bshd, given)


def test_bench_config_rows_without_gpu(monkeypatch):
    """bench_config's plumbing on CPU with the CUDA timer and memory probe replaced by stand-ins."""
    monkeypatch.setattr(bench, "median_ms", lambda fn, warmup, rep: (fn(), 2.0)[1])
    monkeypatch.setattr(bench, "peak_memory_mib", lambda fn: (fn(), 1.0)[1])
    captured = []
    monkeypatch.setattr(bench, "graphed", lambda call: captured.append(call) or call)
    shape = bench.Shape(1, 32, 2, 16)
    q, k, v = bench.random_inputs(shape, torch.bfloat16, device="cpu")
    for mode in bench.MODES:
        row = bench.bench_config("flashtriton", shape, True, torch.bfloat16, mode, q, k, v)
        assert row.status == "ok" and row.ms == 2.0, row
        flops = bench.attention_flops(1, 2, 32, 32, 16, True, mode)
        assert row.tflops == pytest.approx(flops / 2e-3 / 1e12)
        assert (row.peak_mem_mib is not None) == (mode == "fwd+bwd")
    assert len(captured) == 1, "fwd+bwd-graph captures its step, no other mode does"
    missing = bench.bench_config("sdpa-cudnn", shape, False, torch.bfloat16, "fwd", q, k, v)
    assert missing.status.startswith("unavailable: ") and missing.ms is None and missing.tflops is None


def test_bench_kernel_timing_reaches_every_row(monkeypatch):
    """--timing kernels times every provider's rows by kernel_ms (not do_bench) and says so in the metadata."""
    monkeypatch.setattr(bench, "median_ms", lambda fn, warmup, rep: pytest.fail("do_bench used"))
    monkeypatch.setattr(bench, "kernel_ms", lambda fn: (fn(), 4.0)[1])
    shape = bench.Shape(1, 32, 2, 16)
    q, k, v = bench.random_inputs(shape, torch.bfloat16, device="cpu")
    row = bench.bench_config("flashtriton", shape, False, torch.bfloat16, "fwd", q, k, v, timing="kernels")
    assert row.status == "ok" and row.ms == 4.0, row
    assert "kernels" in bench.TIMINGS and "wall" in bench.TIMINGS
    with pytest.raises(ValueError, match="timing must be one of"):
        bench.time_ms(lambda: None, "cycles")
    args = cli.build_parser().parse_args(["bench", "--timing", "kernels"])
    assert args.timing == "kernels"


def test_kernel_ms_refuses_a_call_without_gpu_kernels(monkeypatch):
    """A call the profiler saw no GPU kernel of is an error, never 0 ms (infinite TF/s); with kernels, their mean
    time per call. (The profiler is a stand-in: CPU-only torch has no CUDA activity.)"""
    import torch.profiler

    class Event:
        def __init__(self, us):
            self.device_time_total = us

    def profiler(events):
        class Profile:
            def __init__(self, activities):
                assert activities == [torch.profiler.ProfilerActivity.CUDA]

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def key_averages(self):
                return [Event(us) for us in events]
        return Profile

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.profiler, "profile", profiler([]))
    with pytest.raises(RuntimeError, match="no GPU kernel time"):
        bench.kernel_ms(lambda: None, calls=2)
    monkeypatch.setattr(torch.profiler, "profile", profiler([300.0, 100.0]))
    assert bench.kernel_ms(lambda: None, calls=4) == pytest.approx(0.1)


# ---- kernel_inspect.py and env.py: pure parts ---------------------------------------------------------------------

FAKE_SASS = """
        /*0100*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0110*/                   MUFU.EX2 R3, R3 ;
        /*0120*/                   MUFU.EX2 R4, R4 ;
        /*0130*/                   STL [R1], R5 ;
        /*0140*/                   LDL R6, [R1] ;
"""


def test_instruction_counts():
    counts = kernel_inspect.count_patterns(FAKE_SASS, kernel_inspect.SASS_PATTERNS)
    assert counts == {"HGMMA": 1, "HMMA": 0, "MUFU.EX2": 2, "LDL": 1, "STL": 1}
    ptx = "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16 ...\nex2.approx.f32 %f1, %f2;"
    assert kernel_inspect.count_patterns(ptx, kernel_inspect.PTX_PATTERNS)["wgmma"] == 1


# a kernel in cuobjdump's form: a prologue spill, an outer loop (0x0040-0x00e0) holding the key-block loop
# (0x0060-0x00b0, with a barrier wait's retry loop inside it) and an out-of-line retry path after the last HGMMA
# that jumps back into the key-block loop
LOOPED_SASS = """
        /*0000*/                   STL [R1], R5 ;
        /*0010*/                   IMAD.MOV.U32 R2, RZ, RZ, R3 ;
        /*0040*/                   LDL R6, [R1] ;
        /*0050*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0060*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
        /*0070*/              @!P0 BRA 0x60 ;
        /*0080*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0090*/                   {LOAD} ;
        /*00a0*/              @!P1 BRA 0x100 ;
        /*00b0*/               @P2 BRA 0x60 ;
        /*00c0*/                   HGMMA.64x128x16.F32.BF16 R88, R24, gdesc[UR12], R88 ;
        /*00e0*/               @P3 BRA 0x40 ;
        /*00f0*/                   EXIT ;
        /*0100*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R2 ;
        /*0110*/                   BRA 0x90 ;
"""


@pytest.mark.parametrize("load, expected", [("FMUL R7, R7, R8", 0), ("LDL R7, [R1+0x8]", 1),
                                            ("@!P4 STL [R1+0x4], R7", 1)])
def test_hot_loop_local_accesses_counts_the_key_block_loop_only(load, expected):
    """Spills in the prologue and the outer loop are not counted, one in the innermost HGMMA loop is; the retry
    path after the last HGMMA does not make the whole kernel a loop."""
    assert kernel_inspect.hot_loop_local_accesses(LOOPED_SASS.replace("{LOAD}", load)) == expected


def test_hot_loop_local_accesses_reads_nvdisasm_labels_and_needs_a_loop():
    labelled = """
.L_x_0:
        /*0000*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0010*/                   LDL R7, [R1+0x8] ;
        /*0020*/               @P2 BRA `(.L_x_0) ;
        /*0030*/                   HGMMA.64x128x16.F32.BF16 R88, R24, gdesc[UR12], R88 ;
"""
    assert kernel_inspect.hot_loop_local_accesses(labelled) == 1
    assert kernel_inspect.hot_loop_local_accesses(FAKE_SASS) is None  # no loop
    assert kernel_inspect.hot_loop_local_accesses("        /*0000*/    FMUL R1, R2, R3 ;") is None  # no HGMMA


def test_inspect_gates_on_sm90_only():
    good = kernel_inspect.KernelReport("attn_fwd_kernel", 168, 0, 98304, 8, 3, {"wgmma": 4}, {"HGMMA": 4})
    spilling = kernel_inspect.KernelReport("attn_fwd_kernel", 255, 12, 98304, 8, 3, {"wgmma": 0}, {"HGMMA": 0})
    assert kernel_inspect.gate_failures([good], (9, 0)) == []
    failures = kernel_inspect.gate_failures([spilling], (9, 0))
    assert any("wgmma" in f for f in failures) and any("spills" in f for f in failures)
    assert kernel_inspect.gate_failures([spilling], (8, 0)) == []
    # with SASS: spills outside the key-block loop pass, inside it fail
    outside = kernel_inspect.KernelReport("attn_fwd_hopper_kernel", 168, 6, 197120, 4, 1, {"wgmma": 64},
                                          {"HGMMA": 64}, hot_loop_local=0)
    inside = kernel_inspect.KernelReport("attn_fwd_hopper_kernel", 168, 6, 197120, 4, 1, {"wgmma": 64},
                                         {"HGMMA": 64}, hot_loop_local=3)
    assert kernel_inspect.gate_failures([outside], (9, 0)) == []
    assert any("key-block loop" in f for f in kernel_inspect.gate_failures([inside], (9, 0)))
    assert "attn_fwd_kernel" in kernel_inspect.reports_table([good])


def test_env_old_gpu_reason_and_cpu_path():
    assert env.OLD_GPU_REASON == "FlashAttention only supports Ampere GPUs or newer."
    assert "interpreter" in env.cpu_path_description(True)
    assert "reference" in env.cpu_path_description(False)

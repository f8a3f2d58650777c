"""benchmarks/bench_host.py's table on CPU: the script imports without a GPU, its markdown puts each provider's host
time in its column with the ratio to SDPA flash, and a provider that could not run shows its error."""


def test_markdown_columns_ratio_and_errors(benchmark_script):
    bench_host = benchmark_script("bench_host")
    table = {"forward (no grad)": {"flashtriton": 120.0, "sdpa-flash": 40.0, "fa4": "unavailable: ImportError: x"}}
    text = bench_host.markdown(table, ["flashtriton", "sdpa-flash", "fa4"], [(4, 65536, 2.7, 3.0)])
    lines = text.splitlines()
    assert lines[0] == "| call | flashtriton | sdpa-flash | fa4 | flashtriton / sdpa-flash |"
    assert lines[2] == "| forward (no grad) | 120.0 µs | 40.0 µs | unavailable: ImportError: x | 3.00 |"
    assert lines[-1] == "| 4 × 65536 | 2.70 | 3.00 | 90% |"


def test_missing_ratio_when_a_side_did_not_run(benchmark_script):
    bench_host = benchmark_script("bench_host")
    table = {"backward": {"flashtriton": 50.0, "sdpa-flash": "unavailable: RuntimeError: no GPU"}}
    assert bench_host.markdown(table, ["flashtriton", "sdpa-flash"], []).splitlines()[-1].endswith("| — |")


def test_a_provider_that_cannot_run_fills_every_row_with_its_error(benchmark_script):
    bench_host = benchmark_script("bench_host")
    table = bench_host.host_table(["no-such-provider"], calls=1, repeat=1)
    assert set(table) == set(bench_host.CALLS)
    assert all(row["no-such-provider"].startswith("unavailable: ValueError") for row in table.values())

"""Benchmark flashtriton against PyTorch SDPA backends; the same harness and options as `flashtriton bench`.

    python benchmarks/bench_attention.py --shapes baseline --modes fwd,bwd,fwd+bwd --dtype bf16

Results (bench.json rows with metadata, bench.md, and bench.png when matplotlib is installed) go to --out,
by default benchmarks/results/<UTC date>-<commit>/.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from flashtriton.bench import git_commit
from flashtriton.cli import add_bench_arguments, bench_command


def default_out_dir() -> Path:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path(__file__).resolve().parent / "results" / f"{stamp}-{git_commit() or 'nocommit'}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(parser, default_out=str(default_out_dir()))
    return bench_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

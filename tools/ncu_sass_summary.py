"""Summarize Nsight Compute's per-instruction SASS table for each profiled kernel: the instruction mix (share of
executed instructions per opcode) and the warp-stall mix (share of stall samples per reason), and optionally the
hot instructions of one kernel with their stall samples. Made to compare the Gluon forward with cuDNN's kernel,
whose source we do not have but whose SASS ncu shows.

On the GPU machine (one call, ~1 min; the forward calls of the script are compiled before ncu starts):

    python tools/ncu_forward_pair.py --shapes 1     # compile first
    ncu --clock-control none -k regex:"attn_fwd_hopper_kernel|cudnn_generated" --section SourceCounters \\
        --section WarpStateStats --section InstructionStats -o $OUT/fwd python tools/ncu_forward_pair.py --shapes 1
    ncu -i $OUT/fwd.ncu-rep --page source --print-source sass --csv > $OUT/sass.csv

Here:

    python tools/ncu_sass_summary.py sass.csv [--hot KERNEL_INDEX] [--min-share 0.7] [--by-count]

--hot prints that kernel's instructions executed at least --min-share times as often as its most executed one
(a loop body) or with more than 300 stall samples, each with its non-zero stall reasons; --by-count groups each
kernel's instructions by execution count (a loop body's share one) with their stall samples.
"""

from __future__ import annotations

import argparse
import collections
import csv

STALLS_SHOWN = ("stall_barrier", "stall_wait", "stall_long_sb", "stall_short_sb", "stall_dispatch", "stall_selected",
                "stall_math", "stall_mio")


def read_kernels(path: str) -> list:
    """[{"name", "header", "rows"}] per kernel of an `ncu --page source --csv` export."""
    kernels = []
    with open(path, newline="") as handle:
        for row in csv.reader(handle):
            if len(row) >= 2 and row[0] == "Kernel Name":
                kernels.append({"name": row[1], "rows": []})
            elif row and row[0] == "Address" and kernels:
                kernels[-1]["header"] = row
            elif kernels and "header" in kernels[-1] and len(row) > 5:
                kernels[-1]["rows"].append(row)
    return kernels


def _opcode(source: str) -> str:
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def _columns(header: list) -> tuple:
    """(executed, samples, stalls) column indices of an export's header: instructions executed, stall samples, and
    each stall reason's samples (the "(Not Issued)" duplicates left out)."""
    stalls = [i for i, name in enumerate(header) if name.startswith("stall_") and "Not Issued" not in name]
    return header.index("Instructions Executed"), header.index("Warp Stall Sampling (All Samples)"), stalls


def _count_stalls(counter, header: list, row: list, stall_columns: list) -> None:
    """Add a row's stall samples to counter, by reason."""
    for i in stall_columns:
        counter[header[i][len("stall_"):]] += int(row[i] or 0)


def summary(kernel: dict, top: int = 14) -> str:
    header = kernel["header"]
    executed, samples, stall_columns = _columns(header)
    opcodes, stalls = collections.Counter(), collections.Counter()
    sampled = 0
    for row in kernel["rows"]:
        opcodes[_opcode(row[1])] += int(row[executed] or 0)
        sampled += int(row[samples] or 0)
        _count_stalls(stalls, header, row, stall_columns)
    total = sum(opcodes.values())
    mix = ", ".join(f"{name} {count / total:.1%}" for name, count in opcodes.most_common(top))
    stall_mix = ", ".join(f"{name} {count / max(sampled, 1):.1%}" for name, count in stalls.most_common(8))
    return (f"{kernel['name'][:100]}\n  instructions {total:,}, stall samples {sampled:,}\n  opcodes: {mix}\n"
            f"  stalls: {stall_mix}")


def hot_instructions(kernel: dict, min_share: float) -> list:
    header = kernel["header"]
    executed, samples, _ = _columns(header)
    columns = {name: header.index(name) for name in STALLS_SHOWN if name in header}
    most = max(int(row[executed] or 0) for row in kernel["rows"])
    lines = []
    for row in kernel["rows"]:
        count, sampled = int(row[executed] or 0), int(row[samples] or 0)
        if count >= min_share * most or sampled > 300:
            reasons = " ".join(f"{name[len('stall_'):]}={row[i]}" for name, i in columns.items() if row[i] not in
                               ("0", ""))
            lines.append(f"{row[0][-6:]} {count / most:5.2f} samples={sampled:>5} {row[1].strip()[:70]:70s} {reasons}")
    return lines


def by_execution_count(kernel: dict, top: int = 8) -> list:
    """The kernel's instructions grouped by how often each executed (a loop body's instructions share one count, a
    tile's prologue and epilogue another: the forward's seam against its key-block loop), the groups holding the
    most stall samples first: count per instruction, instructions, executed in all, stall samples and their share,
    the leading stall reasons."""
    header = kernel["header"]
    executed, samples, stall_columns = _columns(header)
    groups = collections.defaultdict(lambda: {"instructions": 0, "samples": 0, "stalls": collections.Counter()})
    for row in kernel["rows"]:
        group = groups[int(row[executed] or 0)]
        group["instructions"] += 1
        group["samples"] += int(row[samples] or 0)
        _count_stalls(group["stalls"], header, row, stall_columns)
    total = max(sum(group["samples"] for group in groups.values()), 1)
    lines = []
    for count, group in sorted(groups.items(), key=lambda item: -item[1]["samples"])[:top]:
        reasons = ", ".join(f"{name}={value}" for name, value in group["stalls"].most_common(4) if value)
        instructions = group["instructions"]
        lines.append(f"  executed {count:>9,} x {instructions:>5} instructions ({count * instructions:>12,}): samples "
                     f"{group['samples']:>6} ({group['samples'] / total:.1%}) {reasons}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--hot", type=int, help="index of the kernel whose hot instructions to print")
    parser.add_argument("--min-share", type=float, default=0.7)
    parser.add_argument("--by-count", action="store_true",
                        help="also each kernel's instructions grouped by execution count (loop bodies, per-tile code)")
    args = parser.parse_args()
    kernels = read_kernels(args.csv)
    for index, kernel in enumerate(kernels):
        print(f"[{index}] {summary(kernel)}")
        if args.by_count:
            print("\n".join(by_execution_count(kernel)))
    if args.hot is not None:
        print("\n".join(hot_instructions(kernels[args.hot], args.min_share)))


if __name__ == "__main__":
    main()

"""tools/ncu_sass_summary.py on a small `ncu --page source --csv` export written here: per-kernel opcode and stall
shares, and the hot-instruction filter; tools/ncu_forward_pair.py's refusal without a GPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import ncu_sass_summary  # noqa: E402

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_barrier",'
          '"stall_wait","stall_barrier (Not Issued)"')


def _export(tmp_path) -> str:
    lines = ['"Kernel Name","ours",', HEADER,
             '"0x10","      FFMA R1, R2, R3, R4","30","100","20","10","5"',
             '"0x20","  @!P0  BRA 0x40","10","100","0","10","0"',
             '"0x30","      MUFU.EX2 R1, R1","0","20","0","0","0"',
             '"Kernel Name","theirs",', HEADER,
             '"0x10","      FADD R1, R2, R3","5","50","5","0","0"']
    path = tmp_path / "sass.csv"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_summary_shares_per_kernel(tmp_path):
    ours, theirs = ncu_sass_summary.read_kernels(_export(tmp_path))
    text = ncu_sass_summary.summary(ours)
    assert "instructions 220, stall samples 40" in text
    assert "FFMA 45.5%, BRA 45.5%, MUFU 9.1%" in text
    assert "barrier 50.0%, wait 50.0%" in text  # the "(Not Issued)" column is not counted again
    assert "FADD 100.0%" in ncu_sass_summary.summary(theirs)


def test_hot_instructions_are_the_loop_body(tmp_path):
    ours, _ = ncu_sass_summary.read_kernels(_export(tmp_path))
    hot = ncu_sass_summary.hot_instructions(ours, 0.7)
    assert len(hot) == 2 and "FFMA R1, R2, R3, R4" in hot[0] and "@!P0  BRA" in hot[1]  # MUFU ran 0.2x as often
    assert "barrier=20 wait=10" in hot[0]


def test_instructions_grouped_by_execution_count(tmp_path):
    """FFMA and BRA ran 100 times each (a loop body), MUFU 20: two groups, the loop's with all 40 samples first."""
    ours, _ = ncu_sass_summary.read_kernels(_export(tmp_path))
    loop, once = ncu_sass_summary.by_execution_count(ours)
    assert "executed       100 x     2 instructions" in loop and "samples     40 (100.0%)" in loop
    assert "barrier=20, wait=20" in loop
    assert "executed        20 x     1 instructions" in once and "samples      0 (0.0%)" in once


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_forward_pair_says_it_needs_a_gpu():
    """tools/ncu_forward_pair.py (what ncu profiles) exits 2 with a message where there is no CUDA GPU."""
    script = Path(__file__).resolve().parents[1] / "tools" / "ncu_forward_pair.py"
    done = subprocess.run([sys.executable, str(script), "--shapes", "1"], capture_output=True, text=True)
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr

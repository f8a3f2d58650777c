"""benchmarks/fp8_p_precision.py on CPU: each format's operand is what that format holds, and at a small shape the
emulation separates the P.V operands the FP8 design rests on (fp16 and two e4m3 pieces within the 3x RMSE bar of
issue 42, one e4m3 product far outside it)."""

import torch


def test_rounded_operands_are_their_formats_values(benchmark_script):
    script = benchmark_script("fp8_p_precision")
    relative = torch.rand(4096, dtype=torch.float64)
    for fmt, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("e4m3", torch.float8_e4m3fn),
                       ("e5m2", torch.float8_e5m2)):
        held = script.rounded(relative, fmt)
        assert torch.equal(held, held.to(dtype).double()), fmt
        assert torch.equal(held, relative.to(dtype).double()), fmt
    scaled = script.rounded(relative, "e4m3 x 448") * 448
    assert torch.equal(scaled, scaled.to(torch.float8_e4m3fn).double())
    # two e4m3 pieces: within fp16's relative step where P is not tiny; one piece: e4m3's 2^-4
    normal = relative > 2 ** -6
    two = (script.rounded(relative, "e4m3 hi + lo") - relative).abs()[normal] / relative[normal]
    one = (script.rounded(relative, "e4m3") - relative).abs()[normal] / relative[normal]
    assert two.max() <= 2 ** -8 and one.max() <= 2 ** -4 and one.max() > 2 ** -6


def test_formats_against_the_bf16_path(capsys, benchmark_script):
    script = benchmark_script("fp8_p_precision")
    bf16_rmse, errors = script.measure((1, 256, 2, 64), causal=True, seed=0)
    assert set(errors) == set(script.FORMATS) and bf16_rmse > 0
    ratios = {fmt: error / bf16_rmse for fmt, error in errors.items()}
    assert ratios["fp16"] < 1.5 and ratios["e4m3 hi + lo"] < 1.5 and 0.5 < ratios["bf16"] < 2
    assert ratios["e4m3"] > 4 and ratios["e4m3 x 448"] > 4 and ratios["e5m2"] > ratios["e4m3"]
    assert script.main(["--batch", "1", "--seqlen", "64", "--heads", "1", "--head-dim", "32"]) == 0
    assert "| e4m3 hi + lo |" in capsys.readouterr().out

"""benchmarks/ablate_kernel.py's variant modules: an edited copy of a kernel module runs the edited kernel (checked
through Triton's interpreter on CPU), the unmodified copy the original, and an edit that does not apply is an error."""

import sys
from pathlib import Path

import pytest
import torch

from flashtriton.ops.backend import KERNELS_INTERPRETED

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ablate_kernel  # noqa: E402

FILL = "flashtriton/kernels/fill.py"


def _filled(module, value: float) -> torch.Tensor:
    """Rows 6..9 of a (10, 3, 4) zero tensor filled with `value` by the module's fill kernel (covered rows: 0..5)."""
    tensor = torch.zeros(10, 3, 4)
    cu_seqlens = torch.tensor([0, 6], dtype=torch.int32)
    module.fill_uncovered_rows_kernel[(2, 3)](tensor, cu_seqlens, 1, 10, 4, *tensor.stride(), value, BLOCK_R=8,
                                              BLOCK_B=4)
    return tensor


@pytest.mark.skipif(not KERNELS_INTERPRETED, reason="runs the kernel through Triton's interpreter (TRITON_INTERPRET=1)")
def test_variant_module_runs_the_edited_kernel(tmp_path):
    as_is = ablate_kernel.variant_module(FILL, [], "ablate_test_as_is", str(tmp_path))
    doubled = ablate_kernel.variant_module(FILL, [("tl.full([BLOCK_R, BLOCK_B], fill,",
                                                   "tl.full([BLOCK_R, BLOCK_B], 2 * fill,")],
                                           "ablate_test_doubled", str(tmp_path))
    for module, expected in ((as_is, 1.5), (doubled, 3.0)):
        out = _filled(module, 1.5)
        assert torch.equal(out[:6], torch.zeros(6, 3, 4))
        assert torch.equal(out[6:], torch.full((4, 3, 4), expected))


def test_variant_module_rejects_an_edit_that_does_not_apply(tmp_path):
    with pytest.raises(ValueError, match="does not occur"):
        ablate_kernel.variant_module(FILL, [("no such text", "")], "ablate_test_missing", str(tmp_path))


@pytest.mark.parametrize("variants_file", sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "ablations")
                                                 .glob("*.py")), ids=lambda path: path.stem)
def test_ablation_edits_apply_to_their_kernel_module(variants_file):
    """Every edit of every checked-in ablation still finds its text in the kernel it edits (so a GPU run of it
    cannot fail on a kernel changed since), and its TARGET names the kernel."""
    import runpy

    spec = runpy.run_path(str(variants_file))
    source = (Path(__file__).resolve().parents[1] / spec["MODULE"]).read_text()
    assert f"def {spec['KERNEL']}(" in source
    assert spec["TARGET"].endswith(":" + spec["KERNEL"])
    for name, edits in spec["VARIANTS"].items():
        for old, _ in edits:
            assert old in source, (name, old)
    for name in spec.get("CONFIGS", {}):
        assert name in spec["VARIANTS"], name
        with ablate_kernel.config_overrides(spec, name):  # every field it names exists
            pass


def test_config_overrides_apply_while_the_variant_runs_and_are_restored():
    from flashtriton import configs

    before = dict(configs.HOPPER_FWD)
    spec = {"CONFIGS": {"wide": {"HOPPER_FWD": {(256, True): dict(block_n=128, stages=1)}}}}
    with ablate_kernel.config_overrides(spec, "wide"):
        assert (configs.HOPPER_FWD[256, True].block_n, configs.HOPPER_FWD[256, True].stages) == (128, 1)
        assert configs.HOPPER_FWD[256, False] is before[256, False]
    assert configs.HOPPER_FWD == before
    with ablate_kernel.config_overrides(spec, "as is"):
        assert configs.HOPPER_FWD == before
    with pytest.raises(TypeError):
        bad = {"CONFIGS": {"bad": {"HOPPER_FWD": {(256, False): dict(no_such_field=1)}}}}
        with ablate_kernel.config_overrides(bad, "bad"):
            pass
    assert configs.HOPPER_FWD == before


@pytest.mark.skipif(KERNELS_INTERPRETED, reason="compiles for sm_90 (with TRITON_INTERPRET=1 the kernels' Triton "
                                                 "helpers are interpreter functions, which Gluon cannot compile)")
def test_offline_compiles_every_variant(tmp_path, capsys):
    """--offline compiles the unmodified kernel and each variant for sm_90 without a GPU (tools/offline_compile.py)
    and prints each one's resource usage: a variant that does not compile fails here, before device time."""
    spec = dict(MODULE="flashtriton/kernels/fwd_hopper.py", TARGET="flashtriton.ops.hopper_fwd:attn_fwd_hopper_kernel",
                KERNEL="attn_fwd_hopper_kernel", OFFLINE=dict(kind="fwd-hopper", head_dim=64),
                VARIANTS={"ping-pong off": [("    if PINGPONG:\n", "    if False:\n")]})
    modules = {"as is": ablate_kernel.variant_module(spec["MODULE"], [], "ablate_offline_as_is", str(tmp_path)),
               "ping-pong off": ablate_kernel.variant_module(spec["MODULE"], spec["VARIANTS"]["ping-pong off"],
                                                             "ablate_offline_variant", str(tmp_path))}
    ablate_kernel.compile_offline(spec, modules)
    lines = [line for line in capsys.readouterr().out.splitlines() if "REG:" in line]
    assert [line.split(":")[0] for line in lines] == ["as is causal=False", "as is causal=True",
                                                     "ping-pong off causal=False", "ping-pong off causal=True"]


def test_only_loads_the_named_variants(tmp_path):
    variants = str(Path(__file__).resolve().parents[1] / "benchmarks" / "ablations" / "fwd_hopper.py")
    _, modules = ablate_kernel.load_variants(variants, str(tmp_path), ["no LSE store"])
    assert list(modules) == ["as is", "no LSE store"]
    with pytest.raises(ValueError, match="no variant"):
        ablate_kernel.load_variants(variants, str(tmp_path), ["no such variant"])


@pytest.mark.skipif(not KERNELS_INTERPRETED, reason="runs the kernel through Triton's interpreter (TRITON_INTERPRET=1)")
def test_sources_load_other_versions_of_the_module(tmp_path):
    """--sources: each file is a whole other version of MODULE, loaded as a variant named by the file's stem, whose
    kernel is the one that runs; a stem that collides with a variant's name is an error."""
    other = tmp_path / "tripled.py"
    other.write_text((Path(__file__).resolve().parents[1] / FILL).read_text()
                     .replace("tl.full([BLOCK_R, BLOCK_B], fill,", "tl.full([BLOCK_R, BLOCK_B], 3 * fill,"))
    variants = tmp_path / "variants.py"
    variants.write_text(f"MODULE = {FILL!r}\nVARIANTS = {{'tripled': []}}\n")
    _, modules = ablate_kernel.load_variants(str(variants), str(tmp_path), ["tripled"])
    with pytest.raises(ValueError, match="rename the file"):
        ablate_kernel.load_variants(str(variants), str(tmp_path), sources=[str(other)])
    variants.write_text(f"MODULE = {FILL!r}\nVARIANTS = {{}}\n")
    _, modules = ablate_kernel.load_variants(str(variants), str(tmp_path), sources=[str(other)])
    assert list(modules) == ["as is", "tripled"]
    assert torch.equal(_filled(modules["as is"], 1.5)[6:], torch.full((4, 3, 4), 1.5))
    assert torch.equal(_filled(modules["tripled"], 1.5)[6:], torch.full((4, 3, 4), 4.5))


def test_rounds_rotate_the_first_slot():
    order = []
    times = ablate_kernel.rotated_rounds(["a", "b", "c"], 4, lambda name: order.append(name) or len(order))
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert times == {"a": [1, 6, 8, 10], "b": [2, 4, 9, 11], "c": [3, 5, 7, 12]}

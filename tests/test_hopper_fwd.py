"""The warp-specialized Gluon forward (kernels/hopper/fwd.py) against the float64 reference.

It runs only on sm_90 GPUs (Gluon has no interpreter), so most of this file is skipped elsewhere; the CPU part
checks the routing rule and the configs. Every GPU case asserts that the Gluon kernel actually ran (or, for the
cases it does not cover, that it did not), NaN-poisons the outputs and applies the tolerance rule of docs/api.md §4.10.
"""

import dataclasses
import functools
import sys
from pathlib import Path

import pytest
import torch

import flashtriton
from flashtriton import configs
from flashtriton.ops import hopper
from flashtriton.ops.backend import KERNELS_INTERPRETED
from flashtriton.scores import score_params
from flashtriton.testing import Case, assert_checks_ok, compare_varlen_with_reference, cu_seqlens, \
    compare_with_reference, forced_heads_per_group, forced_hopper_grid, make_case_inputs, poisoned_outputs, \
    run_forward_case

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not ON_HOPPER or hopper.attn_fwd_hopper_kernel is None,
                                  reason="the Gluon forward runs on sm_90 only")
# shared memory per program on sm_90 (227 KiB opt-in) minus what the kernel's barriers take
SM90_SHARED_BYTES = 227 * 1024 - 1024


def test_cpu_tensors_never_take_the_gluon_path():
    q = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    params = score_params(0.1, False, -1, -1, 0.0, 64)
    for direction in hopper.DIRECTIONS:
        assert hopper.covers(direction, 128, q.dtype, 64, 64, params, True)
        assert not hopper.gluon_runs(direction, q, params, 64, 64, True, (q, q, q, q))
    with pytest.raises(ValueError, match="direction"):
        hopper.covers("forward", 128, q.dtype, 64, 64, params, True)


COVERS = {  # name: (head_dim, dtype, seqlen_q, seqlen_k, causal, window, softcap, scale, plain, covered)
    "d128-bf16": (128, torch.bfloat16, 1000, 1000, False, (-1, -1), 0.0, 0.1, True, True),
    "d64-fp16-causal-sq>sk": (64, torch.float16, 700, 300, True, (-1, -1), 0.0, 0.1, True, True),
    "d256-window-wider-than-keys": (256, torch.bfloat16, 100, 100, False, (500, 500), 0.0, 0.1, True, True),
    "fp32": (128, torch.float32, 1000, 1000, False, (-1, -1), 0.0, 0.1, True, False),
    "d96-on-128-tiles": (96, torch.bfloat16, 1000, 1000, False, (-1, -1), 0.0, 0.1, True, True),
    "d192-on-256-tiles": (192, torch.bfloat16, 1000, 1000, True, (-1, -1), 0.0, 0.1, True, True),
    "d32-on-64-tiles": (32, torch.float16, 1000, 1000, False, (-1, -1), 0.0, 0.1, True, True),
    "d512-on-split-tiles": (512, torch.bfloat16, 1000, 1000, False, (-1, -1), 0.0, 0.1, True, True),
    "d320-causal-on-split-tiles": (320, torch.float16, 700, 300, True, (-1, -1), 0.0, 0.1, True, True),
    "d640": (640, torch.bfloat16, 1000, 1000, False, (-1, -1), 0.0, 0.1, True, False),
    "decode-rows": (128, torch.bfloat16, 16, 1000, False, (-1, -1), 0.0, 0.1, True, False),
    "no-keys": (128, torch.bfloat16, 100, 0, False, (-1, -1), 0.0, 0.1, True, False),
    "local-window": (128, torch.bfloat16, 1000, 1000, False, (64, 0), 0.0, 0.1, True, True),
    "causal-local": (128, torch.bfloat16, 1000, 1000, True, (64, -1), 0.0, 0.1, True, True),
    "two-sided-window": (64, torch.float16, 700, 300, False, (20, 45), 0.0, 0.1, True, True),
    "softcap": (128, torch.bfloat16, 1000, 1000, False, (-1, -1), 5.0, 0.1, True, False),
    "negative-scale": (128, torch.bfloat16, 1000, 1000, False, (-1, -1), 0.0, -0.1, True, False),
    "not-plain": (128, torch.bfloat16, 1000, 1000, False, (-1, -1), 0.0, 0.1, False, False),
}


@pytest.mark.parametrize("name", list(COVERS))
def test_gluon_forward_coverage_rule(name):
    """What the Gluon kernel takes; everything else must stay on the Triton kernel (checked on CPU: pure rule). The
    backward with dQ in a fixed order (deterministic=True) takes no local window."""
    head_dim, dtype, seqlen_q, seqlen_k, causal, window, softcap, scale, plain, covered = COVERS[name]
    params = score_params(scale, causal, *window, softcap, seqlen_k)
    assert hopper.covers("fwd", head_dim, dtype, seqlen_q, seqlen_k, params, plain) == covered
    if hopper.local_window(params, seqlen_k) and hopper.can_order_dq(head_dim):
        assert not hopper.covers("bwd", head_dim, dtype, seqlen_q, seqlen_k, params, plain, deterministic=True)
    if configs.hopper_bwd_tile_dim(head_dim) is None:
        assert not hopper.covers("bwd", head_dim, dtype, seqlen_q, seqlen_k, params, plain)


def test_v_head_dim_of_its_own_takes_the_gluon_forward_and_the_mla_backward():
    """The forward takes V's own head dim (q / k and v / out tiles of their own widths, both up to 256); the backward
    only where q / k run the dK / dV only tiles (192, 256) and V's are 128 wide (MLA-style)."""
    params = score_params(0.1, True, -1, -1, 0.0, 1000)
    for head_dim, head_dim_v, covered, backward in ((192, 128, True, True), (256, 128, True, True),
                                                    (128, 64, True, False), (64, 256, True, False),
                                                    (256, 320, False, False), (320, 128, False, False)):
        assert hopper.covers("fwd", head_dim, torch.bfloat16, 1000, 1000, params, True,
                             head_dim_v=head_dim_v) == covered
        assert hopper.covers("bwd", head_dim, torch.bfloat16, 1000, 1000, params, True,
                             head_dim_v=head_dim_v) == backward


def test_head_dims_between_tile_classes_take_the_next_wider_tiles():
    assert [configs.hopper_fwd_tile_dim(d) for d in (8, 64, 72, 80, 96, 112, 128, 136, 192, 200, 256, 264)] == \
        [64, 64, 80, 80, 96, 128, 128, 192, 192, 256, 256, None]


def test_every_tile_class_has_power_of_two_chunks_that_add_up():
    """configs.HOPPER_FWD_CHUNKS: one or two chunks per tile class (the kernel's descriptors: q_desc, q_desc2),
    power-of-two widths of at least 16 (Gluon's shared layouts; a bf16 wgmma's K), summing to the class's head dim,
    the widest first (the second chunk starts at the first one's width)."""
    assert set(configs.HOPPER_FWD_CHUNKS) == set(configs.HOPPER_FWD_HEAD_DIMS)
    for tile_dim, widths in configs.HOPPER_FWD_CHUNKS.items():
        assert 1 <= len(widths) <= 2 and sum(widths) == tile_dim and list(widths) == sorted(widths, reverse=True)
        assert all(width >= 16 and width & (width - 1) == 0 for width in widths), widths


def config_ids(key) -> str:
    head_dim, causal = key
    return f"d{head_dim}-{'causal' if causal else 'full'}"


@pytest.mark.parametrize("key", sorted(configs.HOPPER_FWD), ids=config_ids)
def test_hopper_configs_fit_shared_memory(key):
    """One 64-row Q tile per consumer plus `stages` K and V tiles of block_n rows (16-bit elements) fit one
    program."""
    config = configs.HOPPER_FWD[key]
    row_bytes = 2 * key[0]
    assert (64 * config.consumers + 2 * config.stages * config.block_n) * row_bytes <= SM90_SHARED_BYTES


@pytest.mark.parametrize("fields,message", [(dict(consumers=4), "consumers must be 2 or 3"),
                                            (dict(consumers=3, pingpong=True), "pingpong takes turns between two")])
def test_hopper_config_rejects_what_the_kernel_cannot_run(fields, message):
    with pytest.raises(ValueError, match=message):
        configs.HopperFwdConfig(128, 2, 160, **fields)


def with_consumers(config: configs.HopperFwdConfig, consumers: int) -> configs.HopperFwdConfig:
    """config with 2 or 3 consumer warpgroups and the registers the kernel gives them elsewhere (232 for two; 160,
    what a program of four warpgroups leaves each, for three)."""
    regs = config.consumer_regs if consumers == config.consumers else {2: 232, 3: 160}[consumers]
    return dataclasses.replace(config, consumers=consumers, consumer_regs=regs)


SHAPES = [(17, 17), (33, 1), (128, 128), (300, 700), (700, 300), (1000, 1000), (129, 4100)]


@needs_hopper
@pytest.mark.parametrize("programs", [None, 3], ids=["configured-grid", "3-programs"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", configs.HOPPER_FWD_HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("seqlen_q,seqlen_k", SHAPES, ids=[f"sq{a}-sk{b}" for a, b in SHAPES])
def test_gluon_forward_matches_reference(seqlen_q, seqlen_k, head_dim, dtype, causal, programs):
    """Odd lengths (partial query and key tiles, a single key block), sq > sk under the causal mask (rows that see
    no key: out 0, LSE +inf; tiles whose rows all precede the first key), both 16-bit dtypes, every head dim the
    kernel takes; the configured grid, and 3 programs that each run many tiles of different lengths (barrier
    phases carried across tiles, Q / O tiles reused)."""
    with forced_hopper_grid(programs):
        checks, ran = run_forward_case(Case(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_heads=3, num_heads_k=3,
                                            head_dim=head_dim, dtype=dtype, causal=causal))
    assert ran, "the Gluon forward did not run"
    assert_checks_ok(checks)


ALIBI_CASES = {  # name: (head dim, window, seqlen_q, seqlen_k, causal)
    "d128-pure-causal": (128, (-1, -1), 1000, 1000, True),
    "d64-causal-sq-over-sk": (64, (-1, -1), 700, 300, True),
    "d256-causal-window": (256, (150, 0), 600, 800, True),
    "d96-causal-window": (96, (33, 0), 500, 500, False),
    "full-stays-on-triton": (128, (-1, -1), 500, 500, False),
}


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(ALIBI_CASES))
def test_gluon_forward_alibi(name, dtype):
    """ALiBi on the Gluon forward for causal-like calls (window_right 0; FA2's pure-causal LSE configuration
    included): per-(batch, head) slopes, sq != sk, windows, a padded head dim; non-causal calls stay on the Triton
    kernel (their distances spill the Gluon forward's registers)."""
    head_dim, window, seqlen_q, seqlen_k, causal = ALIBI_CASES[name]
    if window != (-1, -1):
        window = (window[0], 0)
    gluon = causal or window[1] == 0
    for programs in (None, 3):
        with forced_hopper_grid(programs):
            checks, ran = run_forward_case(Case(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_heads=4,
                                                num_heads_k=2, head_dim=head_dim, dtype=dtype, causal=causal,
                                                window_size=window, alibi=True))
        assert ran == gluon, f"the Gluon forward {'did not run' if gluon else 'ran'}"
        assert_checks_ok(checks)


VARLEN_CASES = {  # name: (lengths of q, lengths of k, heads, kv heads, head dim, V's head dim, options)
    "mixed-causal": ([300, 1, 0, 129, 1000, 64], [300, 1, 0, 129, 1000, 64], 4, 4, 128, 128, dict(causal=True)),
    "mixed-full-gqa": ([200, 17, 513, 0, 90], [250, 0, 513, 33, 70], 6, 2, 64, 64, dict()),
    "sq-over-sk-causal": ([400, 70, 129], [100, 300, 64], 2, 1, 128, 128, dict(causal=True)),
    "window": ([700, 333, 18], [700, 333, 18], 4, 2, 128, 128, dict(window_size=(100, 20))),
    "d96-dv64": ([257, 40, 600], [257, 40, 600], 3, 3, 96, 64, dict(causal=True)),
    "d256": ([130, 390], [390, 130], 2, 2, 256, 256, dict()),
}


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_gluon_forward_varlen(name, dtype):
    """Packed sequences (flash_attn_varlen_func) on the Gluon forward: lengths not a multiple of the tiles, empty
    query or key sequences, sq != sk both ways, GQA, windows, head dims between tile classes and V's own; rows past
    the last sequence hold NaN in q, k and v (a read of them would reach the output: V's rows past each sequence's
    keys are cleared before P V); NaN-poisoned outputs against the float64 reference, every row (uncovered rows: out
    0, LSE +inf); the configured grid and 3 programs (persistent varlen grids schedule dynamically: each program
    takes the next untaken tile, its consumers learning it from the producer)."""
    lengths_q, lengths_k, heads, heads_k, head_dim, head_dim_v, options = VARLEN_CASES[name]
    cu_q, cu_k = cu_seqlens(lengths_q, "cuda"), cu_seqlens(lengths_k, "cuda")
    padding = 37
    q = torch.randn(sum(lengths_q) + padding, heads, head_dim, device="cuda").to(dtype)
    k = torch.randn(sum(lengths_k) + padding, heads_k, head_dim, device="cuda").to(dtype)
    v = torch.randn(sum(lengths_k) + padding, heads_k, head_dim_v, device="cuda").to(dtype)
    for tensor, covered in ((q, sum(lengths_q)), (k, sum(lengths_k)), (v, sum(lengths_k))):
        tensor[covered:] = float("nan")
    for grid in (None, 3):
        before = hopper.fwd_launch_count
        with forced_hopper_grid(grid), poisoned_outputs():
            out, lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                             return_attn_probs=True, **options)
        assert hopper.fwd_launch_count == before + 1, "the Gluon forward did not run"
        covered = sum(lengths_q)
        clean = [t[:sum(lengths)] for t, lengths in ((q, lengths_q), (k, lengths_k), (v, lengths_k))]
        assert_checks_ok(compare_varlen_with_reference(out[:covered], lse[:, :covered], *clean, cu_q.cpu(),
                                                       cu_k.cpu(), max(lengths_k), **options))
        assert torch.equal(out[covered:], torch.zeros_like(out[covered:]))
        assert torch.isinf(lse[:, covered:]).all()


@needs_hopper
@pytest.mark.parametrize("side", ["no-key-rows", "no-query-rows"])
def test_varlen_without_rows_takes_the_triton_kernel(side):
    """Packed q or k of zero rows (every sequence empty on that side): no tensor descriptor has zero rows, so the
    Triton forward runs; out 0 and LSE +inf where no key is seen."""
    lengths_q, lengths_k = ([16, 5], [0, 0]) if side == "no-key-rows" else ([0, 0], [16, 5])
    cu_q, cu_k = cu_seqlens(lengths_q, "cuda"), cu_seqlens(lengths_k, "cuda")
    q = torch.randn(sum(lengths_q), 2, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lengths_k), 2, 64, device="cuda", dtype=torch.bfloat16)
    before = hopper.fwd_launch_count
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_varlen_func(q, k, torch.randn_like(k), cu_q, cu_k, 32, 32,
                                                         return_attn_probs=True)
    assert hopper.fwd_launch_count == before, "the Gluon forward ran"
    assert out.shape == q.shape and torch.equal(out, torch.zeros_like(out))
    assert torch.isinf(lse).all()


PADDED_HEAD_DIMS = [8, 40, 72, 112, 136, 160, 200]


WIDE_CASES = {  # name: (head dim, window, seqlen_q, seqlen_k, causal, heads, kv heads, layout)
    "d512-full": (512, (-1, -1), 300, 700, False, 4, 2, "contiguous"),
    "d512-causal-sq-over-sk": (512, (-1, -1), 700, 300, True, 4, 4, "contiguous"),
    "d512-causal-odd": (512, (-1, -1), 1000, 1000, True, 3, 1, "contiguous"),
    "d512-window": (512, (90, 17), 333, 500, False, 2, 2, "contiguous"),
    "d512-single-row-block": (512, (-1, -1), 17, 33, False, 2, 2, "contiguous"),
    "d320-causal-wider-rows": (320, (-1, -1), 300, 300, True, 2, 2, "wider-rows"),
    "d448-full-wider-rows": (448, (-1, -1), 129, 600, False, 2, 1, "wider-rows"),
}


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(WIDE_CASES))
def test_gluon_forward_wide_head_dims(name, dtype):
    """Head dims 257-512 on the 512-wide tiles split between two consumers (kernels/hopper/fwd_d512.py): odd
    lengths, sq != sk, rows that see no key (out 0, LSE +inf), GQA and MQA, a two-sided window; head dims the tiles
    are wider than read zeros past D (q, k and v as the first D columns of NaN-filled wider rows) and store only
    out's own columns (NaN-poisoned out)."""
    head_dim, window, seqlen_q, seqlen_k, causal, heads, heads_k, layout = WIDE_CASES[name]
    checks, ran = run_forward_case(Case(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_heads=heads,
                                        num_heads_k=heads_k, head_dim=head_dim, dtype=dtype, causal=causal,
                                        window_size=window, layout=layout))
    assert ran, "the Gluon forward did not run"
    assert_checks_ok(checks)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", PADDED_HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 700), (1000, 1000)], ids=["sq300-sk700", "sq1000-sk1000"])
def test_gluon_forward_head_dims_between_tile_classes(seqlen_q, seqlen_k, head_dim, causal):
    """Head dims the tiles are wider than (configs.hopper_fwd_tile_dim): the descriptors read Q, K and V's missing
    columns as zeros and store only out's own: NaN-poisoned out, whose next head's columns a store past D would
    overwrite; q, k and v as the first D columns of wider rows holding NaN (a read past D would poison the result);
    the configured grid and 3 programs."""
    for grid, layout in ((None, "contiguous"), (3, "contiguous"), (None, "wider-rows")):
        with forced_hopper_grid(grid):
            checks, ran = run_forward_case(Case(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_heads=3,
                                                num_heads_k=3, head_dim=head_dim, dtype=torch.bfloat16, causal=causal,
                                                layout=layout))
        assert ran, f"the Gluon forward did not run ({layout})"
        assert_checks_ok(checks)


@needs_hopper
@pytest.mark.parametrize("programs", [None, 3], ids=["configured-grid", "3-programs"])
@pytest.mark.parametrize("pingpong", [False, True], ids=["no-pingpong", "pingpong"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", configs.HOPPER_FWD_HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 17), (700, 300), (1000, 1000)],
                         ids=["sq17-sk17", "sq700-sk300", "sq1000-sk1000"])
def test_gluon_forward_pingpong(monkeypatch, seqlen_q, seqlen_k, head_dim, causal, pingpong, programs):
    """Both settings of the consumers' ping-pong (configs.HopperFwdConfig.pingpong) whatever the table says: turns
    counted across tiles of different lengths (3 programs run many), a single key block, rows without keys. Ping-pong
    takes two consumers: where the table has three, this runs two."""
    config = configs.HOPPER_FWD[head_dim, causal]
    config = dataclasses.replace(with_consumers(config, 2) if pingpong else config, pingpong=pingpong)
    monkeypatch.setitem(configs.HOPPER_FWD, (head_dim, causal), config)
    with forced_hopper_grid(programs):
        checks, ran = run_forward_case(Case(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_heads=3, num_heads_k=3,
                                            head_dim=head_dim, dtype=torch.bfloat16, causal=causal))
    assert ran, "the Gluon forward did not run"
    assert_checks_ok(checks)


@needs_hopper
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(700, 300), (300, 700)], ids=["sq700-sk300", "sq300-sk700"])
@pytest.mark.parametrize("choice", ["hold_schedule", "mask_by_residues"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", configs.HOPPER_FWD_HEAD_DIMS, ids=lambda d: f"d{d}")
def test_gluon_forward_flipped_choices(monkeypatch, head_dim, causal, choice, seqlen_q, seqlen_k):
    """The other setting than the table's of each code-generation choice of configs.HopperFwdConfig: the fence that
    keeps the softmax ahead of the P V wait (hold_schedule), the causal mask by column residues (mask_by_residues):
    tiles of different lengths on 3 programs, rows without keys (sq > sk causal), a diagonal crossing two key blocks
    of a consumer ((sk - sq) % 64 = 16)."""
    config = configs.HOPPER_FWD[head_dim, causal]
    flipped = dataclasses.replace(config, **{choice: not getattr(config, choice)})
    monkeypatch.setitem(configs.HOPPER_FWD, (head_dim, causal), flipped)
    with forced_hopper_grid(3):
        checks, ran = run_forward_case(Case(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_heads=3, num_heads_k=3,
                                            head_dim=head_dim, dtype=torch.bfloat16, causal=causal))
    assert ran, "the Gluon forward did not run"
    assert_checks_ok(checks)


@needs_hopper
@pytest.mark.parametrize("programs", [None, 3], ids=["configured-grid", "3-programs"])
@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 17), (191, 200), (193, 193), (700, 300), (1000, 1000)],
                         ids=["sq17-sk17", "sq191-sk200", "sq193-sk193", "sq700-sk300", "sq1000-sk1000"])
def test_gluon_forward_consumer_counts(monkeypatch, seqlen_q, seqlen_k, causal, consumers, programs):
    """Two and three consumer warpgroups (128- and 192-row tiles, configs.HopperFwdConfig.consumers) at head dim 64
    whatever the table says: tiles one row short of / past 192 rows, causal tiles whose rows all precede the first
    key (sq > sk), paired causal tiles of different lengths on 3 programs (barrier counts and phases per consumer)."""
    monkeypatch.setitem(configs.HOPPER_FWD, (64, causal), with_consumers(configs.HOPPER_FWD[64, causal], consumers))
    with forced_hopper_grid(programs):
        checks, ran = run_forward_case(Case(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_heads=3, num_heads_k=3,
                                            head_dim=64, dtype=torch.bfloat16, causal=causal))
    assert ran, "the Gluon forward did not run"
    assert_checks_ok(checks)


def late_jumping_inputs(case: Case, jump: float):
    """(q, k, v) where every query row meets one key of its own, in a key block after the first, that scores about
    `jump` (natural units) above the row's random scores: each row's max moves by far more than the rescale skip's
    threshold once, at a block drawn per row, so the rows of one warp move at different blocks (key blocks of 128:
    blocks 1 .. seqlen_k / 128 - 1)."""
    q, k, v, _ = make_case_inputs(case, "cuda")
    generator = torch.Generator().manual_seed(case.seqlen_q * case.head_dim)
    for head in range(case.num_heads):
        keys = 128 + torch.randperm(case.seqlen_k - 128, generator=generator)[:case.seqlen_q]
        rows = q[:, :, head].float()
        # score (q_r . c q_r) * d^-1/2 ~ c * d^1/2
        k[:, keys, head] = (rows * (jump / case.head_dim ** 0.5)).to(case.dtype)
    return q, k, v


@needs_hopper
@pytest.mark.parametrize("threshold", [0.0, 8.0], ids=["no-skip", "skip"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", configs.HOPPER_FWD_HEAD_DIMS, ids=lambda d: f"d{d}")
def test_gluon_forward_rows_whose_max_moves_late(monkeypatch, head_dim, causal, threshold):
    """The A-1 rescale skip (configs.HopperFwdConfig.rescale_threshold, kernels/hopper/fwd_softmax.rescale: a warp skips
    its output rescale when none of its 16 rows moved) on and off at every head dim, on rows whose max jumps by
    ~10 (natural units) at a key block of their own: a warp whose vote missed a moved row (e.g. the row r + 8 of a
    thread) would leave that row's earlier blocks unscaled, far outside the tolerance."""
    key = (head_dim, causal)
    monkeypatch.setitem(configs.HOPPER_FWD, key, dataclasses.replace(configs.HOPPER_FWD[key],
                                                                     rescale_threshold=threshold))
    case = Case(batch=1, seqlen_q=256, seqlen_k=1024, num_heads=2, num_heads_k=2, head_dim=head_dim,
                dtype=torch.bfloat16, causal=causal)
    q, k, v = late_jumping_inputs(case, jump=10.0)
    before = hopper.fwd_launch_count
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, 0.0, None, causal, return_attn_probs=True)
    assert hopper.fwd_launch_count > before, "the Gluon forward did not run"
    assert_checks_ok(compare_with_reference(case, out, lse, q, k, v, None))


FEATURES = {
    "gqa": dict(num_heads=6, num_heads_k=2),
    "mqa": dict(num_heads=4, num_heads_k=1, causal=True),
    "bhsd-layout": dict(layout="bhsd", causal=True),
    "scale": dict(softmax_scale=0.05),
    "window-minus1-0-is-causal": dict(window_size=(-1, 0)),
}


@needs_hopper
@pytest.mark.parametrize("feature", list(FEATURES), ids=list(FEATURES))
def test_gluon_forward_features(feature):
    case = Case(batch=2, seqlen_q=333, seqlen_k=333, head_dim=128, dtype=torch.bfloat16, **FEATURES[feature])
    checks, ran = run_forward_case(case, grads=True)
    assert ran, "the Gluon forward did not run"
    assert_checks_ok(checks)


WINDOWS = [(0, 0), (1, 0), (63, 0), (64, 0), (200, 0), (300, 17), (20, 45), (2000, 1), (0, 300)]
WINDOW_SHAPES = [(333, 333), (700, 300), (300, 700), (1000, 1000)]


@needs_hopper
@pytest.mark.parametrize("programs", [None, 3], ids=["configured-grid", "3-programs"])
@pytest.mark.parametrize("head_dim", configs.HOPPER_FWD_HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("seqlen_q,seqlen_k", WINDOW_SHAPES, ids=[f"sq{a}-sk{b}" for a, b in WINDOW_SHAPES])
@pytest.mark.parametrize("window", WINDOWS, ids=[f"w{a}-{b}" for a, b in WINDOWS])
def test_gluon_forward_local_windows(window, seqlen_q, seqlen_k, head_dim, programs):
    """Local windows (LOCAL): windows narrower and wider than a key block and than a tile, one-sided and two-sided,
    sq != sk both ways (rows and whole tiles that see no key), through the configured grid and 3 programs that each
    run many tiles of different block ranges."""
    case = Case(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_heads=4, num_heads_k=2, head_dim=head_dim,
                dtype=torch.bfloat16, causal=window[1] == 0 and window[0] % 2 == 0, window_size=window)
    with forced_hopper_grid(programs):
        checks, ran = run_forward_case(case)
    assert ran, "the Gluon forward did not run"
    assert_checks_ok(checks)


@needs_hopper
@pytest.mark.parametrize("programs", [None, 5], ids=["configured-grid", "5-programs"])
@pytest.mark.parametrize("heads_per_group", [1, 3], ids=["group-1", "group-3"])
def test_gluon_forward_launch_order_groups(heads_per_group, programs):
    """Launch-order groups of 1 and 3 (batch, head) pairs over 2 x 4 pairs (a partial last group), causal; with the
    configured grid and with 5 programs taking the 64 tiles in turn."""
    with forced_heads_per_group(heads_per_group), forced_hopper_grid(programs):
        checks, ran = run_forward_case(Case(batch=2, seqlen_q=1000, seqlen_k=1000, num_heads=4, num_heads_k=2,
                                            head_dim=64, dtype=torch.bfloat16, causal=True))
    assert ran
    assert_checks_ok(checks)


@needs_hopper
def test_gluon_forward_long_sequence():
    checks, ran = run_forward_case(Case(batch=1, seqlen_q=4096, seqlen_k=4096, num_heads=4, num_heads_k=4, head_dim=128,
                                        dtype=torch.bfloat16, causal=True))
    assert ran
    assert_checks_ok(checks)


NOT_COVERED = {
    "softcap": dict(softcap=5.0),
    "alibi-not-causal": dict(alibi=True),
    "sliced-layout": dict(layout="sliced"),  # views 6 bytes past 16-byte alignment: no TMA
    "decode-rows": dict(seqlen_q=16),
}


@needs_hopper
@pytest.mark.parametrize("feature", list(NOT_COVERED), ids=list(NOT_COVERED))
def test_features_it_does_not_cover_take_the_triton_kernel(feature):
    options = dict(batch=2, seqlen_q=200, seqlen_k=200, head_dim=128, dtype=torch.bfloat16)
    options.update(NOT_COVERED[feature])
    checks, ran = run_forward_case(Case(**options))
    assert not ran, "the Gluon forward ran on a case it does not cover"
    assert_checks_ok(checks)


def _gluon_hopper_api() -> bool:
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


compiles_for_sm90 = pytest.mark.skipif(
    not _gluon_hopper_api() or KERNELS_INTERPRETED,
    reason="compiles for sm_90 (needs the Gluon Hopper API and compiled, not interpreted, kernels)")


@functools.lru_cache(maxsize=None)
def _table_sass(head_dim: int, causal: bool) -> str:
    """SASS of configs.HOPPER_FWD's entry compiled offline for sm_90 (shared by the tests that read its loops)."""
    import offline_compile

    from flashtriton import kernel_inspect

    return kernel_inspect.disassemble(offline_compile.compile_hopper_fwd(head_dim, causal).asm["cubin"])


# one variant of the Gluon forward per option its tiles take: (head_dim, causal, compile_hopper_fwd's options)
_FORWARD_VARIANTS = {
    "d64-varlen-local": (64, False, dict(varlen=True, local=True)),
    "d80-causal-alibi": (80, True, dict(alibi=True)),
    "d96-dropout": (96, False, dict(dropout=True)),
    "d128-causal-sinks": (128, True, dict(sinks=True)),
    "d128-causal-varlen-dropout": (128, True, dict(varlen=True, dropout=True)),
    "d192-v128-local": (192, False, dict(head_dim_v=128, local=True)),
    "d256-causal-varlen": (256, True, dict(varlen=True)),
    "d128-causal-fp8": (128, True, dict(fp8=True)),
    "d96-varlen-fp8": (96, False, dict(varlen=True, fp8=True)),
    "d128-causal-paged": (128, True, dict(paged=True)),
    "d192-v128-paged-local": (192, False, dict(head_dim_v=128, paged=True, local=True)),
}


@pytest.mark.skipif(not _gluon_hopper_api(), reason="compiles for sm_90 (needs the Gluon Hopper API)")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gluon_forward_at_head_dim_512_compiles_for_sm90(causal):
    """The split-tile forward (kernels/hopper/fwd_d512.py) compiles for sm_90 offline within shared memory."""
    import offline_compile

    stats = offline_compile.gluon_stats("fwd-d512", 512, causal)
    assert stats["wgmma"] > 0
    assert stats["shared"] <= 232448  # sm_90's shared memory per block


@pytest.mark.skipif(not _gluon_hopper_api(), reason="compiles for sm_90 (needs the Gluon Hopper API)")
@pytest.mark.parametrize("variant", list(_FORWARD_VARIANTS))
def test_gluon_forward_variants_compile_for_sm90(variant):
    """The Gluon forward's feature variants compile for sm_90 on a machine without a GPU
    (tools/offline_compile.gluon_stats, in a subprocess where this suite runs through the interpreter): a helper
    whose signature changed under one of them fails here, on CPU, instead of sending its calls back to the Triton
    forward on the GPU."""
    import offline_compile

    head_dim, causal, options = _FORWARD_VARIANTS[variant]
    stats = offline_compile.gluon_stats("fwd", head_dim, causal, **options)
    assert stats["wgmma"] > 0
    assert stats["shared"] <= 232448  # sm_90's shared memory per block


@pytest.mark.skipif(not _gluon_hopper_api(), reason="this Triton has no Gluon Hopper API")
def test_gluon_forward_module_imports():
    """ops/hopper turns an import error of kernels/hopper/fwd.py into 'the Triton kernel runs' (for Tritons
    without the API); where the API is there the module must import, or a broken kernel file would only show as a
    slower forward on the GPU. Runs on CPU."""
    assert hopper.attn_fwd_hopper_kernel is not None


@compiles_for_sm90
@pytest.mark.parametrize("key", [key for key, config in sorted(configs.HOPPER_FWD.items()) if config.hold_schedule],
                         ids=config_ids)
def test_softmax_runs_under_its_p_v_product(key):
    """Offline SASS (tools/offline_compile.exp2_before_pv_wait): where the table holds the schedule, the exp2s of a
    block's probabilities come before the wait for the previous block's P V product in every consumer's loop (the
    in-warpgroup overlap the kernel is written for); the two rescale factors' exp2s may follow it (at d256
    non-causal ptxas puts them after the wait in one consumer: [32, 34] since the loop has no mask code; they are
    needed only by the rescale after the wait). Built without the fence, this Triton's ptxas waits first (no
    or few exp2s before the wait): if that stops being true, the fence may no longer be needed (re-measure)."""
    import offline_compile

    (head_dim, causal), config = key, configs.HOPPER_FWD[key]
    probabilities = config.block_n // 2  # a thread's exp2s per block: its BLOCK_N / 2 probabilities and 2 alphas
    held = offline_compile.exp2_before_pv_wait(offline_compile.compile_hopper_fwd(head_dim, causal).asm["cubin"])
    assert len(held) == config.consumers
    assert all(count is not None and probabilities <= count <= probabilities + 2 for count in held), held
    loose = offline_compile.compile_hopper_fwd(head_dim, causal, dataclasses.replace(config, hold_schedule=False))
    # (d256 non-causal: [0, 15], the rest [0, 0]: short of half the block's exp2s, where the fence keeps all of them
    # ahead)
    assert all(count is not None and count < probabilities // 2
               for count in offline_compile.exp2_before_pv_wait(loose.asm["cubin"]))


@compiles_for_sm90
@pytest.mark.parametrize("key", [key for key, config in sorted(configs.HOPPER_FWD.items()) if config.rescale_threshold],
                         ids=config_ids)
def test_rescale_skip_is_a_warp_uniform_branch(key):
    """Offline SASS: where the table has the rescale skip, each consumer's key-block loop decides it by a warp vote
    and branches around the output's multiplies (at least one vote-and-branch per consumer); without it there is no
    vote at all (the multiplies run every block)."""
    import offline_compile

    (head_dim, causal), config = key, configs.HOPPER_FWD[key]
    table = offline_compile.compile_hopper_fwd(head_dim, causal)
    assert offline_compile.warp_vote_branches(table.asm["cubin"]) >= config.consumers
    plain = offline_compile.compile_hopper_fwd(head_dim, causal, dataclasses.replace(config, rescale_threshold=0.0))
    assert offline_compile.warp_vote_branches(plain.asm["cubin"]) == 0


@compiles_for_sm90
@pytest.mark.parametrize("key", sorted(configs.HOPPER_FWD), ids=config_ids)
def test_key_block_loops_do_not_spill(key):
    """Offline SASS: no local-memory access (spill) inside any consumer's key-block loop of a table entry
    (kernel_inspect.hot_loop_local_accesses, the gate of `flashtriton inspect`; a few partition scalars outside it
    are allowed), and the check sees spills where they are: a 192-row tile at d128 with 160 registers spills in its
    loops."""
    import offline_compile

    from flashtriton import kernel_inspect

    (head_dim, causal), config = key, configs.HOPPER_FWD[key]
    assert kernel_inspect.hot_loop_local_accesses(_table_sass(head_dim, causal)) == 0
    if key == (128, False):
        starved = with_consumers(dataclasses.replace(config, pingpong=False), 3)
        sass = kernel_inspect.disassemble(offline_compile.compile_hopper_fwd(128, False, starved).asm["cubin"])
        assert kernel_inspect.hot_loop_local_accesses(sass) > 0


@compiles_for_sm90
@pytest.mark.parametrize("key", sorted(configs.HOPPER_FWD_NARROW_V),
                         ids=lambda key: f"d{key[0]}-dv{key[1]}-{'causal' if key[2] else 'full'}")
def test_narrow_v_entries_fit_and_loops_do_not_spill(key):
    """Offline SASS of configs.HOPPER_FWD_NARROW_V's entries (O staged in Q's first chunk): within sm_90's shared
    memory, no spill in the key-block loops, and the softmax's exp2s ahead of the P V wait in every consumer where
    the entry holds the schedule."""
    import offline_compile

    from flashtriton import kernel_inspect

    tile_dim, tile_dim_v, causal = key
    config = configs.HOPPER_FWD_NARROW_V[key]
    compiled = offline_compile.compile_hopper_fwd(tile_dim, causal, head_dim_v=tile_dim_v)
    assert compiled.metadata.shared <= SM90_SHARED_BYTES
    assert kernel_inspect.hot_loop_local_accesses(kernel_inspect.disassemble(compiled.asm["cubin"])) == 0
    held = offline_compile.exp2_before_pv_wait(compiled.asm["cubin"])
    assert len(held) == config.consumers
    if config.hold_schedule:
        assert all(count is not None and count >= config.block_n // 2 for count in held), held


@compiles_for_sm90
@pytest.mark.parametrize("key", sorted(configs.HOPPER_FWD), ids=config_ids)
def test_only_causal_key_block_loops_hold_mask_code(key):
    """Offline SASS: key blocks are visited last first, so a non-causal kernel masks only its first step and its
    key-block loops hold no mask code (a mask is a select per score, BLOCK_N / 2 per thread; the loops keep 2-4
    FSELs of the softmax's own); causal loops keep the mask, and the count sees it there."""
    from flashtriton import kernel_inspect

    (head_dim, causal), config = key, configs.HOPPER_FWD[key]
    selects = [sum("FSEL" in text for text in loop) for loop in kernel_inspect.hot_loops(_table_sass(head_dim, causal))]
    assert len(selects) == config.consumers
    scores_per_thread = config.block_n // 2
    if causal:
        assert all(count >= scores_per_thread for count in selects), selects
    else:
        assert all(count < scores_per_thread // 4 for count in selects), selects


@needs_hopper
def test_compiled_forwards_carry_no_line_info():
    """launching.compiled_without_line_info on the GPU: after a Gluon forward and a Triton-kernel forward (softcap,
    which the Gluon kernel does not take), every compiled variant of both kernels has PTX without `.loc`
    directives, unless the user set TRITON_DISABLE_LINE_INFO (then Triton's own setting holds and the test only
    checks that both ran)."""
    import os

    from flashtriton import kernel_inspect
    from flashtriton.kernels.fwd import attn_fwd_kernel
    from flashtriton.ops.launching import LINE_INFO_VARIABLE

    for softcap, gluon in ((0.0, True), (5.0, False)):
        checks, ran = run_forward_case(Case(batch=1, seqlen_q=130, seqlen_k=130, head_dim=128, dtype=torch.bfloat16,
                                            softcap=softcap))
        assert ran == gluon
        assert_checks_ok(checks)
    for kernel in (hopper.attn_fwd_hopper_kernel, attn_fwd_kernel):
        compiled = kernel_inspect.compiled_kernels(kernel)
        assert compiled, "no compiled variant held"
        if LINE_INFO_VARIABLE not in os.environ:
            assert all(".loc" not in variant.asm["ptx"] for variant in compiled)

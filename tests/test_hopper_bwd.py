"""The warp-specialized Gluon backward (kernels/hopper/bwd.py, kernels/hopper/bwd_d256.py; FLASHTRITON_GLUON=0 turns
it off) against the float64 reference.

It runs only on sm_90 GPUs (Gluon has no interpreter); the CPU part checks the routing rule. Every GPU case forces
the kernel on (testing.forced_gluon), asserts that it ran, NaN-poisons the outputs and applies the tolerance rule of
docs/api.md §4.10 to dq, dk and dv.
"""

import sys
from pathlib import Path

import pytest
import torch

import flashtriton
from flashtriton import configs
from flashtriton.kernels.hopper import bwd as hopper_bwd, common as hopper_common
from flashtriton.ops import hopper
from flashtriton.ops.backend import KERNELS_INTERPRETED
from flashtriton.scores import score_params
from flashtriton.testing import Case, assert_checks_ok, compare_varlen_with_reference, compare_with_reference, \
    forced_gluon, make_case_inputs, poisoned_outputs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not ON_HOPPER or hopper.attn_bwd_hopper_kernel is None,
                                  reason="the Gluon backward runs on sm_90 only")


def _params(causal=False, window=(-1, -1), softcap=0.0, seqlen_k=100):
    return score_params(0.125, causal, window[0], window[1], softcap, seqlen_k)


COVERS = {
    "plain-d128": (dict(), True),
    "causal": (dict(params=_params(causal=True)), True),
    "head-dim-64": (dict(head_dim=64), True),
    "head-dim-96-on-128-tiles": (dict(head_dim=96), True),
    "head-dim-192-on-256-tiles": (dict(head_dim=192, params=_params(causal=True)), True),
    "head-dim-40-on-64-tiles": (dict(head_dim=40), True),
    "head-dim-320": (dict(head_dim=320), False),
    "head-dim-256": (dict(head_dim=256), True),
    "deterministic": (dict(deterministic=True), True),
    "deterministic-d64": (dict(deterministic=True, head_dim=64), False),
    "deterministic-d256": (dict(deterministic=True, head_dim=256), True),
    "not-plain": (dict(plain=False), False),
    "softcap": (dict(params=_params(softcap=3.0)), True),
    "softcap-d256": (dict(params=_params(softcap=3.0), head_dim=256), False),
    "softcap-deterministic-d96": (dict(params=_params(softcap=3.0), head_dim=96, deterministic=True), True),
    "local-window": (dict(params=_params(window=(10, 0))), True),
    "two-sided-window-d256": (dict(params=_params(window=(10, 30)), head_dim=256), True),
    "local-window-deterministic": (dict(params=_params(window=(10, 0)), deterministic=True), False),
    "local-window-deterministic-d256": (dict(params=_params(window=(10, 0)), deterministic=True, head_dim=256), True),
    "fp32": (dict(dtype=torch.float32), False),
}


@pytest.mark.parametrize("name", list(COVERS))
def test_gluon_backward_coverage_rule(name):
    options, expected = COVERS[name]
    call = dict(head_dim=128, dtype=torch.bfloat16, seqlen_q=100, seqlen_k=100, params=_params(), plain=True,
                deterministic=False)
    call.update(options)
    assert hopper.covers("bwd", **call) == expected


def test_deterministic_takes_the_gluon_backward_only_without_unordered_dq_reductions():
    """deterministic=True takes the Gluon backward at head dim 256 (dK / dV only, then the Triton dQ kernel) and 128
    (dQ reductions in a fixed order), never at 64 (both consumers add into the same dQ features, unordered)."""
    call = dict(dtype=torch.bfloat16, seqlen_q=100, seqlen_k=100, params=_params(), plain=True, deterministic=True)
    assert hopper.covers("bwd", head_dim=256, **call) and not hopper.computes_dq(256)
    assert hopper.covers("bwd", head_dim=128, **call) and hopper.orders_dq(128, deterministic=True)
    assert not hopper.covers("bwd", head_dim=64, **call) and not hopper.can_order_dq(64)
    assert not hopper.orders_dq(128, deterministic=False) and not hopper.orders_dq(64, deterministic=True)


def test_ordered_dq_needs_a_heads_key_blocks_resident_together(monkeypatch):
    """Ordered dQ waits resolve only with every key block of a head resident at once (one program per SM): longer
    key sequences than 128 keys per multiprocessor leave deterministic=True at head dim 128 to the Triton backward
    (ops/hopper.gluon_runs); a pure rule, checked with a stand-in device of 132 multiprocessors."""
    monkeypatch.setattr(hopper, "_multiprocessors", lambda device: 132)
    device = torch.device("cpu")
    assert hopper.order_fits(132 * hopper.KEY_BLOCK, device)
    assert not hopper.order_fits(132 * hopper.KEY_BLOCK + 1, device)


def _ordered_schedule(seqlen_q, seqlen_k, group_size, causal, rows=64, keys=128):
    """Each key block's reductions, in its loop order, as (query head in the group, query block, rank), computed with
    the kernel's own schedule functions (plain arithmetic) over which query blocks a key block's loop covers,
    derived here from the mask: some row of the block sees some key of the key block."""
    n_key_blocks, n_query_blocks = -(-seqlen_k // keys), -(-seqlen_q // rows)
    schedule = []
    for n in range(n_key_blocks):
        seen = [m for m in range(n_query_blocks)
                if not causal or min((m + 1) * rows, seqlen_q) - 1 + seqlen_k - seqlen_q >= n * keys]
        assert seen == list(range(seen[0] if seen else n_query_blocks, n_query_blocks))  # a suffix, as the loop has
        blocks, m_lo = len(seen), (seen[0] if seen else 0)
        iterations = group_size * blocks
        first = hopper_bwd._first_visit.fn(n, iterations, 0 if causal else 1, keys // rows)
        visits = []
        for i in range(iterations):
            visit = hopper_common.loop_position.fn(i, first, iterations)
            m = m_lo + visit % blocks
            visits.append((visit // blocks, m, hopper_bwd._reduction_rank.fn(
                n, n_key_blocks, visit, m, seqlen_q, seqlen_k, int(causal), rows, keys)))
        schedule.append(visits)
    return schedule


ORDER_SHAPES = [(1024, 1024, 1), (1000, 1000, 2), (300, 700, 1), (700, 300, 3), (64, 2048, 1), (2048, 64, 2),
                (129, 1, 1), (1, 129, 1)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k,group_size", ORDER_SHAPES,
                         ids=[f"sq{a}-sk{b}-g{g}" for a, b, g in ORDER_SHAPES])
def test_ordered_dq_schedule(seqlen_q, seqlen_k, group_size, causal):
    """The fixed order of the dQ reductions (kernels/hopper/bwd.py, ORDERED): every query block's contributors hold
    the ranks 0..n-1 once each, and with all key blocks of a head running in step (each takes one reduction per
    step if the tile's counter, as it stood at the step's start, is its rank; a reduction is released at the step
    after it, when its program reaches the next one, and counts from the step after that) every reduction goes
    through:
    without the causal mask where a head's loops have room for its key blocks two query blocks apart, and with it
    where no two key blocks start at the same query block (sk <= sq), in as many steps as the longest loop;
    otherwise with waits but no deadlock."""
    schedule = _ordered_schedule(seqlen_q, seqlen_k, group_size, causal)
    ranks = {}
    for visits in schedule:
        for g, m, rank in visits:
            ranks.setdefault((g, m), []).append(rank)
    for tile, tile_ranks in ranks.items():
        assert sorted(tile_ranks) == list(range(len(tile_ranks))), f"ranks of query block {tile}: {tile_ranks}"
    counters = dict.fromkeys(ranks, 0)
    done = [0] * len(schedule)
    pending = [None] * len(schedule)
    steps = 0
    while any(d < len(v) for d, v in zip(done, schedule)) or any(pending):
        steps += 1
        assert steps <= 4 * sum(len(v) for v in schedule), "the order deadlocks"
        released = []
        for n, visits in enumerate(schedule):
            # the previous reduction is released as the program reaches its next one (before waiting for its turn)
            released.append(pending[n])
            pending[n] = None
            if done[n] < len(visits) and counters[visits[done[n]][:2]] == visits[done[n]][2]:
                pending[n] = visits[done[n]][:2]
                done[n] += 1
        for tile in filter(None, released):
            counters[tile] += 1
    longest = max(len(v) for v in schedule)
    if (not causal and group_size * -(-seqlen_q // 64) >= 2 * len(schedule)) or (causal and seqlen_k <= seqlen_q):
        assert steps == longest + 1  # the last reduction's release is one step more


ROW_LAYOUTS = {
    "aligned": (2, 3, 256, None),        # (B, H, S) contiguous, rows 16-byte aligned: used in place
    "odd-length": (2, 3, 333, None),     # rows of 333 floats: copied to rows of 336
    "head-padded": (2, 3, 100, 128),     # a (B, H, 100) view of (B, H, 128): heads 512 bytes apart, used in place
}


@pytest.mark.skipif(hopper.attn_bwd_hopper_kernel is None, reason="this Triton has no Gluon Hopper API")
@pytest.mark.parametrize("layout", list(ROW_LAYOUTS))
def test_row_statistic_descriptor_covers_every_row(layout):
    """The (B * H, S) matrix the kernel loads lse / delta blocks from holds every row's value, with 16-byte aligned
    rows (a TMA requirement), whatever the statistic's own strides; host-side only, so it runs on CPU too."""
    batch, heads, seqlen, allocated = ROW_LAYOUTS[layout]
    stat = torch.randn(batch, heads, allocated or seqlen)[:, :, :seqlen]
    descriptor = hopper._row_statistic_descriptor(stat, (stat.stride(0), stat.stride(1)), batch, heads, seqlen, 64)
    matrix = descriptor.base
    assert list(descriptor.shape) == [batch * heads, seqlen] and descriptor.block_shape == [1, 64]
    assert matrix.stride(1) == 1 and (matrix.stride(0) * 4) % 16 == 0 and matrix.data_ptr() % 16 == 0
    assert torch.equal(matrix, stat.reshape(batch * heads, seqlen))
    assert (matrix.data_ptr() == stat.data_ptr()) == (layout != "odd-length")


def run_backward(case: Case, deterministic: bool = False, repeats: int = 1):
    """Forward (whichever kernel) and the backward forced onto the Gluon kernel; (tolerance checks, whether it ran).
    With repeats > 1 the backward runs that many times and must give the same bits each time."""
    q, k, v, alibi_slopes = make_case_inputs(case, "cuda", requires_grad=True)
    before = hopper.bwd_launch_count
    with poisoned_outputs(), forced_gluon():
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, 0.0, case.softmax_scale, case.causal, case.window_size,
                                                  softcap=case.softcap, alibi_slopes=alibi_slopes,
                                                  deterministic=deterministic, return_attn_probs=True)
        dout = torch.randn_like(out)
        runs = [torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) for _ in range(repeats)]
    ran = hopper.bwd_launch_count >= before + repeats
    for grads in runs[1:]:
        for name, first, again in zip(("dq", "dk", "dv"), runs[0], grads):
            assert torch.equal(first, again), f"{name} differs between two deterministic backward calls"
    return compare_with_reference(case, out, lse, q, k, v, alibi_slopes, runs[0], dout), ran


SHAPES = [(17, 17), (128, 128), (200, 333), (333, 200), (1000, 1000)]


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", sorted(configs.HOPPER_BWD), ids=lambda d: f"d{d}")
@pytest.mark.parametrize("seqlen_q,seqlen_k", SHAPES, ids=[f"sq{a}-sk{b}" for a, b in SHAPES])
def test_gluon_backward_matches_reference(seqlen_q, seqlen_k, head_dim, dtype, causal):
    """Odd lengths (partial key blocks and query blocks), sq > sk under the causal mask (rows that see no key),
    both 16-bit dtypes, every head dim the kernel takes."""
    checks, ran = run_backward(Case(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_heads=3, num_heads_k=3,
                                    head_dim=head_dim, dtype=dtype, causal=causal))
    assert ran, "the Gluon backward did not run"
    assert_checks_ok(checks)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 17), (333, 200), (1000, 1000)],
                         ids=["sq17-sk17", "sq333-sk200", "sq1000-sk1000"])
def test_gluon_backward_d256_deterministic(seqlen_q, seqlen_k, causal):
    """Head dim 256 with deterministic=True runs the Gluon dK / dV kernel (then the Triton dQ kernel), and two calls
    give the same bits."""
    checks, ran = run_backward(Case(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_heads=3, num_heads_k=3,
                                    head_dim=256, dtype=torch.bfloat16, causal=causal), deterministic=True, repeats=2)
    assert ran, "the Gluon backward did not run"
    assert_checks_ok(checks)


ORDERED_CASES = {
    "sq1000-sk1000": dict(seqlen_q=1000, seqlen_k=1000),
    "sq2048-sk2048-causal": dict(seqlen_q=2048, seqlen_k=2048, causal=True),
    "sq700-sk300-gqa": dict(seqlen_q=700, seqlen_k=300, num_heads=6, num_heads_k=2),
    "sq300-sk700-gqa-causal": dict(seqlen_q=300, seqlen_k=700, num_heads=6, num_heads_k=2, causal=True),
    "sq700-sk300-mqa-causal": dict(seqlen_q=700, seqlen_k=300, num_heads=4, num_heads_k=1, causal=True),
    "sq17-sk17": dict(seqlen_q=17, seqlen_k=17),
    "softcap-causal": dict(seqlen_q=700, seqlen_k=700, causal=True, softcap=5.0),
}


def test_aligned_rows_needs_sixteen_byte_rows_and_head_dims_of_eight():
    """hopper.aligned_rows (the backward kernels' ALIGNED_ROWS: 16-byte dK / dV / dQ stores): every output's
    address and strides but the last multiples of 16 bytes, and its head dim a multiple of 8."""
    contiguous = torch.empty(2, 5, 3, 64, dtype=torch.bfloat16)
    assert hopper.aligned_rows((contiguous, 64))
    assert hopper.aligned_rows((torch.empty(2, 5, 3, 72, dtype=torch.bfloat16)[..., :64], 64))
    assert not hopper.aligned_rows((torch.empty(2, 5, 3, 68, dtype=torch.bfloat16)[..., :64], 64))
    assert not hopper.aligned_rows((torch.empty(2 * 5 * 3 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 5, 3, 64), 64))
    assert not hopper.aligned_rows((torch.empty(2, 5, 3, 70, dtype=torch.bfloat16), 70))
    assert not hopper.aligned_rows((contiguous, 64), (contiguous, 60))


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128, 192], ids=lambda d: f"d{d}")
def test_gluon_backward_into_unaligned_gradients(head_dim):
    """dq / dk / dv given to the low-level backward at a 2-byte offset (hopper.aligned_rows False: the kernels store
    them in 2-byte pieces) get the same dK / dV bits as 16-byte aligned ones and the same dQ up to the order of its
    fp32 additions; nothing is written outside them (NaN guard elements around each)."""
    from flashtriton.flash_attn_interface import _flash_attn_backward, _flash_attn_forward

    torch.manual_seed(0)
    shape = (2, 200, 4, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = head_dim ** -0.5
    with forced_gluon():
        out, lse, _, rng_state = _flash_attn_forward(q, k, v, 0.0, scale, True, -1, 0, 0.0, None, False)
        dout = torch.randn_like(out)
        elements = q.numel()
        grads = {}
        for offset in (0, 1):
            buffers = [torch.full((elements + 2 * 8,), float("nan"), device="cuda", dtype=torch.bfloat16)
                       for _ in range(3)]
            dq, dk, dv = (buffer[8 + offset:8 + offset + elements].view(shape) for buffer in buffers)
            assert hopper.aligned_rows((dk, head_dim), (dv, head_dim)) == (offset == 0)
            before = hopper.bwd_launch_count
            _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, True, -1, 0, 0.0, None, False,
                                 rng_state)
            assert hopper.bwd_launch_count == before + 1, "the Gluon backward did not run"
            for buffer in buffers:
                guard = torch.cat((buffer[:8 + offset], buffer[8 + offset + elements:]))
                assert torch.isnan(guard.float()).all(), "a gradient was written outside its tensor"
            grads[offset] = (dq, dk, dv)
    assert torch.equal(grads[0][1], grads[1][1]) and torch.equal(grads[0][2], grads[1][2])
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=2e-2, rtol=2e-2)
    assert torch.isfinite(grads[1][0].float()).all()


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_unswapped_dq_reads_the_swapped_staging_order_back(head_dim):
    """hopper.unswapped_dq inverts the SWAPPED_DQ order (kernels/hopper/bwd._staging_order): in each whole group of
    64 columns the accumulator holds feature c at the column with c's bits 2 and 4 swapped, the rest in order; into
    a strided dq (a packed tensor's view)."""
    def swapped(column):
        if column >= head_dim // 64 * 64:
            return column
        low = column % 64
        bit2, bit4 = (low >> 2) & 1, (low >> 4) & 1
        return column - low + (low & ~0b10100) + (bit2 << 4) + (bit4 << 2)

    dq_logical = torch.randn(2, 7, 3, head_dim)
    dq_accum = torch.empty_like(dq_logical)
    for column in range(head_dim):
        dq_accum[..., swapped(column)] = dq_logical[..., column]
    packed = torch.full((2, 7, 2, 3, head_dim), float("nan"), dtype=torch.bfloat16)
    hopper.unswapped_dq(packed[:, :, 0], dq_accum)
    assert torch.equal(packed[:, :, 0], dq_logical.to(torch.bfloat16))
    assert torch.isnan(packed[:, :, 1].float()).all()


def test_head_dims_between_tile_classes_take_the_next_wider_backward_tiles():
    assert [configs.hopper_bwd_tile_dim(d) for d in (8, 64, 72, 80, 96, 112, 128, 160, 192, 200, 256, 264)] == \
        [64, 64, 80, 80, 96, 128, 128, 192, 192, 256, 256, None]
    # tiles 128 wide order dQ by features (deterministic=True takes them); 64 wide do not; 256 wide leave dQ to Triton
    assert hopper.can_order_dq(96) and not hopper.can_order_dq(40) and not hopper.computes_dq(192)
    # V's own head dim: on 128-wide tiles beside the dK / dV only kernel's (192, 256) only
    assert [hopper.backward_takes_head_dims(d, dv) for d, dv in ((192, 128), (256, 128), (160, 100), (192, 64),
                                                                 (128, 64), (192, 256), (96, 96))] == \
        [True, True, True, False, False, False, True]
    assert hopper.dq_kernel_runs(192, 128) and hopper.dq_kernel_runs(192, 192) and not hopper.dq_kernel_runs(256, 128)
    # dQ after the dK / dV only kernel: the Gluon dQ kernel on 192-wide tiles, the Triton one on 256-wide
    assert [hopper.dq_kernel_runs(d) for d in (64, 128, 160, 192, 200, 256)] == [False, False, True, True, False,
                                                                                 False]


def test_dk_dv_only_boxes_by_side():
    """The dK / dV only kernel's boxes (k, v, q, do, then the second chunk's): a side of one chunk moves K (V) in
    whole rows and Q (dO) in halves, a side of two chunks a box per chunk each; V's side follows V's own tiles."""
    keys, rows = "keys", "rows"
    assert hopper.dk_dv_only_boxes(256, 256) == (("k", keys, 256), ("v", keys, 256), ("q", rows, 128),
                                                 ("do", rows, 128), None, None, None, None)
    assert hopper.dk_dv_only_boxes(192, 192) == (("k", keys, 128), ("v", keys, 128), ("q", rows, 128),
                                                 ("do", rows, 128), ("k", keys, 64), ("v", keys, 64),
                                                 ("q", rows, 64), ("do", rows, 64))
    assert hopper.dk_dv_only_boxes(192, 128) == (("k", keys, 128), ("v", keys, 128), ("q", rows, 128),
                                                 ("do", rows, 64), ("k", keys, 64), None, ("q", rows, 64), None)


def test_deterministic_calls_skip_the_tiles_of_two_chunks():
    """Tiles of two chunks (80, 96) split dQ by chunks of unequal widths, which the fixed order does not take: a
    deterministic call at those head dims runs on 128-wide tiles with dQ ordered; the others take the chunks."""
    for head_dim in (72, 80, 96):
        assert hopper.backward_division(head_dim)[3] in (80, 96)
        assert hopper.backward_division(head_dim, deterministic=True)[3] == 128
        assert hopper.orders_dq(head_dim, deterministic=True)
    assert hopper.backward_division(64, deterministic=True)[3] == 64
    # the dK / dV kernel's 192-wide chunks add no dQ: deterministic calls keep them
    assert hopper.backward_division(192, deterministic=True)[3] == 192 and not hopper.computes_dq(192)


def test_every_backward_tile_class_has_power_of_two_chunks_that_add_up():
    """configs.HOPPER_BWD_CHUNKS: an entry per HOPPER_BWD head dim, one or two power-of-two chunks of at least 16
    columns summing to it, the widest first."""
    assert set(configs.HOPPER_BWD_CHUNKS) == set(configs.HOPPER_BWD)
    for tile_dim, widths in configs.HOPPER_BWD_CHUNKS.items():
        assert 1 <= len(widths) <= 2 and sum(widths) == tile_dim and list(widths) == sorted(widths, reverse=True)
        assert all(width >= 16 and width & (width - 1) == 0 for width in widths), widths


@needs_hopper
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [8, 40, 72, 112, 160, 200])
@pytest.mark.parametrize("layout", ["contiguous", "wider-rows"])
def test_gluon_backward_head_dims_between_tile_classes(layout, head_dim, causal, deterministic):
    """Head dims the backward's tiles are wider than (configs.hopper_bwd_tile_dim): missing columns of K, V, Q and
    dO read as zeros, dK / dV stored and dQ reduced within the head dim only (NaN-poisoned outputs; inputs as the
    first D columns of NaN-filled wider rows, whose NaN a read past D would spread); with deterministic=True, tiles
    128 wide order dQ (the same bits in two calls; 72 and 112 run on them, 72 on 80-wide chunked tiles otherwise; 160
    on 192-wide chunked tiles, 200 on 256-wide)."""
    case = Case(batch=2, seqlen_q=333, seqlen_k=200, num_heads=4, num_heads_k=2, head_dim=head_dim,
                dtype=torch.bfloat16, causal=causal, layout=layout)
    checks, ran = run_backward(case, deterministic=deterministic, repeats=2 if deterministic else 1)
    takes = hopper.covers("bwd", head_dim, torch.bfloat16, 333, 200, _params(causal, seqlen_k=200), True,
                          deterministic)
    assert ran == takes, f"the Gluon backward {'did not run' if takes else 'ran'}"
    assert_checks_ok(checks)


@needs_hopper
@pytest.mark.parametrize("name", list(ORDERED_CASES))
def test_gluon_backward_ordered_dq(name):
    """Head dim 128 with deterministic=True: dQ reductions in the fixed order (many key blocks per head, GQA / MQA,
    sq != sk under the causal mask: key blocks that start at the same query block, rows without keys) give the
    reference's gradients and the same bits in three calls."""
    case = Case(**{**dict(batch=2, num_heads=3, num_heads_k=3, head_dim=128, dtype=torch.bfloat16),
                   **ORDERED_CASES[name]})
    checks, ran = run_backward(case, deterministic=True, repeats=3)
    assert ran, "the Gluon backward did not run"
    assert_checks_ok(checks)


FEATURES = {
    "gqa": dict(num_heads=6, num_heads_k=2),
    "causal-window": dict(causal=True, window_size=(100, 0), seqlen_q=700, seqlen_k=900),
    "two-sided-window": dict(window_size=(40, 200), seqlen_q=900, seqlen_k=700),
    "window-misses-keys": dict(window_size=(3, 0), seqlen_q=200, seqlen_k=1000),
    "window-d256": dict(window_size=(64, 64), head_dim=256),
    "window-d96-gqa": dict(window_size=(129, 5), head_dim=96, num_heads=4, num_heads_k=2),
    "mqa-causal": dict(num_heads=4, num_heads_k=1, causal=True),
    "bhsd-layout": dict(layout="bhsd", causal=True),
    "scale": dict(softmax_scale=0.05),
    # ALiBi: (batch, heads) slopes; causal calls take FA2's pure-causal distances (-key), the others |row - key|
    "alibi": dict(alibi=True),
    "alibi-causal-gqa": dict(alibi=True, causal=True, num_heads=6, num_heads_k=2),
    "alibi-causal-sq-over-sk-d64": dict(alibi=True, causal=True, head_dim=64, seqlen_q=400, seqlen_k=300),
    "alibi-window-d96": dict(alibi=True, window_size=(50, 0), head_dim=96, seqlen_q=333, seqlen_k=500),
    "alibi-two-sided-window-d80": dict(alibi=True, window_size=(40, 90), head_dim=80),
    # softcap (Gemma 2's 50 and small caps that saturate): capped logits, dS times 1 - tanh^2
    "softcap": dict(softcap=3.0),
    "softcap-50-causal-gqa": dict(softcap=50.0, causal=True, num_heads=6, num_heads_k=2, seqlen_q=700, seqlen_k=700),
    "softcap-d64-causal": dict(softcap=3.0, causal=True, head_dim=64, seqlen_q=400, seqlen_k=300),
    "softcap-window-d96": dict(softcap=3.0, window_size=(50, 0), head_dim=96, seqlen_q=333, seqlen_k=500),
    "softcap-alibi-causal": dict(softcap=5.0, alibi=True, causal=True),
}


DQ_CASES = {
    "sq17-sk17": (dict(seqlen_q=17, seqlen_k=17), False),
    "sq333-sk200-causal": (dict(seqlen_q=333, seqlen_k=200, causal=True), False),
    "sq200-sk333": (dict(seqlen_q=200, seqlen_k=333), False),
    "sq1000-gqa-causal": (dict(seqlen_q=1000, seqlen_k=1000, num_heads=6, num_heads_k=2, causal=True), False),
    "causal-window": (dict(causal=True, window_size=(100, 0), seqlen_q=700, seqlen_k=900), False),
    "two-sided-window": (dict(window_size=(40, 200), seqlen_q=900, seqlen_k=700), False),
    "window-misses-keys": (dict(window_size=(3, 0), seqlen_q=200, seqlen_k=1000), False),
    "deterministic-causal": (dict(seqlen_q=700, seqlen_k=700, causal=True), True),
}


@needs_hopper
@pytest.mark.parametrize("name", list(DQ_CASES))
def test_gluon_dq_kernel_at_head_dim_192(name):
    """Head dim 192: the dK / dV kernel, then the Gluon dQ kernel (kernels/hopper/bwd_dq.py): partial query tiles
    and key blocks, rows that see no key, GQA, windows on both sides, deterministic=True (the same bits twice)."""
    options, deterministic = DQ_CASES[name]
    case = Case(**{**dict(batch=2, num_heads=3, num_heads_k=3, head_dim=192, dtype=torch.bfloat16), **options})
    before = hopper.bwd_dq_launch_count
    checks, ran = run_backward(case, deterministic=deterministic, repeats=2 if deterministic else 1)
    assert ran and hopper.bwd_dq_launch_count > before, "the Gluon dQ kernel did not run"
    assert_checks_ok(checks)


@needs_hopper
@pytest.mark.parametrize("feature", list(FEATURES), ids=list(FEATURES))
def test_gluon_backward_features(feature):
    checks, ran = run_backward(Case(**{**dict(batch=2, seqlen_q=300, seqlen_k=300, head_dim=128,
                                              dtype=torch.bfloat16), **FEATURES[feature]}))
    assert ran, "the Gluon backward did not run"
    assert_checks_ok(checks)


VARLEN_CASES = {  # name: (lengths of q, lengths of k, heads, kv heads, head dim, options)
    "mixed-causal": ([300, 1, 0, 129, 1000, 64], [300, 1, 0, 129, 1000, 64], 4, 4, 128, dict(causal=True)),
    "mixed-full-gqa-d64": ([200, 17, 513, 0, 90], [250, 0, 513, 33, 70], 6, 2, 64, dict()),
    "sq-over-sk-causal": ([400, 70, 129], [100, 300, 64], 2, 1, 128, dict(causal=True)),
    "window-d96": ([700, 333, 18], [700, 333, 18], 4, 2, 96, dict(window_size=(100, 20))),
    "causal-d72": ([129, 7, 640], [129, 7, 640], 5, 5, 72, dict(causal=True)),
    "softcap-causal-gqa": ([300, 1, 0, 700], [300, 1, 0, 700], 4, 2, 128, dict(causal=True, softcap=5.0)),
}


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_gluon_backward_varlen(name, dtype):
    """Packed sequences (flash_attn_varlen_func) on the Gluon backward: each program's sequence gets its own tensor
    descriptors (rows past it read zeros); lengths off the tiles, empty query or key sequences, sq != sk both ways,
    GQA, a window, two-chunk tiles (96; 72 on 80-wide ones); rows past the last sequence hold NaN in q, k, v and
    dout (a read of them would reach the gradients); NaN-poisoned outputs against the float64 reference, every
    row."""
    lengths_q, lengths_k, heads, heads_k, head_dim, options = VARLEN_CASES[name]
    cu_q, cu_k = (torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
                  for lengths in (lengths_q, lengths_k))
    padding = 37
    q = torch.randn(sum(lengths_q) + padding, heads, head_dim, device="cuda").to(dtype)
    k = torch.randn(sum(lengths_k) + padding, heads_k, head_dim, device="cuda").to(dtype)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    for tensor, covered in ((q, sum(lengths_q)), (k, sum(lengths_k)), (v, sum(lengths_k)), (dout, sum(lengths_q))):
        tensor[covered:] = float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    before = hopper.bwd_launch_count
    with poisoned_outputs(), forced_gluon():
        out, lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                         return_attn_probs=True, **options)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert hopper.bwd_launch_count == before + 1, "the Gluon backward did not run"
    covered_q, covered_k = sum(lengths_q), sum(lengths_k)
    clean = [t.detach()[:covered] for t, covered in ((q, covered_q), (k, covered_k), (v, covered_k))]
    checks = compare_varlen_with_reference(out[:covered_q], lse[:, :covered_q], *clean, cu_q.cpu(), cu_k.cpu(),
                                           max(lengths_k), grads=[g[:covered] for g, covered in zip(
                                               grads, (covered_q, covered_k, covered_k))], dout=dout[:covered_q],
                                           **options)
    assert_checks_ok(checks)
    for grad, covered in zip(grads, (covered_q, covered_k, covered_k)):
        assert torch.equal(grad[covered:], torch.zeros_like(grad[covered:]))


def test_varlen_backward_rule():
    """Varlen backwards take the Gluon kernel on tiles up to 128 wide without deterministic=True or dropout; the
    dK / dV only kernel, dQ in a fixed order and packed tensors without rows stay on the Triton kernels (CPU: the
    launcher refuses what the rule keeps away)."""
    q = torch.empty(10, 2, 256)
    with pytest.raises(ValueError, match="tiles up to 128 wide"):
        hopper.launch_bwd(q, q, q, q, None, None, q, q, q, None, (0, 10), (0, 10), _params(), 10, 10, 1, 1, False,
                          cu_seqlens_q=torch.tensor([0, 10]), cu_seqlens_k=torch.tensor([0, 10]))


def _gluon_hopper_api() -> bool:
    try:
        from triton._C.libtriton import gluon_ir
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce")


@pytest.mark.skipif(not _gluon_hopper_api(), reason="this Triton has no Gluon Hopper API with TMA reductions")
def test_gluon_backward_modules_import():
    """ops/hopper turns an import error of the kernel modules into 'the Triton backward runs' (for Tritons without
    the API); where the API is there, the kernel modules must import, or a broken kernel file would only show as a
    slower backward on the GPU. Runs on CPU."""
    assert hopper.attn_bwd_hopper_kernel is not None and hopper.attn_bwd_hopper_d256_kernel is not None
    assert hopper.attn_bwd_hopper_dq_kernel is not None


# one variant of each Gluon backward kernel and each option its tiles take: (kernel, head_dim, options)
_BACKWARD_VARIANTS = {
    "d64-causal-alibi": ("bwd", 64, dict(causal=True, alibi=True)),
    "d96-varlen-local": ("bwd", 96, dict(causal=False, varlen=True, local=True)),
    "d128-causal-dropout": ("bwd", 128, dict(causal=True, dropout=True)),
    "d128-ordered": ("bwd", 128, dict(causal=False, ordered=True)),
    "d128-causal-softcap": ("bwd", 128, dict(causal=True, softcap=True)),
    "d64-softcap": ("bwd", 64, dict(causal=False, softcap=True)),
    "d192-local": ("bwd", 192, dict(causal=False, local=True)),
    "d192-v128-causal": ("bwd", 192, dict(causal=True, head_dim_v=128)),
    "d256-causal": ("bwd", 256, dict(causal=True)),
    "dq-d192-causal": ("dq", 192, dict(causal=True)),
}


@pytest.mark.skipif(not _gluon_hopper_api(), reason="compiles for sm_90 (needs the Gluon Hopper API)")
@pytest.mark.parametrize("variant", list(_BACKWARD_VARIANTS))
def test_gluon_backward_kernels_compile_for_sm90(variant):
    """Every Gluon backward kernel compiles for sm_90 on a machine without a GPU (tools/offline_compile.gluon_stats,
    in a subprocess where this suite runs through the interpreter): a kernel file that no longer compiles (a
    helper's signature changed under one of its callers) fails here, on CPU, instead of sending every call of its
    head dims back to the Triton backward on the GPU."""
    import offline_compile

    kernel, head_dim, options = _BACKWARD_VARIANTS[variant]
    options = dict(options)
    stats = offline_compile.gluon_stats(kernel, head_dim, options.pop("causal"), **options)
    assert stats["wgmma"] > 0
    assert stats["shared"] <= 232448  # sm_90's shared memory per block


@pytest.mark.skipif(not _gluon_hopper_api() or KERNELS_INTERPRETED,
                    reason="compiles for sm_90 (needs the Gluon Hopper API and compiled, not interpreted, kernels)")
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128], ids=lambda d: f"d{d}")
def test_probabilities_run_under_the_dp_product(head_dim):
    """Offline SASS (tools/offline_compile.exp2_before_pv_wait): in both consumers' loops every exp2 of P comes
    between the S wait and the dP wait (key-major tiles: the dV product P^T dO issued before that wait), so P is
    computed while dP = dO V^T is on the tensor cores (ptxas moved the forward's equivalent wait ahead of its exp2s
    without a fence; this guards the backward against the same)."""
    import offline_compile

    config = configs.HOPPER_BWD[head_dim]
    per_block = config.query_rows * 64 // 128  # a thread's share of P [rows, 64 keys]
    for causal in (False, True):
        cubin = offline_compile.compile_hopper_bwd(head_dim, causal).asm["cubin"]
        key_major = hopper.key_major_scores(config, causal, False, False)
        counts = offline_compile.exp2_before_pv_wait(cubin, until_product=key_major)
        # key-major: the dP wait (the dV product in flight) starts a walk of its own, to the dK product, with no exp2
        assert counts == ([per_block, 0] * 2 if key_major else [per_block, per_block]), causal

"""Paged varlen calls (flash_attn_varlen_func with block_table) on the Gluon Hopper forward: the pool rules
(ops/hopper.takes_pages, paged_key_rows) on CPU; on an sm_90 GPU every case against the float64 reference with
NaN-poisoned outputs and NaN in every pool row no sequence owns, pages outside the pool against the Triton kernel,
and no recompiles for new pools, block-table widths or lengths."""

import pytest
import torch

import flashtriton
from flashtriton import configs
from flashtriton.ops import hopper
from flashtriton.testing import assert_checks_ok, compare_varlen_with_reference, cu_seqlens, forced_gluon, \
    poisoned_outputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_HOPPER = DEVICE == "cuda" and hopper.is_hopper(torch.device(DEVICE)) and hopper.attn_fwd_hopper_kernel is not None
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="the Gluon forward runs on sm_90 GPUs")


def pool(page_size: int, num_pages: int, heads_k: int = 2, head_dim: int = 128):
    return torch.empty(num_pages, page_size, heads_k, head_dim)


@pytest.mark.parametrize("page_size,takes", [(64, True), (128, True), (192, True), (256, True), (512, True),
                                             (16, False), (32, False), (96, False), (100, False)])
def test_pools_of_pages_of_64_keys_are_taken(page_size, takes):
    k = pool(page_size, 5)
    assert hopper.takes_pages(k, k.clone()) == takes


def test_pools_that_are_not_pages_in_a_row_are_refused():
    k = pool(64, 6)
    assert hopper.takes_pages(k, k)
    assert not hopper.takes_pages(k[::2], k[::2])  # every other page: not one (1, pages * 64, Hk, D) view
    assert not hopper.takes_pages(k, k[::2])
    assert not hopper.takes_pages(pool(64, 0), pool(64, 0))


def test_pools_past_32_bit_tma_rows_are_refused():
    """TMA coordinates are 32-bit: a pool of 2^31 rows or more (the row past it included) stays on the Triton
    kernel (meta tensors: only shapes and strides are read)."""
    fits = torch.empty(2 ** 25 - 2, 64, 1, 8, device="meta")
    assert hopper.takes_pages(fits, fits)
    too_many = torch.empty(2 ** 25 - 1, 64, 1, 8, device="meta")
    assert not hopper.takes_pages(too_many, too_many)


@pytest.mark.parametrize("head_dim,causal", sorted(configs.HOPPER_FWD), ids=lambda value: str(value))
def test_key_blocks_are_read_in_boxes_that_lie_in_one_page(head_dim, causal):
    """The paged forward keeps the config's key block and reads it in boxes that divide every page size it takes:
    the whole block where it divides the page, else boxes of 64 rows (each from its own page)."""
    config = configs.HOPPER_FWD[head_dim, causal]
    for page_size in (64, 128, 192, 256, 320, 512, 1024):
        rows = hopper.paged_key_rows(config, page_size)
        assert page_size % rows == 0 and config.block_n % rows == 0
        assert rows == config.block_n or (rows == hopper.PAGE_BLOCK and page_size % config.block_n)
        assert hopper.forward_constexprs(config, causal, key_rows=rows)["KEY_PIECES"] == config.block_n // rows


def paged_problem(lengths_q, lengths_k, page_size, heads=4, heads_k=2, head_dim=128, head_dim_v=None,
                  dtype=torch.bfloat16, spare_pages=3, width_pages=0, generator=None):
    """q (Tq, H, D) and contiguous k / v (Tk, Hk, D) for the reference, and the same keys scattered over shuffled
    pages of a pool with spare pages; every pool row no sequence owns holds NaN. width_pages: extra block-table
    columns (pointing at spare pages: never read)."""
    head_dim_v = head_dim_v or head_dim
    batch = len(lengths_k)
    pages_needed = [-(-length // page_size) for length in lengths_k]
    columns = max(max(pages_needed), 1) + width_pages
    num_pages = sum(pages_needed) + spare_pages
    order = torch.randperm(num_pages, generator=generator).to(DEVICE)
    table = torch.full((batch, columns), num_pages - 1, dtype=torch.int32, device=DEVICE)
    k = torch.randn(sum(lengths_k), heads_k, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn(sum(lengths_k), heads_k, head_dim_v, device=DEVICE, dtype=dtype)
    k_pool = torch.full((num_pages, page_size, heads_k, head_dim), float("nan"), device=DEVICE, dtype=dtype)
    v_pool = torch.full((num_pages, page_size, heads_k, head_dim_v), float("nan"), device=DEVICE, dtype=dtype)
    used, row = 0, 0
    for b, length in enumerate(lengths_k):
        table[b, :pages_needed[b]] = order[used:used + pages_needed[b]].to(torch.int32)
        used += pages_needed[b]
        positions = torch.arange(length, device=DEVICE)
        pages = table[b, positions // page_size].long()
        k_pool[pages, positions % page_size] = k[row:row + length]
        v_pool[pages, positions % page_size] = v[row:row + length]
        row += length
    q = torch.randn(sum(lengths_q), heads, head_dim, device=DEVICE, dtype=dtype)
    return q, k, v, k_pool, v_pool, table


def run_paged(lengths_q, lengths_k, page_size, expect_gluon=True, **options):
    """The paged call against the reference over the contiguous keys; asserts whether the Gluon forward ran."""
    problem_options = {key: options.pop(key) for key in ("heads", "heads_k", "head_dim", "head_dim_v", "dtype",
                                                          "width_pages") if key in options}
    q, k, v, k_pool, v_pool, table = paged_problem(lengths_q, lengths_k, page_size, **problem_options)
    cu_q, cu_k = cu_seqlens(lengths_q, DEVICE), cu_seqlens(lengths_k, DEVICE)
    launches = hopper.fwd_launch_count
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max(lengths_q),
                                                         max(lengths_k), block_table=table, return_attn_probs=True,
                                                         **options)
    assert hopper.fwd_launch_count == launches + int(expect_gluon)
    assert_checks_ok(compare_varlen_with_reference(out, lse, q, k, v, cu_q, cu_k, max(lengths_k), **options))
    return out


PAGED_CASES = {
    "pages64-causal": (64, dict(causal=True)),
    "pages64-full": (64, dict()),
    "pages128-causal-gqa4": (128, dict(causal=True, heads=8, heads_k=2)),
    "pages256-full": (256, dict()),
    "pages256-window": (256, dict(window_size=(200, 0))),
    "pages512-two-sided-window": (512, dict(window_size=(300, 100))),
    "pages192-causal": (192, dict(causal=True)),
    "pages64-d64-causal": (64, dict(causal=True, head_dim=64)),
    "pages128-d96": (128, dict(head_dim=96)),
    "pages256-d256-causal": (256, dict(causal=True, head_dim=256)),
    "pages64-d192-v128-causal": (64, dict(causal=True, head_dim=192, head_dim_v=128)),
    "pages64-fp16-softmax-scale": (64, dict(dtype=torch.float16, softmax_scale=0.05)),
    "pages128-wide-table": (128, dict(causal=True, width_pages=5)),
}


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("case", list(PAGED_CASES))
def test_paged_varlen_on_the_gluon_forward(case):
    """Sequences shorter than a page, across many pages, empty ones (queries without keys, keys without queries),
    longer keys than queries; the Gluon forward runs each."""
    page_size, options = PAGED_CASES[case]
    run_paged([300, 1, 0, 700, 129], [400, 77, 50, 1100, 129], page_size, **options)


@needs_hopper
@pytest.mark.gpu
def test_paged_calls_outside_the_gluon_rules_run_the_triton_kernel():
    """Pages of 16 keys stay on the Triton kernel with the same result (pools whose pages are not in a row: the CPU
    rule test above)."""
    run_paged([200, 31], [260, 90], 16, expect_gluon=False, causal=True)


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [64, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_pages_outside_the_pool_are_absent_as_on_the_triton_kernel(page_size, causal):
    """Block-table entries outside [0, num_pages) (negative, past the pool): their keys are absent (docs/api.md
    §6), and no memory outside the pool is read; the Gluon forward's out and LSE equal the Triton kernel's within
    rounding (rows left with no key: out 0, LSE +inf on both)."""
    lengths_q, lengths_k = [300, 257, 64], [600, 513, 64]
    q, _, _, k_pool, v_pool, table = paged_problem(lengths_q, lengths_k, page_size, spare_pages=0)
    table[0, 1] = -7
    table[1, 0] = k_pool.shape[0] + 3
    table[2, 0] = 2 ** 31 - 1  # the sequence's only page: its rows see no key
    cu_q, cu_k = cu_seqlens(lengths_q, DEVICE), cu_seqlens(lengths_k, DEVICE)
    k_pool = torch.nan_to_num(k_pool)  # pages outside the pool are absent; the NaN of unowned rows is another test
    v_pool = torch.nan_to_num(v_pool)

    def call():
        return flashtriton.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                  causal=causal, block_table=table, return_attn_probs=True)[:2]

    launches = hopper.fwd_launch_count
    with poisoned_outputs():
        out, lse = call()
        assert hopper.fwd_launch_count == launches + 1
        with forced_gluon(False):
            expected_out, expected_lse = call()
    assert hopper.fwd_launch_count == launches + 1
    torch.testing.assert_close(out, expected_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, expected_lse, atol=1e-3, rtol=1e-3)
    assert torch.isinf(lse[:, cu_q[2]:cu_q[3]]).all() and (out[cu_q[2]:cu_q[3]] == 0).all()


@needs_hopper
@pytest.mark.gpu
def test_new_pools_tables_and_lengths_do_not_recompile():
    """Pools of other page counts, block tables of other widths and new lengths reuse the compiled Gluon forward
    (its paged group is unspecialized); only a new page size class (key block 64 against the config's) compiles
    another."""
    kernel = hopper.attn_fwd_hopper_kernel

    def compiled_count():
        return sum(len(cache[0]) for cache in kernel.device_caches.values())

    run_paged([300, 40], [500, 90], 256, causal=True)
    before = compiled_count()
    run_paged([129, 1000, 7], [129, 1200, 300], 256, causal=True, width_pages=3)
    run_paged([64], [4000], 512, causal=True)
    assert compiled_count() == before

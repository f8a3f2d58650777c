"""Work scheduling of the Gluon forward (ops/hopper.forward_grid, tail_split, tile_key_blocks; kernels/hopper/
schedule.py): grid sizes, the cut of a persistent grid's last wave (every key block once, whole tiles written
directly, pieces merged by attn_tail_merge_kernel), and on sm_90 GPUs the cut forward against the float64 reference.
The schedule's arithmetic runs on CPU; the kernel cases only on sm_90 (Gluon has no interpreter)."""

import dataclasses

import pytest
import torch

from flashtriton import configs
from flashtriton.ops import hopper
from flashtriton.testing import Case, assert_checks_ok, forced_hopper_grid, run_forward_case

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not ON_HOPPER or hopper.attn_fwd_hopper_kernel is None,
                                  reason="the Gluon forward runs on sm_90 only")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("persistent", [False, True], ids=["per-tile", "persistent"])
def test_grid_sizes(monkeypatch, persistent, causal):
    """One program per tile, or (persistent) at most one per SM over the work items: tiles, or for causal calls
    pairs of tiles (an odd count leaves the middle tile alone); the test cap bounds both."""
    monkeypatch.setattr(hopper, "_multiprocessors", lambda device: 132)
    config = configs.HopperFwdConfig(128, 2, 240, persistent=persistent)
    paired = persistent and causal
    for num_tiles, batch_heads in ((8, 256), (7, 3), (1, 1)):
        items = (num_tiles + 1) // 2 * batch_heads if paired else num_tiles * batch_heads
        expected = min(items, 132) if persistent else items
        assert hopper.forward_grid(num_tiles, batch_heads, config, causal, "cuda") == (expected, paired)
    monkeypatch.setattr(hopper, "PROGRAMS_CAP", 3)
    assert hopper.forward_grid(8, 256, config, causal, "cuda") == (3, paired)


def _tail_pieces(split: hopper.TailSplit, programs: int, tile_blocks) -> dict:
    """The model of kernels/hopper/schedule.next_piece's tail: {program: [(tail tile, first position, blocks, slot)]}
    for tail tiles of tile_blocks[t] key blocks laid end to end (slot -1: the whole tile)."""
    starts = [sum(tile_blocks[:t]) for t in range(len(tile_blocks))]
    pieces = {}
    for program in range(programs):
        if program >= split.programs:
            continue
        x_start = program * split.blocks // split.programs
        x_end = (program + 1) * split.blocks // split.programs
        x = x_start
        while x < x_end:
            tile = max(t for t in range(len(starts)) if starts[t] <= x)
            count = min(x_end - x, starts[tile] + tile_blocks[tile] - x)
            slot = -1 if count == tile_blocks[tile] else 2 * program + (x != x_start)
            pieces.setdefault(program, []).append((tile, x, count, slot))
            x += count
    return pieces


def _merged_slots(split: hopper.TailSplit, first: int, blocks: int) -> list:
    """attn_tail_merge_kernel's slots for the tail tile at positions [first, first + blocks) ([] if one
    program ran it whole)."""
    def programs_upto(x):
        return min(split.programs, -(-((x + 1) * split.programs) // split.blocks))

    first_program, last_program = programs_upto(first) - 1, programs_upto(first + blocks - 1) - 1
    if last_program == first_program:
        return []
    return [2 * p + (p * split.blocks // split.programs < first) for p in range(first_program, last_program + 1)]


TAIL_GRIDS = [(2048, 132, False, 8, 128, 1024, 1024), (2048, 132, False, 128, 128, 16384, 16384),  # 16k-token d128
              (1024, 132, False, 128, 64, 16384, 16384),  # d256 (64-key blocks)
              (2048, 132, True, 32, 128, 4096, 4096), (1024, 132, True, 8, 128, 1024, 1024),  # causal pairs
              (48, 5, False, 8, 128, 1000, 1000), (24, 5, True, 8, 128, 1000, 1000), (36, 5, False, 6, 64, 1000, 1000),
              (16, 5, True, 4, 128, 512, 1024), (35, 4, False, 35, 128, 4500, 129)]


@pytest.mark.parametrize("items,programs,paired,num_tiles,block_n,seqlen_q,seqlen_k", TAIL_GRIDS)
@pytest.mark.parametrize("min_blocks", [1, 4])
def test_tail_split_covers_the_last_wave_once(items, programs, paired, num_tiles, block_n, seqlen_q, seqlen_k,
                                             min_blocks):
    """ops/hopper.tail_split and the kernel's cut of it (modelled by _tail_pieces): every key block of every
    tail tile in exactly one piece, each program's share within min_blocks of the others and at least min_blocks,
    partial results in distinct slots below 2 * programs, and the merge reading exactly the slots of each cut
    tile's pieces. Grids where the cut would not help (no partial wave, or no more programs than tail items) get
    none."""
    tile_rows = seqlen_q // num_tiles if seqlen_q % num_tiles == 0 else -(-seqlen_q // num_tiles)
    split = hopper.tail_split(items, programs, paired, num_tiles, tile_rows, block_n, seqlen_q, seqlen_k, paired,
                              min_blocks)
    full_waves, tail_items = divmod(items, programs)
    if split is None:
        tail_blocks = tail_items * _item_blocks(paired, num_tiles, tile_rows, block_n, seqlen_q, seqlen_k)
        assert tail_items == 0 or min(programs, tail_blocks // min_blocks) <= tail_items
        return
    assert split.full_items == full_waves * programs
    per_tile = [hopper.tile_key_blocks(t, num_tiles, tile_rows, block_n, seqlen_q, seqlen_k, paired)
                for t in range(num_tiles)]
    # the tail's items in the kernel's order: tiles s and num_tiles - 1 - s paired, else one tile each (non-causal
    # tiles all alike, so which one does not matter here)
    slots_per_head = num_tiles // 2 if paired else num_tiles
    tile_blocks = []
    for item in range(split.full_items, items):
        slot = item % slots_per_head  # any slot of equal length would do: the test checks lengths, not identities
        tile_blocks += [per_tile[slot], per_tile[num_tiles - 1 - slot]] if paired else [per_tile[0]]
    assert len(tile_blocks) == split.tiles and sum(tile_blocks) == split.blocks
    pieces = _tail_pieces(split, programs, tile_blocks)
    shares = [sum(count for _, _, count, _ in pieces.get(p, [])) for p in range(split.programs)]
    assert min(shares) >= min_blocks and max(shares) - min(shares) <= 1
    covered = [0] * split.blocks
    written = {}
    for program, program_pieces in pieces.items():
        for tile, x, count, slot in program_pieces:
            for position in range(x, x + count):
                covered[position] += 1
            if slot >= 0:
                assert 0 <= slot < 2 * split.programs and slot not in sum(written.values(), [])
                written.setdefault(tile, []).append(slot)
    assert covered == [1] * split.blocks
    starts = [sum(tile_blocks[:t]) for t in range(len(tile_blocks))]
    for tile, blocks in enumerate(tile_blocks):
        assert sorted(_merged_slots(split, starts[tile], blocks)) == sorted(written.get(tile, []))


def _item_blocks(paired, num_tiles, tile_rows, block_n, seqlen_q, seqlen_k) -> int:
    blocks = [hopper.tile_key_blocks(t, num_tiles, tile_rows, block_n, seqlen_q, seqlen_k, paired)
              for t in range(num_tiles)]
    return blocks[0] + blocks[-1] if paired else blocks[0]


@pytest.mark.parametrize("paired,num_tiles,seqlen_q,seqlen_k", [(True, 7, 900, 900), (True, 8, 1024, 512),
                                                                (True, 6, 700, 300)])
def test_tail_split_skips_items_of_different_lengths(paired, num_tiles, seqlen_q, seqlen_k):
    """Causal pairs whose key blocks do not add up to one length (an odd tile count's middle tile alone, rows past
    the keys' end) are not cut: the kernel's positions assume one item length."""
    assert hopper.tail_split(num_tiles * 7, 5, paired, num_tiles, 128, 128, seqlen_q, seqlen_k, True, 1) is None


def test_warmup_compiles_the_tail_merge(monkeypatch):
    """`flashtriton warmup` adds a call whose last wave is cut (the merge compiles only on such calls) where the table
    cuts tails, with the fewest heads that do at seqlen 2048 on a 132-SM Hopper GPU: 16 tiles per head, 9 heads (144
    items, 12 in the last wave); none where it does not cut them or the GPU is no Hopper one."""
    from flashtriton import warmup

    monkeypatch.setattr(hopper, "_multiprocessors", lambda device: 132)
    monkeypatch.setattr(hopper, "is_hopper", lambda device: True)
    for key, config in configs.HOPPER_FWD.items():
        heads = warmup.tail_cut_heads(*key, "cuda")
        assert heads == (9 if config.persistent and config.split_tail else None), key
    monkeypatch.setattr(hopper, "is_hopper", lambda device: False)
    assert warmup.tail_cut_heads(128, False, "cuda") is None


TAIL_CASES = {  # name: (head_dim, causal, seqlen_q, seqlen_k, heads, heads_k, programs)
    "d128-full-ragged": (128, False, 1000, 1000, 3, 3, 5),
    "d128-full-7-programs": (128, False, 1000, 1000, 3, 3, 7),
    "d128-causal": (128, True, 1000, 1000, 3, 3, 5),
    "d128-causal-sq<sk": (128, True, 512, 1024, 3, 3, 5),
    "d128-gqa": (128, False, 700, 300, 4, 2, 5),
    "d64-full-three-consumers": (64, False, 1000, 1000, 3, 3, 5),
    "d64-causal": (64, True, 1000, 1000, 3, 3, 5),
    "d256-full": (256, False, 1000, 1000, 3, 3, 5),
    "d256-causal-persistent": (256, True, 1000, 1000, 3, 3, 5),
    "d96-full-two-chunks": (96, False, 1000, 1000, 3, 3, 5),
    "d80-causal-two-chunks": (80, True, 1000, 1000, 3, 3, 5),
    "d192-full-two-chunks": (192, False, 1000, 1000, 3, 3, 5),
    "d128-full-configured-grid": (128, False, 2048, 2048, 12, 12, None),
    "d64-causal-configured-grid": (64, True, 2048, 2048, 20, 20, None),
}


@needs_hopper
@pytest.mark.parametrize("name", list(TAIL_CASES))
def test_gluon_forward_tail_split(monkeypatch, name):
    """The cut last wave (configs.HopperFwdConfig.split_tail, at least one key block per program's share so that
    pieces are short and many): partial results merged by attn_tail_merge_kernel, whole tail tiles written
    directly, ragged key blocks in a piece's first block, causal pairs, GQA, every head dim, a small capped grid and
    the configured one."""
    head_dim, causal, seqlen_q, seqlen_k, heads, heads_k, programs = TAIL_CASES[name]
    config = dataclasses.replace(configs.HOPPER_FWD[head_dim, causal], persistent=True, split_tail=True,
                                 tail_min_blocks=1)
    monkeypatch.setitem(configs.HOPPER_FWD, (head_dim, causal), config)
    merges = hopper.tail_merge_count
    with forced_hopper_grid(programs):
        checks, ran = run_forward_case(Case(batch=2 if programs else 1, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                            num_heads=heads, num_heads_k=heads_k, head_dim=head_dim,
                                            dtype=torch.bfloat16, causal=causal))
    assert ran, "the Gluon forward did not run"
    assert hopper.tail_merge_count > merges, "no tail was cut"
    assert_checks_ok(checks)

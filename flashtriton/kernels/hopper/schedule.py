"""Work items of the Hopper forward (fwd.py) and its tail merge: which query tile of which (batch, head) a program
runs next, its key-block range, and the stream-K style cut of a persistent grid's last wave (ops/hopper.tail_split).
Every partition of the forward holds this code: it is branch-free integer arithmetic on the program's cursor."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..common import clamped_range
from .common import grouped_tile_of, kv_block_range, sequence_rows


@gluon.jit
def slots(num_tiles, paired):
    """Work items per (batch, head): its tiles, or paired (persistent causal grids) pairs of them (item_tiles)."""
    return gl.where(paired != 0, (num_tiles + 1) // 2, num_tiles)


@gluon.jit
def item_tiles(item, num_tiles, num_batch_heads, heads_per_group, paired):
    """Work item `item`'s (batch * heads index) and its tiles as a range (first, end, step), tiles numbered longest
    first, items in grouped_tile_of's order. Unpaired an item is one tile; paired (persistent causal grids) item s
    is tiles s and num_tiles - 1 - s, whose key blocks add up to the same count for every s, so that programs taking
    items in turn get equal work."""
    slot, batch_head = grouped_tile_of(item, slots(num_tiles, paired), num_batch_heads, heads_per_group)
    end = gl.where(paired != 0, num_tiles - slot, slot + 1)
    return batch_head, slot, end, gl.maximum(num_tiles - 1 - 2 * slot, 1)


@gluon.jit
def tile_work(tile, batch_head, num_tiles, num_heads, seqlen_q, seqlen_k, causal, window, seqs,
              TILE_ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """(batch, head, first query row, one past its last key block, key blocks, bounds) of a tile (numbered longest
    first); its blocks are visited from the last down. window: () or (window_left, window_right), a local window
    (kernels/common.kv_block_range's bounds: the blocks any of the tile's rows sees). At least one key block, even
    for a tile whose rows see no key (a causal tile whose rows all precede the first key, sq > sk; a window outside
    the keys): it comes back fully masked, so those rows see no key.
    seqs: () for a dense (B, S, H, D) call, or (CuSeqlensQ, CuSeqlensK, q_rows, k_rows, pages) for a varlen one,
    whose tensors are (1, T, H, D) to the descriptors: the lengths are the sequence's own, seqlen_q and seqlen_k the
    longest (num_tiles counts tiles of the longest); a tile past its sequence's end has no key block (the caller
    skips it). pages: () or sequence_pages' group for keys in a paged pool (block_rows): the sequence's keys start at
    key 0 of its block-table row and their count is clamped to the row's capacity (k_rows). bounds: (the sequence's
    query and key lengths, its first q and k rows, the descriptors' batch coordinate)."""
    batch = batch_head // num_heads
    m_start = (num_tiles - 1 - tile) * TILE_ROWS
    q_start = m_start * 0
    k_start = q_start
    desc_batch = batch
    if len(seqs) > 0:
        q_start, seqlen_q = sequence_rows(seqs[0], batch, seqs[2])
        if len(seqs[4]) > 0:
            key_start = gl.load(seqs[1] + batch)
            k_start, seqlen_k = clamped_range(key_start * 0, gl.load(seqs[1] + batch + 1) - key_start, seqs[3])
        else:
            k_start, seqlen_k = sequence_rows(seqs[1], batch, seqs[3])
        desc_batch = q_start * 0
    key_end = seqlen_k
    if causal != 0:
        key_end = gl.minimum(m_start + TILE_ROWS + (seqlen_k - seqlen_q), seqlen_k)
    end_block = gl.maximum(gl.cdiv(key_end, BLOCK_N), 1)
    first_block = end_block * 0
    if len(window) > 0:
        first_block, _, _, end_block = kv_block_range(m_start, (seqlen_q, seqlen_k, window[0], window[1]), TILE_ROWS,
                                                      BLOCK_N, True)
        # at least one block, within the keys' blocks (one for seqlen_k 0)
        first_block = gl.minimum(first_block, gl.maximum(gl.cdiv(seqlen_k, BLOCK_N), 1) - 1)
        end_block = gl.maximum(end_block, first_block + 1)
    count = end_block - first_block
    if len(seqs) > 0:
        count = gl.where(m_start < seqlen_q, count, 0)
    return (batch, batch_head % num_heads, m_start, end_block, count,
            (seqlen_q, seqlen_k, q_start, k_start, desc_batch))


@gluon.jit
def tail_range(tail):
    """This program's share [start, end) of the tail (tail: (full_items, programs, blocks, item_blocks), or
    (full_items, ) where no tail is cut (configs.HopperFwdConfig.split_tail off: none of its code is compiled);
    ops/hopper.tail_split): the work items from full_items on, their tiles one after the other and each tile's
    key blocks in visiting order (last first), as `blocks` positions cut evenly among the first `programs`
    programs."""
    start = gl.program_id(0) * 0
    end = start
    if len(tail) > 1:
        mine = (gl.program_id(0) < tail[1]).to(gl.int32)
        programs = gl.maximum(tail[1], 1)
        start = mine * (gl.program_id(0) * tail[2] // programs)
        end = mine * ((gl.program_id(0) + 1) * tail[2] // programs)
    return start, end


@gluon.jit
def first_cursor(tail):
    """The program's cursor before its first piece (next_piece): its first item, its first tile, its tail share."""
    x_start, x_end = tail_range(tail)
    return gl.program_id(0), x_start * 0, x_start, x_end


@gluon.jit
def more_work(item, x, x_end, tail):
    """Whether the program has work left: a whole item below full_items, or positions of its tail share."""
    more = item < tail[0]
    if len(tail) > 1:
        more = more | (x < x_end)
    return more


@gluon.jit
def next_piece(item, which, x, x_start, x_end, tail, work, TILE_ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """The program's next piece of work, from its cursor: tile `which` of work item `item` (the program's items p,
    p + P, ... below full_items = tail[0]), each tile whole; then positions [x, x_end) of its tail share [x_start,
    x_end) (tail_range; every tail item has item_blocks = tail[3] key blocks: a paired item's first tile, then its
    second), a tile's part at a time. Returns (batch, head, first query row, the first key block visited, key
    blocks, slot, the cursor after it, tile_work's bounds): the blocks are visited from the first one down (none: a
    varlen tile past its sequence's end, which the caller skips); slot -1: the piece is its
    tile's whole (O and the LSE go to the output), else 2 P + 0 for the piece at the start of the program's share,
    2 P + 1 for the one at its end (ops/hopper.tail_split's workspace, which attn_tail_merge_kernel
    merges). work: (num_tiles, num_batch_heads, heads_per_group, num_heads, seqlen_q, seqlen_k, causal, paired,
    window, seqs) (window, seqs: tile_work's).
    Branch-free, one copy of the item arithmetic for both kinds of piece: each partition holds this code."""
    num_tiles, num_batch_heads, heads_per_group, num_heads, seqlen_q, seqlen_k, causal, paired, window, seqs = work
    if len(tail) > 1:
        in_tail = item >= tail[0]
        offset = x // tail[3]
        batch_head, first_tile, end_tile, tile_step = item_tiles(gl.where(in_tail, tail[0] + offset, item),
                                                                 num_tiles, num_batch_heads, heads_per_group, paired)
        first_blocks = tile_work(first_tile, batch_head, num_tiles, num_heads, seqlen_q, seqlen_k, causal, window,
                                 seqs, TILE_ROWS, BLOCK_N)[4]
        position = x - offset * tail[3]
        which = gl.where(in_tail, (position >= first_blocks).to(gl.int32), which)
        tile = first_tile + which * tile_step
        batch, head, m_start, end_block, n_blocks, bounds = tile_work(tile, batch_head, num_tiles, num_heads,
                                                                      seqlen_q, seqlen_k, causal, window, seqs,
                                                                      TILE_ROWS, BLOCK_N)
        # blocks of the tile visited before this piece
        before = gl.where(in_tail, position - which * first_blocks, 0)
        count = gl.where(in_tail, gl.minimum(x_end - x, n_blocks - before), n_blocks)
        slot = gl.where(in_tail & (count < n_blocks), 2 * gl.program_id(0) + (x != x_start).to(gl.int32), -1)
        last_of_item = tile + tile_step >= end_tile
        next_item = gl.where(in_tail | ~last_of_item, item, item + gl.num_programs(0))
        x = x + in_tail.to(gl.int32) * count
    else:
        batch_head, first_tile, end_tile, tile_step = item_tiles(item, num_tiles, num_batch_heads, heads_per_group,
                                                                 paired)
        tile = first_tile + which * tile_step
        batch, head, m_start, end_block, n_blocks, bounds = tile_work(tile, batch_head, num_tiles, num_heads,
                                                                      seqlen_q, seqlen_k, causal, window, seqs,
                                                                      TILE_ROWS, BLOCK_N)
        before = 0
        count = n_blocks
        slot = -1
        last_of_item = tile + tile_step >= end_tile
        next_item = gl.where(last_of_item, item + gl.num_programs(0), item)
    next_which = gl.where(last_of_item, 0, which + 1)
    return batch, head, m_start, end_block - 1 - before, count, slot, next_item, next_which, x, bounds


@gluon.jit
def sequence_pages(pages, batch):
    """pages with its block table moved to sequence `batch`'s row: () without pages, else (the row's first entry,
    page_size, num_pages, pieces) from (BlockTable, stride_bt, page_size, num_pages, pieces) (docs/api.md §3.4: key
    t of the sequence is row t % page_size of page row[t // page_size] of a (num_pages, page_size, Hk, D) pool;
    pieces: one entry per part of a key block that lies in one page, block_rows')."""
    row = ()
    if len(pages) > 0:
        row = (pages[0] + batch.to(gl.int64) * pages[1], pages[2], pages[3], pages[4])
    return row


@gluon.jit
def _page_of(row_pages, key):
    """(the pool row of key `key` of a sequence in a paged pool, whether its page is in the pool) (row_pages:
    sequence_pages' entry). A page id outside [0, num_pages) gives the row just past the pool, where TMA reads
    zeros."""
    page = gl.load(row_pages[0] + key // row_pages[1])
    present = (page >= 0) & (page < row_pages[2])
    return gl.where(present, page * row_pages[1] + key % row_pages[1], row_pages[2] * row_pages[1]), present


@gluon.jit
def block_rows(row_pages, row0, block, BLOCK_N: gl.constexpr):
    """The descriptors' first rows of the pieces of key block `block` of a sequence whose keys start at row0: (row0 +
    block * BLOCK_N, ), or in a paged pool (row_pages: sequence_pages' entry; the pool is (1, num_pages * page_size,
    Hk, D) to the descriptors) one row per piece of the block (len(row_pages[3]) pieces of BLOCK_N / pieces keys,
    each in one page: a block wider than a page is read page by page). Pages outside the pool read zeros (_page_of;
    the consumers mask those keys: page_presence)."""
    rows = (row0 + block * BLOCK_N, )
    if len(row_pages) > 0:
        PIECE: gl.constexpr = BLOCK_N // len(row_pages[3])
        rows = ()
        for piece in gl.static_range(len(row_pages[3])):
            rows = rows + (_page_of(row_pages, block * BLOCK_N + piece * PIECE)[0], )
    return rows


@gluon.jit
def page_presence(row_pages, block, BLOCK_N: gl.constexpr):
    """() without pages, else whether each piece of key block `block` (block_rows') lies on a page in the pool
    (_page_of's test)."""
    presence = ()
    if len(row_pages) > 0:
        PIECE: gl.constexpr = BLOCK_N // len(row_pages[3])
        for piece in gl.static_range(len(row_pages[3])):
            presence = presence + (_page_of(row_pages, block * BLOCK_N + piece * PIECE)[1], )
    return presence


@gluon.jit
def mask_absent_page(s, presence, zero_s, col_s: gl.constexpr):
    """Scores s [ROWS, BLOCK_N] of a key block with the keys of its pieces on pages outside the pool at -inf
    (presence: page_presence's; zero_s: zeros of s's shape and layout): such keys are absent, as in the Triton
    kernel (docs/api.md §6). A warp-uniform branch: blocks whose pages are all in the pool run no per-score select."""
    if len(presence) == 1:
        if presence[0] == 0:
            s = zero_s + float("-inf")
    elif len(presence) > 1:
        all_present = presence[0]
        for piece in gl.static_range(1, len(presence)):
            all_present = all_present & presence[piece]
        if all_present == 0:
            BLOCK_N: gl.constexpr = s.shape[1]
            PIECE: gl.constexpr = BLOCK_N // len(presence)
            # [BLOCK_N] each column's piece
            piece_of = gl.arange(0, BLOCK_N, col_s) // PIECE
            absent = piece_of < 0
            for piece in gl.static_range(len(presence)):
                absent = absent | ((piece_of == piece) & (presence[piece] == 0))
            s = gl.where(gl.expand_dims(absent, 0), float("-inf"), s)
    return s

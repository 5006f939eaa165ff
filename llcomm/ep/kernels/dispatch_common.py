"""The send stage both dispatches share, but for the rows: the top-k scan, the counts and the
metadata words, as int32 words (flag dispatch) or LL words (``LL`` = 1).

Block b owns experts ``b + NB * i`` (their counts, and the metadata of every top-k entry that
names one of them) and tokens ``b + NB * j`` (their rows, and the -1 metadata of their entries
for every other rank). One scan over this rank's top-k rows, ``TILING.SCAN_TILE`` tokens at
a time, marks which tokens route to each own expert; an exclusive running sum of those marks is the
prefix (earlier tokens of this rank routed to the same expert), and its total the count. A
metadata word is ``(local expert << 16) | prefix``. The receiver then places the pair (s, t)'s
row of expert e at ``sum(count[s'][e] for s' < s) + prefix``: rows are source rank major, then
source token order, packed from 0, whatever the arrival order, without atomics.
"""
from collections import namedtuple

import triton
import triton.language as tl

from .common import META_SHIFT, NTOK_BITS, NTOK_TAG_MASK, _at, _ll_word, _stamp

#: The runtime arguments of both dispatch kernels, in order (the host passes them so:
#: ``peer.PeerEP.dispatch``; a test checks both kernels against this list). ``T``: the
#: buffer's max tokens per rank (``SIZES.MAX_TOKENS``).
#:
#: ========== =================================================================================
#: x          ``[n_tok, H]`` this rank's tokens (buffer dtype; 16-byte aligned)
#: topk       ``[n_tok, K]`` int64 global expert ids, -1 = none
#: n_tok      tokens of this rank (<= T)
#: recv_x     ``[L, W * T, H]`` output (FP8: its uint8 view)
#: recv_scales ``[L, W * T, NS]`` fp32 output (FP8 only; any pointer otherwise); with DEEP_EP
#:            DeepEP's storage, ``[L, NS, W * T]`` fp32 or ``[L, NS / 4, W * T]`` int32
#: row_of     ``[W, T, K]`` int32 handle: flat row ``e * W * T + row`` of (s, t, k), or -1
#: src_info   ``[L, W * T]`` int32 handle: ``s * T + t`` of each row
#: recv_count ``[L]`` int32 output
#: ntok_out   ``[W]`` int32 handle: tokens each source sent
#: tab        ``[W]`` int64: every rank's EP region base address
#: ctrl       ``[NB]`` int64: dispatch counter of each block
#: err        int64: device error word, host error address, host input-error address, then
#:            the mask words and profiling stamps (common.py)
#: rank       this rank
#: tag        the call's size tag (protocol.size_tag)
#: timeout_us the waits' bound (the launcher raises it for a first, compiling launch)
#: wts        ``[n_tok, K]`` fp32 top-k weights (CARRY only; any pointer otherwise)
#: w_off      CARRY: byte offset of the handle slot's weights region
#: stats      STATS: ``[W]`` int64 wait statistics, ns waited per source (None otherwise)
#: deep_src   DEEP_EP: ``[L, W * T]`` int32, DeepEP's src_info (None otherwise)
#: deep_layout DEEP_EP: ``[L, W]`` int64, DeepEP's layout_range (None otherwise)
#: deep_stats DEEP_EP: ``[L]`` int32 cumulative received rows, or None
#: ========== =================================================================================
DISPATCH_ARGS = ("x", "topk", "n_tok", "recv_x", "recv_scales", "row_of", "src_info",
                 "recv_count", "ntok_out", "tab", "ctrl", "err", "rank", "tag", "timeout_us",
                 "wts", "w_off", "stats", "deep_src", "deep_layout", "deep_stats")
#: Byte offsets in a buffer set (constexpr ``REGIONS`` of both dispatch kernels): the set's
#: size, the flags, the receive slots of rows, metadata, counts and token counts, FP8 scales,
#: and the carried weights' LL words (the LL dispatch); and the number of sets (call k uses
#: set k % SETS: kernels/__init__.py, "Buffer sets").
DispatchRegions = namedtuple("DispatchRegions", ["SET_BYTES", "SIGNAL", "ROWS", "META",
                                                 "COUNTS", "NTOK", "SCALES", "WEIGHTS_LL",
                                                 "SETS"])
#: How the dispatch's loops are cut (constexpr ``TILING``): experts a block counts (pow2),
#: tokens per tile of the top-k scan, the scan's one tile for few tokens, tokens a block owns
#: at most (pow2), local experts summed per step of recv_count, flags the flag dispatch's wait
#: polls (pow2 of blocks x ranks).
Tiling = namedtuple("Tiling", ["EXPERTS_PER_BLOCK", "SCAN_TILE", "SMALL_SCAN_TILE",
                               "TOKENS_PER_BLOCK", "COUNT_CHUNK", "FLAGS_P2"])
#: A row slot's format (constexpr ``ROW``): FP8 scales per row (H // 128, or 1) and their pow2,
#: the int32 words a row crosses as in the LL dispatch (FP8: e4m3 bytes four to a word) and
#: their pow2, the lanes of a row.
RowFormat = namedtuple("RowFormat", ["SCALES", "SCALES_P2", "WORDS", "WORDS_P2"])
#: The dispatch's outputs (runtime pointers): recv_x (FP8: its uint8 view), recv_scales, and
#: the handle's row_of, src_info, recv_count and per-source token counts.
Out = namedtuple("Out", ["recv_x", "recv_scales", "row_of", "src_info", "recv_count", "ntok"])


@triton.jit
def _store_words(base, idx, v, m, ehi, LL: tl.constexpr):
    """int32 values ``v`` at word ``idx`` from byte address ``base`` (a region's address, one
    per lane or for all): plain int32 words, or (LL) LL words with the epoch bits ``ehi``
    (metadata, counts and token counts, which the region holds in 8 bytes either way)."""
    if LL:
        tl.store(base.to(tl.pointer_type(tl.int64)) + idx, _ll_word(ehi, v), mask=m)
    else:
        tl.store(base.to(tl.pointer_type(tl.int32)) + idx, v, mask=m)


@triton.jit
def _store_meta(reg, d, idx, v, m, ehi, OFF: tl.constexpr, LL: tl.constexpr):
    """``_store_words`` into the region at byte OFF of rank d, through ``_at``'s aligned typed
    pointer (on the byte address the dispatch's PTX is about 110 lines longer)."""
    if LL:
        tl.store(_at(reg.tab, d, reg.set_off + OFF, tl.int64) + idx, _ll_word(ehi, v), mask=m)
    else:
        tl.store(_at(reg.tab, d, reg.set_off + OFF, tl.int32) + idx, v, mask=m)


@triton.jit
def _scan_tiles(topk, n_tok, reg, ids, ehi, SIZES, EXPERTS: tl.constexpr, TILE: tl.constexpr,
                OFF_META: tl.constexpr, LL: tl.constexpr):
    """The top-k scan, TILE tokens per tile: for this block's experts ``ids`` (EXPERTS of
    them), the tokens routed to each (returned: counts ``[EXPERTS]``, and the out-of-range
    entries seen), and each entry's metadata word stored into the rank that holds its expert.

    One own expert at a time, in the tile's own ``[TILE, KP]`` layout: its hits, the tokens
    routed to it (a max over the entries), their exclusive running sum over the tokens and
    the metadata words, broadcast back over the entries; the work does not grow with the
    tokens a block owns. (A ``[TILE, KP, EXPERTS]`` compare of every expert at once makes
    Triton move the tile and the words between layouts through shared memory five times a
    tile.)"""
    ks = tl.arange(0, SIZES.KP)
    kmask = ks < SIZES.K
    eix = tl.arange(0, EXPERTS)
    cnt = tl.zeros([EXPERTS], tl.int32)             # tokens so far routed to each own expert
    nbad = tl.full([], 0, tl.int32)
    for t0 in range(0, n_tok, TILE):
        ts = t0 + tl.arange(0, TILE)
        m2 = (ts < n_tok)[:, None] & kmask[None, :]
        tile = tl.load(topk + ts[:, None] * SIZES.K + ks[None, :], mask=m2, other=-1)
        nbad += tl.sum(tl.sum((m2 & ((tile < -1) | (tile >= SIZES.E))).to(tl.int32), axis=1),
                       axis=0)
        tile = tl.where((tile >= 0) & (tile < SIZES.E), tile, -2).to(tl.int32)
        # each entry naming an own expert (at most one of them): its metadata word, stored
        # into the one rank that holds the expert
        meta = tl.zeros([TILE, SIZES.KP], tl.int32)
        mine = tl.zeros([TILE, SIZES.KP], tl.int32)
        for i in tl.static_range(EXPERTS):
            e = tl.sum(tl.where(eix == i, ids, 0), axis=0)              # -1: no expert
            hit = (tile == e).to(tl.int32)                              # [TILE, KP]
            routed = tl.max(hit, axis=1)        # [TILE]: a token listing e twice gets one row
            before = tl.sum(tl.where(eix == i, cnt, 0), axis=0)        # earlier tiles
            pre = before + tl.cumsum(routed, axis=0) - routed           # exclusive
            cnt += tl.where(eix == i, tl.sum(routed, axis=0), 0)
            word = ((e - (e // SIZES.L) * SIZES.L) << META_SHIFT) | pre         # [TILE]
            meta += hit * word[:, None]
            mine += hit
        dv = tile // SIZES.L
        for d in tl.static_range(SIZES.W):
            _store_meta(reg, d,
                        (reg.rank * SIZES.MAX_TOKENS + ts[:, None]) * SIZES.MAX_TOPK + ks[None, :],
                        meta, m2 & (mine > 0) & (dv == d), ehi, OFF_META, LL)
    return cnt, nbad


@triton.jit
def _send_routing(topk, n_tok, err, reg, ehi, tag, SIZES, REGIONS, TILING,
                  STAMP: tl.constexpr, PROFILE: tl.constexpr, LL: tl.constexpr):
    """The send stage but for the rows: the scan (with the metadata of this block's experts),
    the counts, the token count and the -1 metadata. STAMP: profiling stamp 1 once the scan is
    done (when the rows go after)."""
    b = tl.program_id(0)
    ks = tl.arange(0, SIZES.KP)
    kmask = ks < SIZES.K
    es = b + SIZES.NB * tl.arange(0, TILING.EXPERTS_PER_BLOCK)
    emask = es < SIZES.E
    ids = tl.where(emask, es, -1)                   # -1 matches no entry
    # one tile of SMALL_SCAN_TILE tokens when that covers them all (a decode step's few
    # tokens: the compare and the running sum of a 128-token tile cost 0.7 us more at 1 token:
    # bench/results/ab/2026-11-30-ep-block-shape/)
    if n_tok <= TILING.SMALL_SCAN_TILE:
        cnt, nbad = _scan_tiles(topk, n_tok, reg, ids, ehi, SIZES, TILING.EXPERTS_PER_BLOCK,
                                TILING.SMALL_SCAN_TILE, REGIONS.META, LL)
    else:
        cnt, nbad = _scan_tiles(topk, n_tok, reg, ids, ehi, SIZES, TILING.EXPERTS_PER_BLOCK,
                                TILING.SCAN_TILE, REGIONS.META, LL)
    if STAMP:
        _stamp(err, 1, PROFILE, 0, SIZES.NB)    # top-k scan done

    # the counts of experts b + NB * i, into slot (rank, local expert) of the expert's rank;
    # block 0 (which saw every token) reports the out-of-range entries to the host and sends
    # this rank's token count to every rank (LL: with the call's tag in its high bits, for the
    # receivers to check)
    dst = es // SIZES.L
    cbase = tl.load(reg.tab + dst, mask=emask, other=0) + reg.set_off + REGIONS.COUNTS
    _store_words(cbase, reg.rank * SIZES.L + (es - dst * SIZES.L), cnt, emask, ehi, LL)
    if b == 0:
        if nbad > 0:
            tl.store(tl.load(err + 2).to(tl.pointer_type(tl.int64)), nbad.to(tl.int64))
        ps = tl.arange(0, SIZES.WP)
        nbase = tl.load(reg.tab + ps, mask=ps < SIZES.W, other=0) + reg.set_off + REGIONS.NTOK
        nval = n_tok
        if LL:
            nval = (((tag & NTOK_TAG_MASK) << NTOK_BITS) | n_tok).to(tl.int32)
        _store_words(nbase, reg.rank, tl.full([SIZES.WP], 0, tl.int32) + nval, ps < SIZES.W, ehi,
                     LL)

    # -1 metadata of this block's tokens' entries for every rank that does not hold their
    # expert (invalid entries: every rank); the expert's own rank got its word in the scan
    TOKENS_PER_BLOCK: tl.constexpr = TILING.TOKENS_PER_BLOCK
    mt = b + SIZES.NB * tl.arange(0, TOKENS_PER_BLOCK)
    live2 = (mt < n_tok)[:, None] & kmask[None, :]
    own = tl.load(topk + mt[:, None] * SIZES.K + ks[None, :], mask=live2, other=-1)
    dv2 = tl.where((own >= 0) & (own < SIZES.E), own // SIZES.L, -1)
    for d in tl.static_range(SIZES.W):
        _store_meta(reg, d,
                    (reg.rank * SIZES.MAX_TOKENS + mt[:, None]) * SIZES.MAX_TOPK + ks[None, :],
                    tl.full([TOKENS_PER_BLOCK, SIZES.KP], -1, tl.int32), live2 & (dv2 != d), ehi,
                    REGIONS.META, LL)

"""The send stage both dispatches share, but for the rows: the top-k scan, the counts and the
metadata words, as int32 words (flag dispatch) or LL words (``LL`` = 1).

Block b owns experts ``b + NB * i`` (their counts, and the metadata of every top-k entry that
names one of them) and tokens ``b + NB * j`` (their rows, and the -1 metadata of their entries
for every other rank). One scan over this rank's top-k rows, a tile of TT tokens at a time,
marks which tokens route to each own expert; an exclusive running sum of those marks is the
prefix (earlier tokens of this rank routed to the same expert), and its total the count. A
metadata word is ``(local expert << 16) | prefix``. The receiver then places the pair (s, t)'s
row of expert e at ``sum(count[s'][e] for s' < s) + prefix``: rows are source rank major, then
source token order, packed from 0, whatever the arrival order, without atomics.
"""
from collections import namedtuple

import triton
import triton.language as tl

from .common import META_SHIFT, NTOK_BITS, NTOK_TAG_MASK, _at, _ll_word, _stamp

#: The dispatch's receive regions in a buffer set (constexpr byte offsets: rows, metadata,
#: counts, token counts, FP8 scales) and the FP8 scales per row and its pow2.
Recv = namedtuple("Recv", ["X", "META", "CNT", "NTOK", "SC", "NS", "NSP"])
#: How the dispatch's loops are cut (constexpr): experts a block counts (pow2), tokens per tile
#: of the top-k scan, the scan's one tile for few tokens, tokens a block owns at most (pow2),
#: local experts summed per step of recv_count.
Tiles = namedtuple("Tiles", ["EB", "TT", "TS", "JP", "LB"])
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
def _scan_tiles(topk, n_tok, reg, ids, ehi, S, EB: tl.constexpr, TT: tl.constexpr,
                OFF_META: tl.constexpr, LL: tl.constexpr):
    """The top-k scan, TT tokens per tile: for this block's experts ``ids`` (EB of them), the
    tokens routed to each (returned: counts ``[EB]``, and the out-of-range entries seen), and
    each entry's metadata word stored into the rank that holds its expert.

    One own expert at a time, in the tile's own ``[TT, KP]`` layout: its hits, the tokens
    routed to it (a max over the entries), their exclusive running sum over the tokens and
    the metadata words, broadcast back over the entries; the work does not grow with the
    tokens a block owns. (A ``[TT, KP, EB]`` compare of every expert at once makes Triton move
    the tile and the words between layouts through shared memory five times a tile.)"""
    ks = tl.arange(0, S.KP)
    kmask = ks < S.K
    eix = tl.arange(0, EB)
    cnt = tl.zeros([EB], tl.int32)                  # tokens so far routed to each own expert
    nbad = tl.full([], 0, tl.int32)
    for t0 in range(0, n_tok, TT):
        ts = t0 + tl.arange(0, TT)
        m2 = (ts < n_tok)[:, None] & kmask[None, :]
        tile = tl.load(topk + ts[:, None] * S.K + ks[None, :], mask=m2, other=-1)
        nbad += tl.sum(tl.sum((m2 & ((tile < -1) | (tile >= S.E))).to(tl.int32), axis=1),
                       axis=0)
        tile = tl.where((tile >= 0) & (tile < S.E), tile, -2).to(tl.int32)
        # each entry naming an own expert (at most one of them): its metadata word, stored
        # into the one rank that holds the expert
        meta = tl.zeros([TT, S.KP], tl.int32)
        mine = tl.zeros([TT, S.KP], tl.int32)
        for i in tl.static_range(EB):
            e = tl.sum(tl.where(eix == i, ids, 0), axis=0)              # -1: no expert
            hit = (tile == e).to(tl.int32)                              # [TT, KP]
            routed = tl.max(hit, axis=1)        # [TT]: a token listing e twice gets one row
            before = tl.sum(tl.where(eix == i, cnt, 0), axis=0)        # earlier tiles
            pre = before + tl.cumsum(routed, axis=0) - routed           # exclusive
            cnt += tl.where(eix == i, tl.sum(routed, axis=0), 0)
            word = ((e - (e // S.L) * S.L) << META_SHIFT) | pre         # [TT]
            meta += hit * word[:, None]
            mine += hit
        dv = tile // S.L
        for d in tl.static_range(S.W):
            _store_meta(reg, d, (reg.rank * S.T + ts[:, None]) * S.MAX_TOPK + ks[None, :], meta,
                        m2 & (mine > 0) & (dv == d), ehi, OFF_META, LL)
    return cnt, nbad


@triton.jit
def _send_routing(topk, n_tok, err, reg, ehi, tag, S, RV, TI, STAMP: tl.constexpr,
                  PROFILE: tl.constexpr, LL: tl.constexpr):
    """The send stage but for the rows: the scan (with the metadata of this block's experts),
    the counts, the token count and the -1 metadata. STAMP: profiling stamp 1 once the scan is
    done (when the rows go after)."""
    b = tl.program_id(0)
    ks = tl.arange(0, S.KP)
    kmask = ks < S.K
    es = b + S.NB * tl.arange(0, TI.EB)
    emask = es < S.E
    ids = tl.where(emask, es, -1)                   # -1 matches no entry
    # one tile of TS tokens when that covers them all (a decode step's few tokens: the compare
    # and the running sum of a 128-token tile cost 0.7 us more at 1 token:
    # bench/results/ab/2026-11-30-ep-block-shape/)
    if n_tok <= TI.TS:
        cnt, nbad = _scan_tiles(topk, n_tok, reg, ids, ehi, S, TI.EB, TI.TS, RV.META, LL)
    else:
        cnt, nbad = _scan_tiles(topk, n_tok, reg, ids, ehi, S, TI.EB, TI.TT, RV.META, LL)
    if STAMP:
        _stamp(err, 1, PROFILE, 0, S.NB)    # top-k scan done

    # the counts of experts b + NB * i, into slot (rank, local expert) of the expert's rank;
    # block 0 (which saw every token) reports the out-of-range entries to the host and sends
    # this rank's token count to every rank (LL: with the call's tag in its high bits, for the
    # receivers to check)
    dst = es // S.L
    cbase = tl.load(reg.tab + dst, mask=emask, other=0) + reg.set_off + RV.CNT
    _store_words(cbase, reg.rank * S.L + (es - dst * S.L), cnt, emask, ehi, LL)
    if b == 0:
        if nbad > 0:
            tl.store(tl.load(err + 2).to(tl.pointer_type(tl.int64)), nbad.to(tl.int64))
        ps = tl.arange(0, S.WP)
        nbase = tl.load(reg.tab + ps, mask=ps < S.W, other=0) + reg.set_off + RV.NTOK
        nval = n_tok
        if LL:
            nval = (((tag & NTOK_TAG_MASK) << NTOK_BITS) | n_tok).to(tl.int32)
        _store_words(nbase, reg.rank, tl.full([S.WP], 0, tl.int32) + nval, ps < S.W, ehi, LL)

    # -1 metadata of this block's tokens' entries for every rank that does not hold their
    # expert (invalid entries: every rank); the expert's own rank got its word in the scan
    mt = b + S.NB * tl.arange(0, TI.JP)
    live2 = (mt < n_tok)[:, None] & kmask[None, :]
    own = tl.load(topk + mt[:, None] * S.K + ks[None, :], mask=live2, other=-1)
    dv2 = tl.where((own >= 0) & (own < S.E), own // S.L, -1)
    for d in tl.static_range(S.W):
        _store_meta(reg, d, (reg.rank * S.T + mt[:, None]) * S.MAX_TOPK + ks[None, :],
                    tl.full([TI.JP, S.KP], -1, tl.int32), live2 & (dv2 != d), ehi, RV.META, LL)

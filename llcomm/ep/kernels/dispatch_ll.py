"""The LL dispatch (docs/ep.md "Scheme"): no signal and no flag wait; every word is its own flag
(LL: NCCL's protocol of 8-byte words that carry their epoch). Runs for buffers of at most
``peer.LL_MAX_TOKENS`` tokens per rank (without rank masks).

One launch of NB blocks; block b:

1. send (``STAGE_SEND``): carried weights (``CARRY``), then counts and metadata
   (``dispatch_common``) as LL words, then one push of each of its token rows per destination
   rank that holds one of its experts, as int32 words (FP8: quantised and packed here,
   ``fp8._pack_row_fp8``); not to this rank itself when the same launch receives: the expand
   reads its own rows from ``x``.
2. receive (``STAGE_RECV``, ``_expand_ll``): the sources' token counts, then per pair ``(s, t)``
   it owns its metadata, the earlier sources' counts and its row, each word polled until it
   holds this call's epoch (``STAGE_WAIT``; the interpreter tests read once), copied into
   ``recv_x`` and the handle, and its row slot armed again.

The send is the flag dispatch's (``dispatch_common``), but metadata, counts, the token count
(with 15 tag bits of the call) and carried weights go as LL words ``(epoch << 32) | value``,
and rows as int32 words into slots armed with ROW_SENTINEL (a row word equal to it is sent as
ROW_ESCAPE). The receiver (``_expand_ll``) waits for each word where it reads it
(``runtime/kernels/lamport._poll``: one block-wide verdict per poll, bounded by the timeout;
on AMD each read an acquire atomic, ``sync.poll_read``), copies it, and arms the row slot
again. No fence, no flag.

Two buffer sets suffice here too: every receiver waits for every source's token-count word of
the call, which the source writes only after its previous call (and its re-arming) ended.
"""
import triton
import triton.language as tl

from ...runtime.kernels.lamport import _clock, _pending, _poll, limit_ticks
from ...runtime.kernels.sync import after_previous_kernel, report_error, wait_bound
from .common import (EP_RANK_VARYING, LL_HI, LL_LOW, META_MASK, META_SHIFT, NTOK_BITS, NTOK_MASK,
                     NTOK_TAG_MASK, OP_DISPATCH, PHASE_DATA, PROF_LAST, ROW_SENTINEL, STAGE_RECV,
                     STAGE_SEND, STAGE_WAIT, STATUS_MISMATCH, Region, _add_stats_by_rank, _at,
                     _bit_or, _first_entries, _first_token, _poison_received, _push_weights,
                     _rank_bits, _row_words, _seq_at, _seq_sent, _stamp, symbol)
from .deep_ep_layout import (UE8M0_LAYOUT, DeepOut, _deep_ep_totals, _layout_entry,
                             _poison_layout, _scales_to_column)
from .dispatch_common import Out, _send_routing
from .fp8_rows import FP8_BLOCK, _pack_row_fp8


@triton.jit
def _ll_row(x, t, SIZES, ROW, FP8: tl.constexpr):
    """Token t's row as the ``ROW.WORDS`` int32 words it crosses NVLink as (``_row_words``;
    FP8: e4m3 bytes packed four to a word, ``fp8._pack_row_fp8``), and its FP8 scales' words (a
    dummy without FP8)."""
    ws = tl.arange(0, ROW.WORDS_P2)
    if FP8:
        hs = tl.arange(0, SIZES.HP)
        v = tl.load(x + t * SIZES.H + hs, mask=hs < SIZES.H, other=0.0)
        words, sw = _pack_row_fp8(v.to(tl.float32), SIZES.HP, ROW.WORDS_P2, FP8 == 2)
    else:
        words = _row_words(tl.load(x.to(tl.pointer_type(tl.int32)) + t * ROW.WORDS + ws,
                                   mask=ws < ROW.WORDS))
        sw = tl.zeros([1], tl.int32)
    return words, sw


@triton.jit
def _push_row_words(words, sw, bits, reg, slot, SIZES, REGIONS, ROW, FP8: tl.constexpr):
    """A row's words (``_ll_row``), which are their own flag, to the ranks in ``bits``; FP8:
    then its scales."""
    ws = tl.arange(0, ROW.WORDS_P2)
    for d in tl.static_range(SIZES.W):
        if (bits >> d) & 1:
            tl.store(_at(reg.tab, d, reg.set_off + REGIONS.ROWS, tl.int32) + slot * ROW.WORDS
                     + ws, words, mask=ws < ROW.WORDS)
            if FP8:
                ns = tl.arange(0, SIZES.HP // FP8_BLOCK)
                tl.store(_at(reg.tab, d, reg.set_off + REGIONS.SCALES, tl.int32)
                         + slot * ROW.SCALES + ns, sw, mask=ns < ROW.SCALES)


@triton.jit
def _push_rows(x, topk, n_tok, reg, SIZES, REGIONS, ROW, TOKENS_PER_BLOCK: tl.constexpr,
               FP8: tl.constexpr, SKIP_OWN: tl.constexpr):
    """Each of this block's token rows (``_ll_row``) once per destination rank, into the
    source's slot ``rank * MAX_TOKENS + t`` there. SKIP_OWN: not to this rank itself (its
    expand reads the row from x)."""
    b = tl.program_id(0)
    for j in range(0, TOKENS_PER_BLOCK):
        t = b + SIZES.NB * j
        if t < n_tok:
            bits = _rank_bits(topk + t * SIZES.K, SIZES.K, SIZES.E, SIZES.L)
            if SKIP_OWN:
                bits = bits & ~(tl.full([], 1, tl.int64) << reg.rank)
            slot = reg.rank * SIZES.MAX_TOKENS + t
            words, sw = _ll_row(x, t, SIZES, ROW, FP8)
            _push_row_words(words, sw, bits, reg, slot, SIZES, REGIONS, ROW, FP8)


@triton.jit
def _take_ll(ptrs, m, srcs, epoch, failed, limit, err, POLL: tl.constexpr, LLW: tl.constexpr):
    """The words at ``ptrs`` (lanes ``m``) once every one has arrived: LL words (LLW = 1) whose
    epoch is ``epoch``, or row words (LLW = 0) that are not ROW_SENTINEL. ``srcs``: each lane's
    source rank, named in the error word if the wait runs out. Returns (words, failed); after a
    failure nothing is waited for (``failed`` stays 1)."""
    v, status = _poll(ptrs, m, err, 1, failed < 0, failed, limit, ROW_SENTINEL, POLL, epoch,
                      LLW, 1)
    if status > 0:      # STATUS_TIMEOUT (the tag is not checked here); block-uniform
        late = _pending(v, m, ROW_SENTINEL, epoch, LLW)
        bad = tl.reduce(tl.where(late, tl.full(m.shape, 1, tl.int64) << srcs, 0), 0, _bit_or)
        report_error(err, status, OP_DISPATCH, PHASE_DATA, bad)
        failed = 1
    return v, failed


@triton.jit
def _take_ll_timed(ptrs, m, srcs, epoch, failed, limit, err, POLL: tl.constexpr,
                   LLW: tl.constexpr, acc, s, WP: tl.constexpr, STATS: tl.constexpr):
    """``_take_ll`` of words from source rank ``s``; with STATS (wait statistics) the global
    timer's nanoseconds from before the first read until they had all arrived are added to
    ``acc[s]`` (``[WP]`` int64: this block's totals per source; nothing is timed where the
    kernel does not poll: ``lamport._clock``). Returns (words, failed, acc)."""
    if STATS:
        t0 = _clock(POLL)
    v, failed = _take_ll(ptrs, m, srcs, epoch, failed, limit, err, POLL, LLW)
    if STATS:
        acc += tl.where(tl.arange(0, WP) == s, _clock(POLL) - t0, 0)
    return v, failed, acc


@triton.jit
def _copy_rows(dst, flat, first, v, ROW: tl.constexpr, lanes, lm, K: tl.constexpr,
               KP: tl.constexpr):
    """Row ``v`` (lanes ``lanes``, mask ``lm``) into row ``flat[k]`` of ``dst`` (ROW elements
    per row) for every entry k in ``first`` (one row per distinct local expert).

    Each k takes its row from ``[KP]`` tensors spread over a warp's lanes: one sum across
    the lanes gives ``flat[k] + 1``, or 0 where k is not in ``first``, and the store is masked
    on it rather than branched on. So the K sums depend on nothing but ``flat`` and ``first``
    and can be issued together; a branch per k would put 2K chains of shuffles in series with
    the stores."""
    ks = tl.arange(0, KP)
    for k in tl.static_range(K):
        row1 = tl.sum(tl.where((ks == k) & first, flat + 1, 0), axis=0).to(tl.int64)
        # as a lane tensor: the interpreter takes no scalar in a store's mask
        row1 = row1 + tl.zeros_like(lanes).to(tl.int64)
        tl.store(dst + (row1 - 1) * ROW + lanes, v, mask=lm & (row1 > 0))


@triton.jit
def _copy_scales_deep_ep(dst, flat, first, sv, ROW, R: tl.constexpr, K: tl.constexpr,
                         KP: tl.constexpr, UE8M0: tl.constexpr):
    """A row's scales ``sv`` into DeepEP's storage ``dst`` (``_scales_to_column``) at flat row
    ``flat[k]`` for every entry k in ``first``, the flat rows picked as ``_copy_rows`` picks
    them."""
    ks = tl.arange(0, KP)
    for k in tl.static_range(K):
        row1 = tl.sum(tl.where((ks == k) & first, flat + 1, 0), axis=0)
        _scales_to_column(dst, row1, sv, R, ROW.SCALES, ROW.SCALES_P2, UE8M0)


@triton.jit
def _expand_ll(x, out, reg, seq, tag, timeout_us, err, w_off, SIZES, REGIONS, ROW,
               COUNT_CHUNK: tl.constexpr, FP8: tl.constexpr, CARRY: tl.constexpr,
               POLL: tl.constexpr, PROFILE: tl.constexpr, OWN_ROWS_FROM_X: tl.constexpr, stats,
               STATS: tl.constexpr, deep, DEEP_EP: tl.constexpr):
    """The receive: what the flag dispatch's expand does, each word waited for where it is
    read: the sources' token counts (and call tags), then per owned pair its metadata, the
    earlier sources' counts of its experts, its row (and FP8 scales, carried weights, copied to
    byte ``w_off``); the row slot is armed again with ROW_SENTINEL once copied. Sources in turn
    from this rank on: its own pairs first, whose rows are local while the peers' still cross.
    PROFILE: stamp 3 when this rank's own pairs are expanded, stamp 4 when the last row of a
    later source arrived (tools/ep_timeline.py). OWN_ROWS_FROM_X: this rank's own rows are
    read from ``x`` (the send skipped them: ``_push_rows`` SKIP_OWN), exact and without a wait
    or a re-arm.
    STATS: every wait timed per source (``_take_ll_timed``; the token counts one source at a
    time) and the block's totals added to ``stats`` at the end. DEEP_EP: DeepEP's layouts too,
    into ``deep`` (a ``DeepOut``) and the scales into ``out.recv_scales`` in DeepEP's storage
    (deep_ep_layout.py). Returns whether a wait of the block failed."""
    b = tl.program_id(0)
    MAX_TOKENS: tl.constexpr = SIZES.MAX_TOKENS     # a source's receive slots
    K: tl.constexpr = SIZES.K
    KP: tl.constexpr = SIZES.KP
    L: tl.constexpr = SIZES.L
    W: tl.constexpr = SIZES.W
    WP: tl.constexpr = SIZES.WP
    NB: tl.constexpr = SIZES.NB
    MAX_TOPK: tl.constexpr = SIZES.MAX_TOPK
    SCALES: tl.constexpr = ROW.SCALES
    SCALES_P2: tl.constexpr = ROW.SCALES_P2
    WORDS: tl.constexpr = ROW.WORDS
    WORDS_P2: tl.constexpr = ROW.WORDS_P2
    epoch = (seq + 1).to(tl.int32)
    limit = limit_ticks(timeout_us, POLL)
    failed = tl.zeros([], tl.int32)
    cntp = _at(reg.tab, reg.rank, reg.set_off + REGIONS.COUNTS, tl.int64)
    ntp = _at(reg.tab, reg.rank, reg.set_off + REGIONS.NTOK, tl.int64)
    metap = _at(reg.tab, reg.rank, reg.set_off + REGIONS.META, tl.int64)
    xp = _at(reg.tab, reg.rank, reg.set_off + REGIONS.ROWS, tl.int32)
    scp = _at(reg.tab, reg.rank, reg.set_off + REGIONS.SCALES, tl.int32)
    wll = _at(reg.tab, reg.rank, reg.set_off + REGIONS.WEIGHTS_LL, tl.int64)
    wout = _at(reg.tab, reg.rank, w_off, tl.float32)
    rx = out.recv_x.to(tl.pointer_type(tl.int32))
    rs = out.recv_scales.to(tl.pointer_type(tl.int32))
    ws = tl.arange(0, WORDS_P2)
    wm = ws < WORDS
    ns = tl.arange(0, SCALES_P2)
    nsm = ns < SCALES
    ps = tl.arange(0, WP)
    acc = tl.zeros([WP], tl.int64)              # STATS: ns waited per source, this block
    if STATS:       # one source at a time, so that each one's wait is its own
        nw = tl.zeros([WP], tl.int64)
        for q in tl.static_range(W):
            nq, failed, acc = _take_ll_timed(ntp + ps, ps == q, ps.to(tl.int64), epoch, failed,
                                             limit, err, POLL, 1, acc, q, WP, STATS)
            nw = tl.where(ps == q, nq, nw)
    else:
        nw, failed = _take_ll(ntp + ps, ps < W, ps.to(tl.int64), epoch, failed, limit, err,
                              POLL, 1)
    nts = tl.where(ps < W, (nw & NTOK_MASK).to(tl.int32), 0)
    # a source whose tag differs runs another kind of call (use_fp8, round_scale, carried
    # weights, top-k): a mismatch, as the flag dispatch reports it
    other = (ps < W) & (((nw & LL_LOW) >> NTOK_BITS) != (tag & NTOK_TAG_MASK))
    if failed == 0:
        if tl.max(other.to(tl.int32), axis=0) > 0:
            report_error(err, STATUS_MISMATCH, OP_DISPATCH, PHASE_DATA,
                         tl.reduce(tl.where(other, tl.full([WP], 1, tl.int64) << ps, 0), 0,
                                   _bit_or))
            failed = 1
    if b == NB - 1:     # the last block: at small token counts it owns no pair
        for l0 in range(0, L, COUNT_CHUNK):
            ls = l0 + tl.arange(0, COUNT_CHUNK)
            lm = ls < L
            tot = tl.zeros([COUNT_CHUNK], tl.int32)
            for s in range(W):
                c, failed, acc = _take_ll_timed(cntp + s * L + ls, lm,
                                                tl.full([COUNT_CHUNK], s, tl.int64), epoch, failed,
                                                limit, err, POLL, 1, acc, s, WP, STATS)
                if DEEP_EP:
                    _layout_entry(deep.layout, ls, lm, s, tot, c.to(tl.int32), W)
                tot += c.to(tl.int32)
            tl.store(out.recv_count + ls, tot, mask=lm)
            if DEEP_EP:
                _deep_ep_totals(deep.layout, deep.stats, ls, lm, tot, failed, W, WP)
        tl.store(out.ntok + ps, nts, mask=ps < W)
    ks = tl.arange(0, KP)
    kmask = ks < K
    earlier = ks[None, :] < ks[:, None]         # [k, i]: entry i comes before entry k
    for i in range(W):
        s = (reg.rank + i) % W
        n_s = tl.sum(tl.where(ps == s, nts, 0), axis=0)
        for t in range(_first_token(b, s, NB, W), n_s, NB):
            slot = s * MAX_TOKENS + t
            srcs = tl.full([KP], s, tl.int64)
            mw, failed, acc = _take_ll_timed(metap + slot * MAX_TOPK + ks, kmask, srcs, epoch,
                                             failed, limit, err, POLL, 1, acc, s, WP, STATS)
            m = tl.where(kmask & (failed == 0), mw.to(tl.int32), -1)
            valid = m >= 0
            first = _first_entries(m, valid, earlier)
            le = tl.maximum(m, 0) >> META_SHIFT
            row = m & META_MASK
            for s2 in range(s):
                c, failed, acc = _take_ll_timed(cntp + s2 * L + le, valid,
                                                tl.full([KP], s2, tl.int64), epoch, failed,
                                                limit, err, POLL, 1, acc, s2, WP, STATS)
                row += c.to(tl.int32)
            if failed == 0:
                flat = le * (W * MAX_TOKENS) + row
                tl.store(out.row_of + slot * K + ks, tl.where(valid, flat, -1), mask=kmask)
                tl.store(out.src_info + flat, tl.full([KP], 0, tl.int32) + slot, mask=first)
                if DEEP_EP:     # DeepEP's src_info: the source token alone
                    tl.store(deep.src + flat, tl.full([KP], 0, tl.int32) + t, mask=first)
                own_x = (s == reg.rank) & (OWN_ROWS_FROM_X == 1)
                if tl.max(valid.to(tl.int32), axis=0) > 0:      # the row was sent here
                    if own_x:
                        v = tl.load(x.to(tl.pointer_type(tl.int32)) + t * WORDS + ws, mask=wm)
                    else:
                        v, failed, acc = _take_ll_timed(xp + slot * WORDS + ws, wm,
                                                        tl.full([WORDS_P2], s, tl.int64), epoch,
                                                        failed, limit, err, POLL, 0, acc, s, WP,
                                                        STATS)
                    if FP8:
                        sv, failed, acc = _take_ll_timed(scp + slot * SCALES + ns, nsm,
                                                         tl.full([SCALES_P2], s, tl.int64), epoch,
                                                         failed, limit, err, POLL, 0, acc, s,
                                                         WP, STATS)
                    if CARRY:
                        wv, failed, acc = _take_ll_timed(wll + slot * MAX_TOPK + ks, kmask, srcs,
                                                         epoch, failed, limit, err, POLL, 1, acc,
                                                         s, WP, STATS)
                    if i > 0:
                        _stamp(err, 4, PROFILE, 0, NB)      # a later source's row arrived
                    if failed == 0:
                        _copy_rows(rx, flat, first, v, WORDS, ws, wm, K, KP)
                        if own_x == 0:
                            tl.store(xp + slot * WORDS + ws,
                                     tl.full([WORDS_P2], ROW_SENTINEL, tl.int32),
                                     mask=wm)   # armed again
                        if FP8:
                            if DEEP_EP:
                                _copy_scales_deep_ep(rs, flat, first, sv, ROW, W * MAX_TOKENS,
                                                     K, KP, DEEP_EP == UE8M0_LAYOUT)
                            else:
                                _copy_rows(rs, flat, first, sv, SCALES, ns, nsm, K, KP)
                            tl.store(scp + slot * SCALES + ns,
                                     tl.full([SCALES_P2], ROW_SENTINEL, tl.int32), mask=nsm)
                        if CARRY:
                            tl.store(wout + slot * MAX_TOPK + ks,
                                     wv.to(tl.int32).to(tl.float32, bitcast=True), mask=kmask)
        if i == 0:
            _stamp(err, 3, PROFILE, 0, NB)      # this rank's own pairs expanded
            _stamp(err, 4, PROFILE, 0, NB)
    if STATS:
        _add_stats_by_rank(stats, acc, WP, W)
    return failed


@triton.jit(do_not_specialize=EP_RANK_VARYING, repr=symbol("dispatch_ll"))
def ll_dispatch_kernel(
        # runtime arguments: dispatch_common.DISPATCH_ARGS says what each one is
        x, topk, n_tok, recv_x, recv_scales, row_of, src_info, recv_count, ntok_out, tab, ctrl,
        err, rank, tag, timeout_us, wts, w_off, stats, deep_src, deep_layout, deep_stats,
        SIZES: tl.constexpr,            # common.Sizes
        REGIONS: tl.constexpr,          # dispatch_common.DispatchRegions
        TILING: tl.constexpr,           # dispatch_common.Tiling
        ROW: tl.constexpr,              # dispatch_common.RowFormat (WORDS: for this FP8 mode)
        FP8: tl.constexpr,              # 0: buffer dtype; 1: e4m3 + scales; 2: pow2 scales
        STAGES: tl.constexpr,           # STAGE_SEND | STAGE_RECV (STAGE_WAIT: poll; no signal)
        PROFILE: tl.constexpr = 0,      # 1: stage stamps into err (ERR_PROF; _stamp)
        CARRY: tl.constexpr = 0,        # 1: the top-k weights travel too (kernels/__init__.py)
        STATS: tl.constexpr = 0,        # 1: wait statistics into stats (_expand_ll)
        DEEP_EP: tl.constexpr = 0,      # DeepEP's layouts too (deep_ep_layout.py)
        IN_FLIGHT: tl.constexpr = 1,    # 2: send and receive counters apart (common._seq_at)
        PDL: tl.constexpr = 0):  # launched with PDL (runtime/kernels/sync.after_previous_kernel)
    after_previous_kernel(PDL)
    # this rank's own rows are expanded from x, not sent to its own receive slots (at 128
    # tokens 15.7 -> 14.3 us: bench/results/ab/2026-11-30-ep-own-rows-from-x/): not FP8 rows,
    # whose bytes are the quantiser's, and only when one launch sends and receives (a hook's
    # caller may reuse x)
    SEND_AND_RECV: tl.constexpr = STAGE_SEND | STAGE_RECV
    OWN_ROWS_FROM_X: tl.constexpr = ((SEND_AND_RECV & STAGES) == SEND_AND_RECV) & (FP8 == 0)
    NB: tl.constexpr = SIZES.NB
    b = tl.program_id(0)
    _stamp(err, 0, PROFILE, 0, NB)
    timeout_us, broken = wait_bound(timeout_us, err)    # short once this rank has failed
    seq, recv_ctr = _seq_at(ctrl, b, STAGE_SEND & STAGES, NB, IN_FLIGHT)
    set_off = (seq % REGIONS.SETS) * REGIONS.SET_BYTES
    ehi = (seq + 1) << LL_HI                        # this call's epoch bits
    reg = Region(tab, rank, set_off)
    if STAGE_SEND & STAGES:
        if CARRY:       # the weights' own LL words, in this call's set
            _push_weights(wts, n_tok, reg, SIZES, REGIONS.WEIGHTS_LL, ehi, LL=1)
        # metadata and counts first, then the rows (bench/results/ab/2026-11-30-ep-ll-dispatch/)
        _send_routing(topk, n_tok, err, reg, ehi, tag, SIZES, REGIONS, TILING, STAMP=1,
                      PROFILE=PROFILE, LL=1)
        _push_rows(x, topk, n_tok, reg, SIZES, REGIONS, ROW, TILING.TOKENS_PER_BLOCK, FP8,
                   OWN_ROWS_FROM_X)
        _stamp(err, 2, PROFILE, 0, NB)  # rows, counts and metadata pushed
    if STAGE_RECV & STAGES:     # polls only with STAGE_WAIT (the interpreter tests read once)
        out = Out(recv_x, recv_scales, row_of, src_info, recv_count, ntok_out)
        failed = _expand_ll(x, out, reg, seq, tag, timeout_us, err, w_off, SIZES, REGIONS, ROW,
                            TILING.COUNT_CHUNK, FP8=FP8, CARRY=CARRY,
                            POLL=(STAGE_WAIT & STAGES) != 0, PROFILE=PROFILE,
                            OWN_ROWS_FROM_X=OWN_ROWS_FROM_X, stats=stats, STATS=STATS,
                            deep=DeepOut(deep_src, deep_layout, deep_stats), DEEP_EP=DEEP_EP)
        if broken | (failed != 0):
            # DeepEP's UE8M0 scales: one int32 word per four groups
            _poison_received(out, SIZES, ROW.SCALES // 4 if DEEP_EP == UE8M0_LAYOUT else
                             ROW.SCALES, FP8)
            if DEEP_EP:     # and layout_range says so, as recv_count does
                _poison_layout(deep_layout, SIZES, TILING.COUNT_CHUNK)
        tl.store(recv_ctr, seq + 1)
    _seq_sent(ctrl, b, seq, STAGE_SEND & STAGES, IN_FLIGHT)
    _stamp(err, PROF_LAST, PROFILE, 0, NB)

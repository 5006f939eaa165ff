"""The flag dispatch: rows, counts and metadata pushed, one flag per (block, source) released
after them, one wait for every flag, then the expand. Runs for buffers above
``peer.LL_MAX_TOKENS`` tokens and for buffers with rank masks.

One launch of NB blocks; block b:

1. send (``STAGE_SEND``): counts and metadata (``dispatch_common``), and one row push of each of
   its tokens per destination *rank* that holds one of its experts, into slot ``(src, t)``
   (FP8: quantised here, once: ``fp8._quantize_row``).
2. signal (``STAGE_SIGNAL``): ``flag[dispatch][b][src]`` on every rank, after a barrier, release.
3. wait (``STAGE_WAIT``): for every (block, source) flag of this rank, then one acquire pass.
4. expand (``STAGE_RECV``): the pairs ``(s, t)`` it owns (``common._first_token``), each row
   copied from its receive slot into ``recv_x`` at the row its metadata and the earlier
   sources' counts give.

Timeline of one dispatch between ranks A and B (block b of each)::

    A: push rows/meta/counts -> B ... bar.sync; atom.release.sys B.flag[D][b][A] = word
    B: poll all B.flag[D][*][*] == word (volatile), one acquire pass ... bar.sync; expand

Rank masks (``MASKS`` = 1): the blocks agree on one mask per call (``common._agree_mask``: rows
depend on every earlier source's counts); masked sources count as having sent nothing.
"""
import triton
import triton.language as tl

from ...runtime.kernels.sync import EPOCH_SHIFT, after_previous_kernel, poll_read, wait_bound
from .common import (EP_RANK_VARYING, ERR_MASK, ERR_VERDICT, META_MASK, META_SHIFT, OP_DISPATCH,
                     PHASE_ENTRY, PROF_LAST, SIG_DISPATCH, STAGE_RECV, STAGE_SEND, STAGE_SIGNAL,
                     STAGE_WAIT, Region, _agree_mask, _at, _first_entries, _first_token, _masked,
                     _poison_received, _push_weights, _rank_bits, _seq_at, _seq_sent, _signal,
                     _stamp, _wait_flags, symbol)
from .deep_ep_layout import (UE8M0_LAYOUT, DeepOut, _deep_ep_totals, _layout_entry,
                             _poison_layout, _scales_to_column)
from .dispatch_common import Out, _send_routing
from .fp8_rows import FP8_BLOCK, _quantize_row


@triton.jit
def _push_rows(x, topk, n_tok, reg, SIZES, REGIONS, ROW, TOKENS_PER_BLOCK: tl.constexpr,
               FP8: tl.constexpr):
    """Each of this block's token rows once per destination rank (which ranks: a bit mask from
    scalar loads), into the source's slot ``rank * MAX_TOKENS + t`` there; FP8 quantises here,
    once."""
    b = tl.program_id(0)
    DT = x.dtype.element_ty
    hs = tl.arange(0, SIZES.HP)
    hm = hs < SIZES.H
    for j in range(0, TOKENS_PER_BLOCK):
        t = b + SIZES.NB * j
        if t < n_tok:
            bits = _rank_bits(topk + t * SIZES.K, SIZES.K, SIZES.E, SIZES.L)
            slot = reg.rank * SIZES.MAX_TOKENS + t
            if FP8:
                # e4m3 bytes and scales cross NVLink
                v = tl.load(x + t * SIZES.H + hs, mask=hm, other=0.0).to(tl.float32)
                qb, sc = _quantize_row(v, SIZES.HP, FP8 == 2)
                ns = tl.arange(0, SIZES.HP // FP8_BLOCK)
                for d in tl.static_range(SIZES.W):
                    if (bits >> d) & 1:
                        qp = _at(reg.tab, d, reg.set_off + REGIONS.ROWS, tl.uint8) + slot * SIZES.H
                        tl.store(qp + hs, qb, mask=hm)
                        sp = (_at(reg.tab, d, reg.set_off + REGIONS.SCALES, tl.float32)
                              + slot * ROW.SCALES)
                        tl.store(sp + ns, sc, mask=ns < ROW.SCALES)
            else:
                v = tl.load(x + t * SIZES.H + hs, mask=hm)
                for d in tl.static_range(SIZES.W):
                    if (bits >> d) & 1:
                        xp = _at(reg.tab, d, reg.set_off + REGIONS.ROWS, DT) + slot * SIZES.H
                        tl.store(xp + hs, v, mask=hm)


@triton.jit
def _expand(out, reg, msk, SIZES, REGIONS, ROW, COUNT_CHUNK: tl.constexpr, FP8: tl.constexpr,
            deep, DEEP_EP: tl.constexpr):
    """Stage 4: this rank's receive slots into the per-expert layout ``out`` (FP8: recv_x is
    the uint8 view of the e4m3 output, and the scales are copied alongside). Sources in the bit
    mask ``msk`` (masked ranks) count as having sent nothing: no rows, no counts. DEEP_EP: DeepEP's
    layouts too, into ``deep`` (a ``DeepOut``) and the scales into ``out.recv_scales`` in
    DeepEP's storage (deep_ep_layout.py)."""
    b = tl.program_id(0)
    MAX_TOKENS: tl.constexpr = SIZES.MAX_TOKENS     # a source's receive slots
    H: tl.constexpr = SIZES.H
    K: tl.constexpr = SIZES.K
    L: tl.constexpr = SIZES.L
    W: tl.constexpr = SIZES.W
    NB: tl.constexpr = SIZES.NB
    SCALES: tl.constexpr = ROW.SCALES
    DT = out.recv_x.dtype.element_ty
    hs = tl.arange(0, SIZES.HP)
    hm = hs < H
    cntp = _at(reg.tab, reg.rank, reg.set_off + REGIONS.COUNTS, tl.int32)
    ntp = _at(reg.tab, reg.rank, reg.set_off + REGIONS.NTOK, tl.int32)
    metap = _at(reg.tab, reg.rank, reg.set_off + REGIONS.META, tl.int32)
    xp = _at(reg.tab, reg.rank, reg.set_off + REGIONS.ROWS, DT)
    scp = _at(reg.tab, reg.rank, reg.set_off + REGIONS.SCALES, tl.float32)
    ns = tl.arange(0, ROW.SCALES_P2)
    nsm = ns < SCALES
    ps = tl.arange(0, SIZES.WP)
    # tokens each source sent, loaded once (masked sources: none)
    nts = tl.where(_masked(msk, ps), 0, tl.load(ntp + ps, mask=ps < W, other=0))
    if b == NB - 1:     # the last block: at small token counts it owns no pair
        for l0 in range(0, L, COUNT_CHUNK):
            ls = l0 + tl.arange(0, COUNT_CHUNK)
            lm = ls < L
            tot = tl.zeros([COUNT_CHUNK], tl.int32)
            for s in range(W):
                c = tl.where(_masked(msk, s), 0, tl.load(cntp + s * L + ls, mask=lm, other=0))
                if DEEP_EP:
                    _layout_entry(deep.layout, ls, lm, s, tot, c, W)
                tot += c
            tl.store(out.recv_count + ls, tot, mask=lm)
            if DEEP_EP:
                _deep_ep_totals(deep.layout, deep.stats, ls, lm, tot, 0, W, SIZES.WP)
        tl.store(out.ntok + ps, nts, mask=ps < W)
    ks = tl.arange(0, SIZES.KP)
    kmask = ks < K
    earlier = ks[None, :] < ks[:, None]         # [k, i]: entry i comes before entry k
    for s in range(W):
        n_s = tl.sum(tl.where(ps == s, nts, 0), axis=0)
        for t in range(_first_token(b, s, NB, W), n_s, NB):
            slot = s * MAX_TOKENS + t
            # the row first: its address needs no metadata, so its load overlaps the metadata's
            # (a token reaches a rank only when one of its experts is there: the row is used)
            v = tl.load(xp + slot * H + hs, mask=hm)
            if FP8:
                sv = tl.load(scp + slot * SCALES + ns, mask=nsm)
            # the pair's top-k entries as one vector: every load of a pair is issued at once
            # (a chain of scalar loads per entry costs about 0.3 us each)
            m = tl.load(metap + slot * SIZES.MAX_TOPK + ks, mask=kmask, other=-1)
            valid = m >= 0
            first = _first_entries(m, valid, earlier)
            le = tl.maximum(m, 0) >> META_SHIFT
            row = m & META_MASK
            for s2 in range(s):
                if not _masked(msk, s2):
                    row += tl.load(cntp + s2 * L + le, mask=valid, other=0)
            flat = le * (W * MAX_TOKENS) + row
            tl.store(out.row_of + slot * K + ks, tl.where(valid, flat, -1), mask=kmask)
            tl.store(out.src_info + flat, tl.full([SIZES.KP], 0, tl.int32) + slot, mask=first)
            if DEEP_EP:     # DeepEP's src_info: the source token alone
                tl.store(deep.src + flat, tl.full([SIZES.KP], 0, tl.int32) + t, mask=first)
            for k in tl.static_range(K):
                pick = ks == k
                if tl.sum((pick & first).to(tl.int32), axis=0) > 0:
                    flat_k = tl.sum(tl.where(pick, flat, 0), axis=0).to(tl.int64)
                    tl.store(out.recv_x + flat_k * H + hs, v, mask=hm)
                    if FP8:
                        if DEEP_EP:
                            _scales_to_column(out.recv_scales, flat_k + 1,
                                              sv.to(tl.int32, bitcast=True), W * MAX_TOKENS,
                                              SCALES, ROW.SCALES_P2,
                                              DEEP_EP == UE8M0_LAYOUT)
                        else:
                            tl.store(out.recv_scales + flat_k * SCALES + ns, sv, mask=nsm)


@triton.jit(do_not_specialize=EP_RANK_VARYING, repr=symbol("dispatch_flag"))
def flag_dispatch_kernel(
        # runtime arguments: dispatch_common.DISPATCH_ARGS says what each one is
        x, topk, n_tok, recv_x, recv_scales, row_of, src_info, recv_count, ntok_out, tab, ctrl,
        err, rank, tag, timeout_us, wts, w_off, stats, deep_src, deep_layout, deep_stats,
        SIZES: tl.constexpr,            # common.Sizes
        REGIONS: tl.constexpr,          # dispatch_common.DispatchRegions
        TILING: tl.constexpr,           # dispatch_common.Tiling
        ROW: tl.constexpr,              # dispatch_common.RowFormat
        FP8: tl.constexpr,              # 0: buffer dtype; 1: e4m3 + scales; 2: pow2 scales
        STAGES: tl.constexpr,           # STAGE_SEND | STAGE_SIGNAL | STAGE_WAIT | STAGE_RECV
        MASKS: tl.constexpr,            # 1: rank masks (err[ERR_MASK])
        PROFILE: tl.constexpr = 0,      # 1: stage stamps into err (ERR_PROF; _stamp)
        CARRY: tl.constexpr = 0,        # 1: the top-k weights travel too (kernels/__init__.py)
        STATS: tl.constexpr = 0,        # 1: wait statistics into stats (_wait_flags)
        DEEP_EP: tl.constexpr = 0,      # DeepEP's layouts too (deep_ep_layout.py)
        IN_FLIGHT: tl.constexpr = 1,    # 2: send and receive counters apart (common._seq_at)
        PDL: tl.constexpr = 0):  # launched with PDL (runtime/kernels/sync.after_previous_kernel)
    after_previous_kernel(PDL)
    NB: tl.constexpr = SIZES.NB
    W: tl.constexpr = SIZES.W
    b = tl.program_id(0)
    _stamp(err, 0, PROFILE, 0, NB)
    timeout_us, broken = wait_bound(timeout_us, err)    # short once this rank has failed
    seq, recv_ctr = _seq_at(ctrl, b, STAGE_SEND & STAGES, NB, IN_FLIGHT)
    set_off = (seq % REGIONS.SETS) * REGIONS.SET_BYTES
    word = ((seq + 1) << EPOCH_SHIFT) | tag
    reg = Region(tab, rank, set_off)
    if STAGE_SEND & STAGES:
        if CARRY:       # into the handle slot's region, released with the rows by the signal
            _push_weights(wts, n_tok, Region(tab, rank, w_off), SIZES, 0)
        # rows first: they cross NVLink while the block scans (their destinations need only
        # the token's own top-k), so the release before the signal waits for less
        # (bench/results/ab/2026-11-30-ep-block-shape/)
        _push_rows(x, topk, n_tok, reg, SIZES, REGIONS, ROW, TILING.TOKENS_PER_BLOCK, FP8)
        _stamp(err, 1, PROFILE, 0, NB)  # rows pushed (issued; they land during the scan)
        _send_routing(topk, n_tok, err, reg, 0, tag, SIZES, REGIONS, TILING, STAMP=0,
                      PROFILE=PROFILE, LL=0)
        _stamp(err, 2, PROFILE, 0, NB)  # rows, counts and metadata pushed
    if STAGE_SIGNAL & STAGES:
        tl.debug_barrier()
        _signal(tab, (set_off + REGIONS.SIGNAL) // 8 + (SIG_DISPATCH * NB + b) * W + rank, word,
                W, SIZES.WP)
        _stamp(err, 3, PROFILE, 0, NB)
    msk = tl.full([], 0, tl.int64)     # ranks treated as absent (masks only)
    if MASKS:
        msk = poll_read(err + ERR_MASK)
    ok = 1
    if STAGE_WAIT & STAGES:
        flags = _at(tab, rank, set_off + REGIONS.SIGNAL, tl.int64) + SIG_DISPATCH * NB * W
        ok, late = _wait_flags(flags, word, timeout_us, err, OP_DISPATCH, PHASE_ENTRY, 1, NB * W,
                               TILING.FLAGS_P2, W, msk, MASKS, stats, STATS)
        if MASKS:
            agreed = _agree_mask(err, seq + 1, msk | late, ERR_VERDICT)
            # a rank late here but seen by the deciding block has arrived: wait for it again
            # (uniform condition; an error if it does not come)
            need = (late & ~agreed) != 0
            ok2, _ = _wait_flags(flags, word, timeout_us, err, OP_DISPATCH, PHASE_ENTRY, need,
                                 NB * W, TILING.FLAGS_P2, W, agreed, 0, stats, STATS)
            ok = ok & (ok2 | (need == 0))
            if agreed != msk:
                tl.atomic_or(err + ERR_MASK, agreed, sem="relaxed", scope="gpu")
            msk = agreed
        _stamp(err, 4, PROFILE, 0, NB)
    if STAGE_RECV & STAGES:
        deep = DeepOut(deep_src, deep_layout, deep_stats)
        out = Out(recv_x, recv_scales, row_of, src_info, recv_count, ntok_out)
        if ok:
            _expand(out, reg, msk, SIZES, REGIONS, ROW, TILING.COUNT_CHUNK, FP8, deep, DEEP_EP)
        if broken | (ok == 0):
            # DeepEP's UE8M0 scales: one int32 word per four groups
            _poison_received(out, SIZES, ROW.SCALES // 4 if DEEP_EP == UE8M0_LAYOUT else
                             ROW.SCALES, FP8)
            if DEEP_EP:     # and layout_range says so, as recv_count does
                _poison_layout(deep_layout, SIZES, TILING.COUNT_CHUNK)
        tl.store(recv_ctr, seq + 1)
    _seq_sent(ctrl, b, seq, STAGE_SEND & STAGES, IN_FLIGHT)
    _stamp(err, PROF_LAST, PROFILE, 0, NB)

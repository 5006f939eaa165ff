"""The flag dispatch: rows, counts and metadata pushed, one flag per (block, source) released
after them, one wait for every flag, then the expand. Runs for buffers above
``peer.LL_MAX_TOKENS`` tokens and for buffers with rank masks.

One launch of NB blocks; block b:

1. send (``D_SEND``): counts and metadata (``dispatch_common``), and one row push of each of
   its tokens per destination *rank* that holds one of its experts, into slot ``(src, t)``
   (FP8: quantised here, once: ``fp8._quantize_row``).
2. signal (``D_SIGNAL``): ``flag[dispatch][b][src]`` on every rank, after a barrier, release.
3. wait (``D_WAIT``): for every (block, source) flag of this rank, then one acquire pass.
4. expand (``D_RECV``): the pairs ``(s, t)`` it owns (``common._first_token``), each row
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

from ...runtime.kernels.sync import EPOCH_SHIFT, after_previous_kernel, wait_bound
from .common import (EP_RANK_VARYING, ERR_MASK, META_MASK, META_SHIFT, OP_DISPATCH, PHASE_ENTRY,
                     PROF_LAST, SIG_DISPATCH, Region, Sizes, _agree_mask, _at, _first_entries,
                     _first_token, _masked, _poison_received, _push_weights, _rank_bits, _signal,
                     _stamp, _wait_flags, symbol)
from .deep_ep_layout import (UE8M0_LAYOUT, DeepOut, _deep_ep_totals, _layout_entry,
                             _poison_layout, _scales_to_column)
from .dispatch_common import Out, Recv, Tiles, _send_routing
from .fp8_rows import FP8_BLOCK, _quantize_row


@triton.jit
def _push_rows(x, topk, n_tok, reg, S, RV, JP: tl.constexpr, FP8: tl.constexpr):
    """Each of this block's token rows once per destination rank (which ranks: a bit mask from
    scalar loads), into the source's slot ``rank * T + t`` there; FP8 quantises here, once."""
    b = tl.program_id(0)
    DT = x.dtype.element_ty
    hs = tl.arange(0, S.HP)
    hm = hs < S.H
    for j in range(0, JP):
        t = b + S.NB * j
        if t < n_tok:
            bits = _rank_bits(topk + t * S.K, S.K, S.E, S.L)
            slot = reg.rank * S.T + t
            if FP8:
                # e4m3 bytes and scales cross NVLink
                v = tl.load(x + t * S.H + hs, mask=hm, other=0.0).to(tl.float32)
                qb, sc = _quantize_row(v, S.HP, FP8 == 2)
                ns = tl.arange(0, S.HP // FP8_BLOCK)
                for d in tl.static_range(S.W):
                    if (bits >> d) & 1:
                        qp = _at(reg.tab, d, reg.set_off + RV.X, tl.uint8) + slot * S.H
                        tl.store(qp + hs, qb, mask=hm)
                        sp = _at(reg.tab, d, reg.set_off + RV.SC, tl.float32) + slot * RV.NS
                        tl.store(sp + ns, sc, mask=ns < RV.NS)
            else:
                v = tl.load(x + t * S.H + hs, mask=hm)
                for d in tl.static_range(S.W):
                    if (bits >> d) & 1:
                        xp = _at(reg.tab, d, reg.set_off + RV.X, DT) + slot * S.H
                        tl.store(xp + hs, v, mask=hm)


@triton.jit
def _expand(out, reg, msk, S, RV, LB: tl.constexpr, FP8: tl.constexpr, deep,
            DEEP_EP: tl.constexpr):
    """Stage 4: this rank's receive slots into the per-expert layout ``out`` (FP8: recv_x is
    the uint8 view of the e4m3 output, and the scales are copied alongside). Sources in the bit
    mask ``msk`` (masked ranks) count as having sent nothing: no rows, no counts. DEEP_EP: DeepEP's
    layouts too, into ``deep`` (a ``DeepOut``) and the scales into ``out.recv_scales`` in
    DeepEP's storage (deep_ep_layout.py)."""
    b = tl.program_id(0)
    T: tl.constexpr = S.T
    H: tl.constexpr = S.H
    K: tl.constexpr = S.K
    L: tl.constexpr = S.L
    W: tl.constexpr = S.W
    NB: tl.constexpr = S.NB
    NS: tl.constexpr = RV.NS
    DT = out.recv_x.dtype.element_ty
    hs = tl.arange(0, S.HP)
    hm = hs < H
    cntp = _at(reg.tab, reg.rank, reg.set_off + RV.CNT, tl.int32)
    ntp = _at(reg.tab, reg.rank, reg.set_off + RV.NTOK, tl.int32)
    metap = _at(reg.tab, reg.rank, reg.set_off + RV.META, tl.int32)
    xp = _at(reg.tab, reg.rank, reg.set_off + RV.X, DT)
    scp = _at(reg.tab, reg.rank, reg.set_off + RV.SC, tl.float32)
    ns = tl.arange(0, RV.NSP)
    nsm = ns < NS
    ps = tl.arange(0, S.WP)
    # tokens each source sent, loaded once (masked sources: none)
    nts = tl.where(_masked(msk, ps), 0, tl.load(ntp + ps, mask=ps < W, other=0))
    if b == NB - 1:     # the last block: at small token counts it owns no pair
        for l0 in range(0, L, LB):
            ls = l0 + tl.arange(0, LB)
            lm = ls < L
            tot = tl.zeros([LB], tl.int32)
            for s in range(W):
                c = tl.where(_masked(msk, s), 0, tl.load(cntp + s * L + ls, mask=lm, other=0))
                if DEEP_EP:
                    _layout_entry(deep.layout, ls, lm, s, tot, c, W)
                tot += c
            tl.store(out.recv_count + ls, tot, mask=lm)
            if DEEP_EP:
                _deep_ep_totals(deep.layout, deep.stats, ls, lm, tot, 0, W, S.WP)
        tl.store(out.ntok + ps, nts, mask=ps < W)
    ks = tl.arange(0, S.KP)
    kmask = ks < K
    earlier = ks[None, :] < ks[:, None]         # [k, i]: entry i comes before entry k
    for s in range(W):
        n_s = tl.sum(tl.where(ps == s, nts, 0), axis=0)
        for t in range(_first_token(b, s, NB, W), n_s, NB):
            slot = s * T + t
            # the row first: its address needs no metadata, so its load overlaps the metadata's
            # (a token reaches a rank only when one of its experts is there: the row is used)
            v = tl.load(xp + slot * H + hs, mask=hm)
            if FP8:
                sv = tl.load(scp + slot * NS + ns, mask=nsm)
            # the pair's top-k entries as one vector: every load of a pair is issued at once
            # (a chain of scalar loads per entry costs about 0.3 us each)
            m = tl.load(metap + slot * S.MAX_TOPK + ks, mask=kmask, other=-1)
            valid = m >= 0
            first = _first_entries(m, valid, earlier)
            le = tl.maximum(m, 0) >> META_SHIFT
            row = m & META_MASK
            for s2 in range(s):
                if not _masked(msk, s2):
                    row += tl.load(cntp + s2 * L + le, mask=valid, other=0)
            flat = le * (W * T) + row
            tl.store(out.row_of + slot * K + ks, tl.where(valid, flat, -1), mask=kmask)
            tl.store(out.src_info + flat, tl.full([S.KP], 0, tl.int32) + slot, mask=first)
            if DEEP_EP:     # DeepEP's src_info: the source token alone
                tl.store(deep.src + flat, tl.full([S.KP], 0, tl.int32) + t, mask=first)
            for k in tl.static_range(K):
                pick = ks == k
                if tl.sum((pick & first).to(tl.int32), axis=0) > 0:
                    flat_k = tl.sum(tl.where(pick, flat, 0), axis=0).to(tl.int64)
                    tl.store(out.recv_x + flat_k * H + hs, v, mask=hm)
                    if FP8:
                        if DEEP_EP:
                            _scales_to_column(out.recv_scales, flat_k + 1,
                                              sv.to(tl.int32, bitcast=True), W * T, NS, RV.NSP,
                                              DEEP_EP == UE8M0_LAYOUT)
                        else:
                            tl.store(out.recv_scales + flat_k * NS + ns, sv, mask=nsm)


@triton.jit(do_not_specialize=EP_RANK_VARYING, repr=symbol("dispatch_flag"))
def flag_dispatch_kernel(
        x,              # [n_tok, H] this rank's tokens (buffer dtype)
        topk,           # [n_tok, K] int64 global expert ids, -1 = none
        n_tok,          # tokens of this rank (<= T)
        recv_x,         # [L, W * T, H] output (FP8: its uint8 view)
        recv_scales,    # [L, W * T, NS] fp32 output (FP8 only; any pointer otherwise); with
        #                 DEEP_EP DeepEP's storage, [L, NS, W * T] fp32 or [L, NS / 4, W * T] int32
        row_of,         # [W, T, K] int32 handle: flat row e * W * T + row of (s, t, k), or -1
        src_info,       # [L, W * T] int32 handle: s * T + t of each row
        recv_count,     # [L] int32 output
        ntok_out,       # [W] int32 handle: tokens each source sent
        tab,            # [W] int64: every rank's EP region base address
        ctrl,           # [NB] int64: dispatch counter of each block
        err,            # int64: device error word, host error address, host input-error address,
        #                 then the mask words and profiling stamps (common.py)
        rank, tag, timeout_us,
        wts,            # [n_tok, K] fp32 top-k weights (CARRY only; any pointer otherwise)
        w_off,          # CARRY: byte offset of the handle slot's weights region, every rank
        stats,          # STATS: [W] int64 wait statistics (ns waited per source; common.py)
        deep_src,       # DEEP_EP: [L, W * T] int32, DeepEP's src_info (None otherwise)
        deep_layout,    # DEEP_EP: [L, W] int64, DeepEP's layout_range (None otherwise)
        deep_stats,     # DEEP_EP: [L] int32 cumulative received rows, or None
        T: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,     # max tokens, hidden, pow2(hidden)
        K: tl.constexpr, KP: tl.constexpr,                      # top-k and pow2(top-k)
        E: tl.constexpr, L: tl.constexpr, LB: tl.constexpr,     # experts, local experts, chunk
        W: tl.constexpr, WP: tl.constexpr, NB: tl.constexpr,    # ranks, pow2(W), grid
        EB: tl.constexpr,               # pow2(ceil(E / NB)): experts counted per block
        TT: tl.constexpr,               # tokens per top-k tile in the count / prefix scan
        TS: tl.constexpr,               # the scan's one tile when n_tok <= TS (small batches)
        JP: tl.constexpr,               # pow2(ceil(T / NB)): tokens per block at most
        FP: tl.constexpr,               # pow2(NB * W): flags polled by the dispatch wait
        MAX_TOPK: tl.constexpr,         # metadata slot stride (layout.MAX_TOPK)
        SET_BYTES: tl.constexpr, OFF_SIG: tl.constexpr, OFF_X: tl.constexpr,   # layout, bytes
        OFF_META: tl.constexpr, OFF_CNT: tl.constexpr, OFF_NTOK: tl.constexpr,
        FP8: tl.constexpr,              # 0: buffer dtype; 1: e4m3 + scales; 2: pow2 scales
        NS: tl.constexpr, NSP: tl.constexpr,    # scales per row (H // 128, or 1), pow2(NS)
        OFF_SC: tl.constexpr,           # layout: FP8 scales, bytes
        STAGES: tl.constexpr,           # D_SEND | D_SIGNAL | D_WAIT | D_RECV bits
        MASKS: tl.constexpr,            # 1: rank masks (err[ERR_MASK])
        LANES: tl.constexpr,            # lanes of each wait's poll (_wait_flags)
        ROWS_FIRST: tl.constexpr,       # 1: rows pushed before the top-k scan
        PROFILE: tl.constexpr = 0,      # 1: stage stamps into err (ERR_PROF; _stamp)
        CARRY: tl.constexpr = 0,        # 1: the top-k weights travel too (kernels/__init__.py)
        STATS: tl.constexpr = 0,        # 1: wait statistics into stats (_wait_flags)
        DEEP_EP: tl.constexpr = 0,      # DeepEP's layouts too (deep_ep_layout.py)
        PDL: tl.constexpr = 0):  # launched with PDL (runtime/kernels/sync.after_previous_kernel)
    after_previous_kernel(PDL)
    S: tl.constexpr = Sizes(T, H, HP, K, KP, E, L, W, WP, NB, MAX_TOPK)
    RV: tl.constexpr = Recv(OFF_X, OFF_META, OFF_CNT, OFF_NTOK, OFF_SC, NS, NSP)
    TI: tl.constexpr = Tiles(EB, TT, TS, JP, LB)
    b = tl.program_id(0)
    _stamp(err, 0, PROFILE, 0, NB)
    timeout_us, broken = wait_bound(timeout_us, err)    # short once this rank has failed
    seq = tl.load(ctrl + b)
    set_off = (seq % 2) * SET_BYTES
    word = ((seq + 1) << EPOCH_SHIFT) | tag
    reg = Region(tab, rank, set_off)
    if STAGES & 1:      # D_SEND
        if CARRY:       # into the handle slot's region, released with the rows by the signal
            _push_weights(wts, n_tok, Region(tab, rank, w_off), S, 0)
        # rows first: they cross NVLink while the block scans (their destinations need only
        # the token's own top-k), so the release before the signal waits for less
        if ROWS_FIRST:
            _push_rows(x, topk, n_tok, reg, S, RV, JP, FP8)
            _stamp(err, 1, PROFILE, 0, NB)  # rows pushed (issued; they land during the scan)
        _send_routing(topk, n_tok, err, reg, 0, tag, S, RV, TI, STAMP=ROWS_FIRST == 0,
                      PROFILE=PROFILE, LL=0)
        if not ROWS_FIRST:
            _push_rows(x, topk, n_tok, reg, S, RV, JP, FP8)
        _stamp(err, 2, PROFILE, 0, NB)  # rows, counts and metadata pushed
    if STAGES & 4:      # D_SIGNAL
        tl.debug_barrier()
        _signal(tab, (set_off + OFF_SIG) // 8 + (SIG_DISPATCH * NB + b) * W + rank, word, W, WP)
        _stamp(err, 3, PROFILE, 0, NB)
    msk = tl.full([], 0, tl.int64)     # ranks treated as absent (masks only)
    if MASKS:
        msk = tl.load(err + ERR_MASK, volatile=True)
    ok = 1
    if STAGES & 8:      # D_WAIT
        flags = _at(tab, rank, set_off + OFF_SIG, tl.int64) + SIG_DISPATCH * NB * W
        ok, late = _wait_flags(flags, word, timeout_us, err, OP_DISPATCH, PHASE_ENTRY, 1, NB * W,
                               FP, W, msk, MASKS, LANES, stats, STATS)
        if MASKS:
            agreed = _agree_mask(err, seq + 1, msk | late)
            # a rank late here but seen by the deciding block has arrived: wait for it again
            # (uniform condition; an error if it does not come)
            need = (late & ~agreed) != 0
            ok2, _ = _wait_flags(flags, word, timeout_us, err, OP_DISPATCH, PHASE_ENTRY, need,
                                 NB * W, FP, W, agreed, 0, LANES, stats, STATS)
            ok = ok & (ok2 | (need == 0))
            if agreed != msk:
                tl.atomic_or(err + ERR_MASK, agreed, sem="relaxed", scope="gpu")
            msk = agreed
        _stamp(err, 4, PROFILE, 0, NB)
    if STAGES & 2:      # D_RECV
        deep = DeepOut(deep_src, deep_layout, deep_stats)
        if ok:
            _expand(Out(recv_x, recv_scales, row_of, src_info, recv_count, ntok_out), reg, msk,
                    S, RV, LB, FP8, deep, DEEP_EP)
        if broken | (ok == 0):
            # DeepEP's UE8M0 scales: one int32 word per four groups
            _poison_received(Out(recv_x, recv_scales, row_of, src_info, recv_count, ntok_out),
                             S, NS // 4 if DEEP_EP == UE8M0_LAYOUT else NS, FP8)
            if DEEP_EP:     # and layout_range says so, as recv_count does
                _poison_layout(deep_layout, S, LB)
        tl.store(ctrl + b, seq + 1)
    _stamp(err, PROF_LAST, PROFILE, 0, NB)

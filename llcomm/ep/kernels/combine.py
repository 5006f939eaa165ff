"""The combine: each expert output back to the token's source rank, weighted and summed in a
fixed order. One launch of NB blocks; block b:

A. weights (``STAGE_WEIGHTS``): pushes ``topk_weights[t]`` of the tokens it owns (the rule
   of ``common._first_token`` with s = this rank) to every rank; signal; wait for block b of
   every rank (``STAGE_SYNC_WEIGHTS``; block b of a receiver only reduces the pairs (s, t)
   that block b of s owns).
B. reduce (``STAGE_REDUCE``): for each pair (s, t) of its tokens with a local expert, the expert
   outputs of the pair's local top-k entries weighted and summed **in k order in fp32**
   (``acc = acc + w_k * y_k``, no FMA contraction), rounded once to the buffer dtype, and
   pushed into slot ``(this rank, t)`` of rank s; signal (``STAGE_SIGNAL_PARTIALS``); wait for
   block b of every rank (``STAGE_WAIT_PARTIALS``).
C. sum (``STAGE_SUM``): for each token t of its own, the partials of the ranks t was routed to,
   summed **in rank order in fp32** from +0.0 and rounded once into ``out[t]``. A block whose
   wait failed, or that started after this rank had failed, fills those rows with NaN
   (``common._poison_sum``) instead.

With the weights carried by the dispatch (``CARRIED``) stage A and its wait are skipped (the
dispatch's wait covered them) and the weights are read at ``w_off``. The combine reads nothing
of the dispatch's regions: what it needs of a dispatch (``row_of``, ``ntok``) is in the handle
slot, local memory. Rank masks: each block uses its own waits' view of the mask; a masked
rank's pairs are not reduced and its partials are left out of the sum.
"""
from collections import namedtuple

import triton
import triton.language as tl

from ...runtime.kernels.sync import EPOCH_SHIFT, after_previous_kernel, poll_read, wait_bound
from .common import (EP_RANK_VARYING, ERR_MASK, OP_COMBINE, PHASE_ENTRY, PHASE_EXIT, PROF_LAST,
                     SIG_PARTIALS, SIG_WEIGHTS, STAGE_REDUCE, STAGE_SIGNAL_PARTIALS, STAGE_SUM,
                     STAGE_SYNC_WEIGHTS, STAGE_WAIT_PARTIALS, STAGE_WEIGHTS, Region, _at,
                     _first_token, _masked, _poison_sum, _push_weights, _rank_bits, _seq_at,
                     _seq_sent, _signal, _stamp, _wait_flags, symbol)

#: Byte offsets in a buffer set (constexpr ``REGIONS`` of the combine): the set's size, the
#: flags, the partials' receive slots and the top-k weights' slots; and the number of sets.
CombineRegions = namedtuple("CombineRegions", ["SET_BYTES", "SIGNAL", "PARTIALS", "WEIGHTS",
                                               "SETS"])


@triton.jit
def _reduce_pair(eo, rows, wp, pp, H: tl.constexpr, HP: tl.constexpr, K: tl.constexpr):
    """One received pair: its local experts' outputs (rows ``rows[k]`` of ``eo``, -1 for none)
    weighted by ``wp[k]`` and summed in k order in fp32, rounded once, stored at ``pp``. The
    rows and weights are 2 K scalar loads with known addresses, issued together: no block-wide
    reduction (a barrier each) to pick entries out of a vector, no load whose address waits for
    another. A pair with no local expert stores nothing."""
    hs = tl.arange(0, HP)
    hm = hs < H
    any_row = tl.full([], -1, tl.int32)
    for k in tl.static_range(K):
        any_row = tl.maximum(any_row, tl.load(rows + k))
    if any_row >= 0:
        acc = tl.zeros([HP], tl.float32)
        for k in tl.static_range(K):
            r_k = tl.load(rows + k)
            w_k = tl.load(wp + k)
            # no branch around the load: every entry's row is requested at once
            y = tl.load(eo + tl.maximum(r_k, 0).to(tl.int64) * H + hs,
                        mask=hm & ((hs * 0 + r_k) >= 0), other=0.0).to(tl.float32)
            acc = tl.where(r_k >= 0, acc + w_k * y, acc)
        tl.store(pp + hs, acc.to(pp.dtype.element_ty), mask=hm)


@triton.jit
def _reduce_partials(eo, row_of, ntok_in, reg, w_at, msk, SIZES, PARTIALS: tl.constexpr):
    """Stage B: per received pair (s, t), its local experts' outputs weighted and summed in k
    order in fp32, rounded once, pushed into slot (rank, t) of rank s. The weights are read
    from this rank's region at byte ``w_at``. Sources in the bit mask ``msk`` (masked ranks)
    are skipped: their weights may not have come."""
    b = tl.program_id(0)
    eo_dt = eo.dtype.element_ty
    wl = _at(reg.tab, reg.rank, w_at, tl.float32)
    ps = tl.arange(0, SIZES.WP)
    nts = tl.where(_masked(msk, ps), 0, tl.load(ntok_in + ps, mask=ps < SIZES.W, other=0))
    MAX_TOKENS: tl.constexpr = SIZES.MAX_TOKENS
    for i in range(SIZES.W):
        # peers first, this rank's own pairs last: their partials cross NVLink while the own
        # pairs are reduced (the release before the signal waits for them to land)
        s = (reg.rank + 1 + i) % SIZES.W
        n_s = tl.sum(tl.where(ps == s, nts, 0), axis=0)
        cx = _at(reg.tab, s, reg.set_off + PARTIALS, eo_dt)
        for t in range(_first_token(b, s, SIZES.NB, SIZES.W), n_s, SIZES.NB):
            _reduce_pair(eo, row_of + (s * MAX_TOKENS + t) * SIZES.K,
                         wl + (s * MAX_TOKENS + t) * SIZES.MAX_TOPK,
                         cx + (reg.rank * MAX_TOKENS + t) * SIZES.H, SIZES.H, SIZES.HP, SIZES.K)


@triton.jit
def _sum_partials(topk, n_tok, out, reg, msk, SIZES, PARTIALS: tl.constexpr):
    """Stage C: each own token's partials, from the ranks it went to, in rank order. Partials
    of ranks in the bit mask ``msk`` (masked ranks) are skipped (count as zero); a token routed
    to masked ranks only gets zeros."""
    b = tl.program_id(0)
    DT = out.dtype.element_ty
    hs = tl.arange(0, SIZES.HP)
    hm = hs < SIZES.H
    cl = _at(reg.tab, reg.rank, reg.set_off + PARTIALS, DT)
    for t in range(_first_token(b, reg.rank, SIZES.NB, SIZES.W), n_tok, SIZES.NB):
        bits = _rank_bits(topk + t * SIZES.K, SIZES.K, SIZES.E, SIZES.L)
        acc = tl.zeros([SIZES.HP], tl.float32)
        for d in tl.static_range(SIZES.W):
            wd = (bits >> d) & 1 & ~(msk >> d)
            went = wd != 0
            p = tl.load(cl + (d * SIZES.MAX_TOKENS + t) * SIZES.H + hs,
                        mask=hm & ((hs * 0 + wd) != 0), other=0.0).to(tl.float32)
            acc = tl.where(went, acc + p, acc)
        tl.store(out + t * SIZES.H + hs, acc.to(DT), mask=hm)


@triton.jit(do_not_specialize=EP_RANK_VARYING, repr=symbol("combine"))
def combine_kernel(
        eo,             # [L, W * T, H] expert outputs (buffer dtype); T: SIZES.MAX_TOKENS
        topk,           # [n_tok, K] int64, as given to the dispatch
        wts,            # [n_tok, K] fp32 top-k weights (not CARRIED; any pointer otherwise)
        n_tok,          # tokens of this rank (the dispatch's)
        out,            # [n_tok, H] output
        row_of,         # [W, T, K] int32 from the dispatch's handle
        ntok_in,        # [W] int32 from the dispatch's handle
        tab,            # [W] int64: every rank's EP region base address
        ctrl,           # [NB] int64: combine counter of each block ([2, NB]: IN_FLIGHT 2)
        err,            # int64: as the dispatch's (common.py)
        rank, tag, timeout_us,
        w_off,          # CARRIED: byte offset of the handle slot's weights region (this rank)
        stats,          # STATS: [W] int64 wait statistics (ns waited per source; common.py)
        SIZES: tl.constexpr,            # common.Sizes
        REGIONS: tl.constexpr,          # CombineRegions
        STAGES: tl.constexpr,           # STAGE_WEIGHTS | STAGE_SYNC_WEIGHTS | ... (common.py)
        MASKS: tl.constexpr,            # 1: rank masks (err[ERR_MASK])
        PROFILE: tl.constexpr = 0,      # 1: stage stamps into err (ERR_PROF; _stamp)
        CARRIED: tl.constexpr = 0,      # 1: the dispatch carried the weights
        STATS: tl.constexpr = 0,        # 1: wait statistics into stats (both waits)
        IN_FLIGHT: tl.constexpr = 1,    # 2: send and receive counters apart (common._seq_at)
        PDL: tl.constexpr = 0):  # launched with PDL (runtime/kernels/sync.after_previous_kernel)
    after_previous_kernel(PDL)
    NB: tl.constexpr = SIZES.NB
    W: tl.constexpr = SIZES.W
    WP: tl.constexpr = SIZES.WP
    b = tl.program_id(0)
    _stamp(err, 0, PROFILE, 1, NB)
    timeout_us, broken = wait_bound(timeout_us, err)    # short once this rank has failed
    seq, recv_ctr = _seq_at(ctrl, b, STAGE_WEIGHTS & STAGES, NB, IN_FLIGHT)
    set_off = (seq % REGIONS.SETS) * REGIONS.SET_BYTES
    word = ((seq + 1) << EPOCH_SHIFT) | tag
    sig0 = (set_off + REGIONS.SIGNAL) // 8
    flags = _at(tab, rank, set_off + REGIONS.SIGNAL, tl.int64)
    reg = Region(tab, rank, set_off)
    if STAGE_WEIGHTS & STAGES:
        if not CARRIED:
            _push_weights(wts, n_tok, reg, SIZES, REGIONS.WEIGHTS)
        _stamp(err, 1, PROFILE, 1, NB)  # weights pushed
    msk = tl.full([], 0, tl.int64)     # ranks treated as absent (masks only)
    if MASKS:
        msk = poll_read(err + ERR_MASK)
    ok = 1
    if (STAGE_SYNC_WEIGHTS & STAGES) and not CARRIED:   # (the dispatch's signal carried them)
        tl.debug_barrier()
        _signal(tab, sig0 + (SIG_WEIGHTS * NB + b) * W + rank, word, W, WP)
        ok, late = _wait_flags(flags + (SIG_WEIGHTS * NB + b) * W, word, timeout_us, err,
                               OP_COMBINE, PHASE_ENTRY, 1, W, WP, W, msk, MASKS, stats, STATS)
        if MASKS:       # per block: block b's tokens depend on block b's wait only
            if late != 0:
                tl.atomic_or(err + ERR_MASK, late, sem="relaxed", scope="gpu")
            msk = msk | late
        _stamp(err, 2, PROFILE, 1, NB)  # weights of every rank arrived
    if STAGE_REDUCE & STAGES:
        if ok:
            w_at = set_off + REGIONS.WEIGHTS
            if CARRIED:
                w_at = w_off
            _reduce_partials(eo, row_of, ntok_in, reg, w_at, msk, SIZES, REGIONS.PARTIALS)
    if STAGE_SIGNAL_PARTIALS & STAGES:
        tl.debug_barrier()              # outside ``if ok``: see _wait_flags
        if ok:
            _signal(tab, sig0 + (SIG_PARTIALS * NB + b) * W + rank, word, W, WP)
        _stamp(err, 3, PROFILE, 1, NB)  # partials reduced, pushed and signalled
    if STAGE_WAIT_PARTIALS & STAGES:    # (in a recv-half launch ok is 1: the send half's
        #                 failure, if any, is already in the error word and this wait then
        #                 times out too)
        ok, late = _wait_flags(flags + (SIG_PARTIALS * NB + b) * W, word, timeout_us, err,
                               OP_COMBINE, PHASE_EXIT, ok, W, WP, W, msk, MASKS, stats, STATS)
        if MASKS:
            if late != 0:
                tl.atomic_or(err + ERR_MASK, late, sem="relaxed", scope="gpu")
            msk = msk | late
        _stamp(err, 4, PROFILE, 1, NB)  # partials of every rank arrived
    if STAGE_SUM & STAGES:
        if ok:
            _sum_partials(topk, n_tok, out, reg, msk, SIZES, REGIONS.PARTIALS)
        if broken | (ok == 0):
            _poison_sum(out, n_tok, rank, SIZES)
        tl.store(recv_ctr, seq + 1)
    _seq_sent(ctrl, b, seq, STAGE_WEIGHTS & STAGES, IN_FLIGHT)
    _stamp(err, PROF_LAST, PROFILE, 1, NB)

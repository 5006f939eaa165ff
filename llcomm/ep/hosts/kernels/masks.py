"""Rank masks in the two-level kernels (``MASKS`` = 1; docs/multihost.md, "Rank masks").

The mask word ``err[ERR_MASK]`` holds global rank bits, as on one host, while each wait of the
two-level kernels polls one level: a *rail* wait one source per host (the rank of this local
index there), a *host* wait one source per local rank of this host. ``masked_wait`` runs such a
wait with the masked sources skipped and adds the ones it gives up on to the mask word.

Detection in one place: a rank that stops is polled by its rail ranks (rail waits) and by the
ranks of its host (host waits), and a wait that gives up on it delays the rank that waited by
one bound, so a later wait of another rank would give up on that live rank too if it had the
same bound. So each call's first wait detects both levels at once: the rail wait, then a wait
for every rank of this host to have *begun* the call (``announce``, ``entry_wait``; one flag
per rank, set at its start), both within one bound of the call's start; the waits after them
allow twice the bound (``later_bound``), the most a live peer can be late by then.

Across hosts a rank relays for its rail, so masking it drops more than its own tokens: a
forwarder skips the tokens of masked sources, and a rank skips every source whose forwarder on
its host is masked (``fed``). A host that stops answering is masked by the rail waits of the
ranks that wait for it, so its tokens are skipped and its experts count as absent.
"""
import triton
import triton.language as tl

from .. import layout as HL
from ...kernels.common import ERR_MASK, PHASE_DATA, PHASE_ENTRY, _agree_mask, _at, _wait_flags

#: A wait's level (``masked_wait``'s LEVEL).
RAIL = tl.constexpr(0)
HOST = tl.constexpr(1)
#: The three dispatch waits' agreements (``_agree_mask``): one word of ``err`` each.
ERR_RAIL_VERDICT = tl.constexpr(HL.ERR_RAIL_VERDICT)
ERR_ENTRY_VERDICT = tl.constexpr(HL.ERR_ENTRY_VERDICT)
ERR_HOST_VERDICT = tl.constexpr(HL.ERR_HOST_VERDICT)


@triton.jit
def level_bits(msk, wh, LEVEL: tl.constexpr, S):
    """The masked ranks (global bits ``msk``) a wait of this level polls, as its source bits:
    rail, bit g for rank ``g * R + local``; host, bit q for rank ``host * R + q``."""
    if LEVEL == RAIL:
        bits = tl.full([], 0, tl.int64)
        for g in tl.static_range(S.N):
            bits = bits | (((msk >> (g * S.R + wh.local)) & 1) << g)
    else:
        bits = (msk >> (wh.host * S.R)) & ((tl.full([], 1, tl.int64) << S.R) - 1)
    return bits


@triton.jit
def global_bits(bits, wh, LEVEL: tl.constexpr, S):
    """``level_bits`` backwards: a wait's source bits as global rank bits."""
    if LEVEL == RAIL:
        out = tl.full([], 0, tl.int64)
        for g in tl.static_range(S.N):
            out = out | (((bits >> g) & 1) << (g * S.R + wh.local))
    else:
        out = bits << (wh.host * S.R)
    return out


@triton.jit
def fed(msk, s, wh, S):
    """Source rank s reaches this rank: neither s nor its forwarder on this host (local rank
    ``s % R``) is masked."""
    return (((msk >> s) | (msk >> (wh.host * S.R + s % S.R))) & 1) == 0


@triton.jit
def masked_wait(flags, word, timeout_us, err, op, phase, go, NFLAGS: tl.constexpr,
                NP: tl.constexpr, NSRC: tl.constexpr, LEVEL: tl.constexpr, skip, msk, epoch,
                wh, S, MASKS: tl.constexpr, AGREE: tl.constexpr, stats=None,
                STATS: tl.constexpr = 0):
    """A bounded wait of level LEVEL (``common._wait_flags``: NFLAGS flags, one per block and
    source of the NSRC, source fastest) that skips the sources in ``skip`` (level bits) and,
    with MASKS, the masked ranks. Returns ``(ok, msk)``: with MASKS a timeout masks the late
    ranks (added to ``err[ERR_MASK]``) instead of failing. ``AGREE`` (0, or the err word of
    the agreement): every block of the call takes one block's mask, as the dispatch's rows
    need; a rank late here but seen by the deciding block is waited for again.

    Wait statistics (``STATS``): the time waited for each source is added to ``stats`` at its
    global rank (a rail source g: rank ``g * R + local``; a host source q: ``host * R + q``)."""
    st = stats
    if STATS:
        if LEVEL == RAIL:
            st = stats + wh.local
        else:
            st = stats + wh.host * S.R
    STRIDE: tl.constexpr = S.R * (1 - LEVEL) + LEVEL      # RAIL (0): R; HOST (1): 1
    ok, late = _wait_flags(flags, word, timeout_us, err, op, phase, go, NFLAGS, NP, NSRC,
                           skip | level_bits(msk, wh, LEVEL, S), MASKS, st, STATS, STRIDE)
    if MASKS:
        late_g = global_bits(late, wh, LEVEL, S)
        new = msk | late_g
        if AGREE:
            new = _agree_mask(err, epoch, new, AGREE)
            need = (late_g & ~new) != 0
            ok2, _ = _wait_flags(flags, word, timeout_us, err, op, phase, need, NFLAGS, NP,
                                 NSRC, skip | level_bits(new, wh, LEVEL, S), 0, st, STATS,
                                 STRIDE)
            ok = ok & (ok2 | (need == 0))
        if new != msk:
            tl.atomic_or(err + ERR_MASK, new, sem="relaxed", scope="gpu")
        msk = new
    return ok, msk


@triton.jit
def announce(wh, entry_off, word, S):
    """Block 0: ``word`` into this rank's entry flag (byte ``entry_off``, one int64 per local
    rank) on every rank of this host: this rank has begun the call."""
    if tl.program_id(0) == 0:
        tl.debug_barrier()
        for q in tl.static_range(S.R):
            tl.atomic_xchg(_at(wh.tab, wh.host * S.R + q, entry_off, tl.int64) + wh.local, word,
                           sem="release", scope="sys")


@triton.jit
def entry_wait(flags, word, timeout_us, err, op, go, msk, epoch, wh, S, AGREE: tl.constexpr,
               stats=None, STATS: tl.constexpr = 0):
    """Masks: wait (one bound) for every unmasked rank of this host to have begun the call
    (``announce``); one that has not is masked. Returns ``(ok, msk)``. Its errors say "data
    poll", the phase of every host-level wait (the host side names their ranks by it:
    ``peer.HostsPeerEP.precheck``)."""
    return masked_wait(flags, word, timeout_us, err, op, PHASE_DATA, go, S.R, S.HOST_FLAGS_P2,
                       S.R, HOST, tl.full([], 1, tl.int64) << wh.local, msk, epoch, wh, S, 1,
                       AGREE, stats, STATS)


@triton.jit
def later_bound(timeout_us, MASKS: tl.constexpr):
    """The bound of the waits after a call's first ones: twice the bound with masks (a live
    peer may have spent one bound detecting a dead one first), else the bound."""
    if MASKS:
        return timeout_us.to(tl.int64) * 2
    return timeout_us.to(tl.int64)


@triton.jit
def hosts_wait(flags, word, timeout_us, err, op, go, msk, epoch, wh, S, MASKS: tl.constexpr,
               AGREE: tl.constexpr, stats, STATS: tl.constexpr):
    """A call's first rail wait: one flag per host (``flags``: ``[N]``, this host's skipped),
    reported as the entry barrier with the host as source. ``masked_wait``'s ``(ok, msk)``."""
    return masked_wait(flags, word, timeout_us, err, op, phase=PHASE_ENTRY, go=go,
                       NFLAGS=S.N, NP=S.RAIL_FLAGS_P2, NSRC=S.N, LEVEL=RAIL,
                       skip=tl.full([], 1, tl.int64) << wh.host, msk=msk, epoch=epoch, wh=wh,
                       S=S, MASKS=MASKS, AGREE=AGREE, stats=stats, STATS=STATS)


@triton.jit
def ranks_wait(flags, word, timeout_us, err, op, go, msk, epoch, wh, S, MASKS: tl.constexpr,
               AGREE: tl.constexpr, stats, STATS: tl.constexpr):
    """A wait inside the host: one flag per block and rank of this host (``flags``:
    ``[NB, R]``), reported as a data poll with the local rank as source. ``masked_wait``'s
    ``(ok, msk)``."""
    return masked_wait(flags, word, timeout_us, err, op, phase=PHASE_DATA, go=go,
                       NFLAGS=S.NB * S.R, NP=S.HOST_FLAGS_P2, NSRC=S.R, LEVEL=HOST,
                       skip=tl.full([], 0, tl.int64), msk=msk, epoch=epoch, wh=wh, S=S,
                       MASKS=MASKS, AGREE=AGREE, stats=stats, STATS=STATS)

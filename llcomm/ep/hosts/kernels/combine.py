"""The two-level combine: the dispatch's route backwards, one host sum per (token, host) on
the rail.

Rank ``r`` is local rank ``l`` of host ``h`` (as in ``dispatch.py``, whose handle it
reads: ``row_of`` and ``ntok`` of the expert rank, ``fwd_ids`` and ``fwd_ntok`` of the
forwarder). One launch of NB blocks; stages (``HC_*`` bits), each after a bounded wait:

1. weights out (``HC_WEIGHTS``, block 0): the top-k weights of every own token, staged and
   sent to the rail rank of every other host (``c_rail_w[h]``, flag ``c_rail_sig[h]``). When
   the dispatch carried the weights (``CARRIED``: they are in the handle, ``w_of``) the
   message is ENTRY_BYTES that say only that this rank has begun the call: the token's rank
   must have read its previous host sums from a slot before a forwarder writes it again, and
   nothing else in a combine tells the forwarder so. Without masks it is waited for just
   before the first host sum leaves, not at the start.
2. weights in (``HC_FORWARD``, after ``HC_FORWARD_WAIT``): for each host g of its rail, the
   weights of source ``s = g * R + l``'s tokens to every rank of this host (``c_host_w[s]``;
   nothing with ``CARRIED``), then ``c_host_sig[b, l]`` on each.
3. partials (``HC_PARTIALS``, after ``HC_PARTIALS_WAIT``): for each pair (s, t) with entries
   here, ``partial = dtype(fold over k in order: acc = acc + w[k] * fp32(y[row_of[s, t, k]]))``
   (fp32 from +0.0, rounded once), into ``c_part[me, s // R, t]`` of the forwarder of s on
   this host (local rank ``s % R``), then ``c_part_sig[s // R, b, me]`` there.
4. host sums (``HC_HOST_SUM``; its waits, ``HC_HOST_SUM_WAIT``, inside it): for host g, once
   every rank's block b has signalled the partials of the rail source on g, for each of the
   block's forwarded tokens of g, the partials of this host's ranks **in rank order**,
   ``acc = acc + fp32(partial)``, rounded once; a sum for an own token stays here
   (``c_back[h, t]``), the others are staged and sent to the token's rank (``c_back[h, t]``
   there, flag ``c_back_sig[h, t]``).
   Stages 3 and 4 interleave (``_partials_and_sums``): other hosts first, this host last,
   and inside a host the sources in an order that starts at ``b % R``, so a forwarder's
   block sums its source right after the step at which every rank here formed those
   partials, and host sums stream onto the rail while the later partials are formed.
5. out (``HC_OUT``, after ``HC_OUT_WAIT`` for the flags of the block's own tokens' sums):
   each own token's host sums **in host order**,
   ``acc = acc + fp32(host_sum)``, rounded once into ``out``.

That is the order ``reference.py`` defines (docs/multihost.md, "Combine order"). The
counter ``ctrl[b]`` picks the set and advances at the end of stage 5. Rank masks (``MASKS``)
and wait statistics (``STATS``): ``masks.py``.
"""
from collections import namedtuple

import triton
import triton.language as tl

from ....runtime.kernels.sync import (EPOCH_SHIFT, after_previous_kernel, poison, poll_read,
                                     wait_bound)
from ...kernels.common import (EP_RANK_VARYING, ERR_MASK, OP_COMBINE, PHASE_DATA, PHASE_EXIT,
                               _at, _masked, _rank_bits, symbol)
from .. import layout as HL
from .dispatch import Where, ids_arrived, ledger_add, ledger_store
from .masks import (HOST, announce, entry_wait, fed, hosts_wait, later_bound, masked_wait,
                    ranks_wait)
from ...kernels.fp8_rows import FP8_BLOCK, _quantize_row
from ....runtime.kernels.e4m3 import e4m3_value
from .rail import FLAG, PUT_CHUNK, copy_words, host_signal, rail_send, rail_wait

HC_WEIGHTS, HC_FORWARD_WAIT, HC_FORWARD, HC_PARTIALS_WAIT, HC_PARTIALS = 1, 2, 4, 8, 16
HC_HOST_SUM_WAIT, HC_HOST_SUM, HC_OUT_WAIT, HC_OUT = 32, 64, 128, 256
HOSTS_COMBINE_ALL = 511
#: ``return_recv_hook``: the send half puts the weights; the rest waits for peers.
HOSTS_COMBINE_SEND_HALF = HC_WEIGHTS
HOSTS_COMBINE_RECV_HALF = HOSTS_COMBINE_ALL & ~HC_WEIGHTS
#: The stages between waits, in order (``dispatch.HOSTS_DISPATCH_STEPS``).
HOSTS_COMBINE_STEPS = (HC_WEIGHTS, HC_FORWARD_WAIT | HC_FORWARD, HC_PARTIALS_WAIT | HC_PARTIALS,
                       HC_HOST_SUM_WAIT | HC_HOST_SUM, HC_OUT_WAIT | HC_OUT)
STAGE_WEIGHTS = tl.constexpr(HC_WEIGHTS)
STAGE_FORWARD_WAIT = tl.constexpr(HC_FORWARD_WAIT)
STAGE_FORWARD = tl.constexpr(HC_FORWARD)
STAGE_PARTIALS_WAIT = tl.constexpr(HC_PARTIALS_WAIT)
STAGE_PARTIALS = tl.constexpr(HC_PARTIALS)
STAGE_HOST_SUM = tl.constexpr(HC_HOST_SUM)
#: Bytes of the entry message that replaces the weights when the dispatch carried them.
ENTRY_BYTES = tl.constexpr(HL.ENTRY_BYTES)
STAGE_OUT_WAIT = tl.constexpr(HC_OUT_WAIT)
STAGE_OUT = tl.constexpr(HC_OUT)

#: Byte offsets of the combine's regions in set 0 (``layout.py``) and the set's size.
HostCombineRegions = namedtuple("HostCombineRegions", [
    "SET_BYTES", "RAIL_SIG", "HOST_SIG", "HOST_ENTRY", "PART_SIG", "BACK_SIG", "STAGE_W",
    "RAIL_W", "HOST_W", "PART", "STAGE_BACK", "BACK"])
@triton.jit
def _weights_stride(S):
    """Bytes between two hosts' weight blocks in ``c_rail_w``: a block rounded up to 16
    bytes, as a put moves whole 16-byte units and must not reach into the next block."""
    return (S.T * S.K * 4 + 15) // 16 * 16


@triton.jit
def _weights_out(wts, n_tok, wh, word, S, RG, SHMEM: tl.constexpr, CARRIED: tl.constexpr):
    """Stage 1 (block 0): one message to each other host (flag ``c_rail_sig[h]``): the
    weights, or with ``CARRIED`` (the dispatch brought them) ENTRY_BYTES that only say this
    rank has begun the call. Returns its ledger (messages and bytes per host)."""
    msgs = tl.zeros([S.RAIL_FLAGS_P2], tl.int64)
    nbytes = tl.zeros([S.RAIL_FLAGS_P2], tl.int64)
    if CARRIED:
        put_bytes = tl.full([], ENTRY_BYTES, tl.int32)
    else:
        n_words = n_tok * S.K
        copy_words(_at(wh.tab, wh.rank, wh.set_off + RG.STAGE_W, tl.int32),
                   wts.to(tl.pointer_type(tl.int32)), n_words, PUT_CHUNK)
        tl.debug_barrier()
        put_bytes = (n_words * 4 + 15) // 16 * 16
    for g in range(S.N):
        if g != wh.host:
            rail_send(wh.tab, wh.rank, g * S.R + wh.local,
                      wh.set_off + RG.RAIL_W + wh.host * _weights_stride(S),
                      wh.set_off + RG.STAGE_W, put_bytes,
                      wh.set_off + RG.RAIL_SIG + wh.host * FLAG, word, SHMEM)
            msgs, nbytes = ledger_add(msgs, nbytes, g, put_bytes, S)
    return msgs, nbytes


@triton.jit
def _weights_in(wts, fwd_ntok, msk, wh, word, S, RG, CARRIED: tl.constexpr):
    """Stage 2 (module doc); none for a masked source (``msk``). With ``CARRIED`` only the
    signal: this rank has begun the call."""
    b = tl.program_id(0)
    ks = tl.arange(0, S.KP)
    km = ks < S.K
    if not CARRIED:
        for g in range(S.N):
            s = g * S.R + wh.local
            if g == wh.host:
                src = wts
            else:
                src = _at(wh.tab, wh.rank, wh.set_off + RG.RAIL_W + g * _weights_stride(S),
                          tl.float32)
            for t in range(b, tl.where(_masked(msk, s), 0, tl.load(fwd_ntok + g)), S.NB):
                w = tl.load(src + t * S.K + ks, mask=km)
                for q in tl.static_range(S.R):
                    tl.store(_at(wh.tab, wh.host * S.R + q, wh.set_off + RG.HOST_W, tl.float32)
                             + (s * S.T + t) * S.K + ks, w, mask=km)
    for q in tl.static_range(S.R):
        host_signal(wh.tab, wh.host * S.R + q,
                    wh.set_off + RG.HOST_SIG + (b * S.R + wh.local) * FLAG, word)


@triton.jit
def _source_partials(g, j, eo, row_of, ntok_in, wp, msk, wh, word, S, RG):
    """Stage 3 for source ``s = g * R + j``: the partials of this block's tokens of s into
    ``c_part[me, g]`` of its forwarder here (local rank j), then ``c_part_sig[g, b, me]``
    there, its only reader. None for a source that is masked or whose forwarder is (``msk``);
    the signal all the same."""
    b = tl.program_id(0)
    DT = eo.dtype.element_ty
    hs = tl.arange(0, S.HP)
    hm = hs < S.H
    s = g * S.R + j
    part = (_at(wh.tab, wh.host * S.R + j, wh.set_off + RG.PART, DT)
            + ((wh.local * S.N + g) * S.T) * S.H)
    for t in range(b, tl.where(fed(msk, s, wh, S), tl.load(ntok_in + s), 0), S.NB):
        acc = tl.zeros([S.HP], tl.float32)
        here = tl.full([], 0, tl.int32)
        for k in tl.static_range(S.K):
            r = tl.load(row_of + (s * S.T + t) * S.K + k)
            if r >= 0:
                w = tl.load(wp + (s * S.T + t) * S.K + k)
                y = tl.load(eo + r.to(tl.int64) * S.H + hs, mask=hm, other=0.0)
                acc = acc + w * y.to(tl.float32)
                here = here | 1
        if here != 0:
            tl.store(part + t * S.H + hs, acc.to(DT), mask=hm)
    host_signal(wh.tab, wh.host * S.R + j,
                wh.set_off + RG.PART_SIG + ((g * S.NB + b) * S.R + wh.local) * FLAG, word)


@triton.jit
def _host_sum(g, fwd_ids, fwd_ntok, msk, ok, msgs, nbytes, wh, word, timeout_us, err, stats,
              DT: tl.constexpr, S, RG, SHMEM: tl.constexpr, MASKS: tl.constexpr,
              STATS: tl.constexpr, RAIL_FP8: tl.constexpr):
    """Stage 4 for host g: once every rank of this host has stored this block's partials of
    the rail source on g (``c_part_sig[g, b]``: a bounded wait, which with masks masks a late
    rank), the sums of this block's tokens of that source. Masks (``msk``): no sums for a
    masked source; a masked rank's partial counts as zero, and a host sum is sent for every
    token routed here all the same (zeros when all its experts here are masked), so the
    token's rank never reads a stale slot. Each sum sent is one message with its own flag
    (``c_back_sig[h, t]`` at the token's rank): the sum in the buffer dtype, or with
    ``RAIL_FP8`` its e4m3 bytes and one fp32 scale per 128 channels (``_quantize_row``, from
    the fp32 sum). Returns ``(ok, msk, messages, bytes)``, the block's ledger per host with
    this host's messages added."""
    b = tl.program_id(0)
    hs = tl.arange(0, S.HP)
    hm = hs < S.H
    ks = tl.arange(0, S.KP)
    row_bytes = S.H * DT.primitive_bitwidth // 8
    put_bytes = row_bytes
    if RAIL_FP8:
        put_bytes = S.SUM_FP8_BYTES
    part = _at(wh.tab, wh.rank, wh.set_off + RG.PART, DT)
    ok2, msk = masked_wait(_at(wh.tab, wh.rank, wh.set_off + RG.PART_SIG, tl.int64)
                           + (g * S.NB + b) * S.R, word, timeout_us, err, OP_COMBINE,
                           PHASE_DATA, ok, S.R, S.HOST_FLAGS_P2, S.R, HOST,
                           tl.full([], 0, tl.int64), msk, 0, wh, S, MASKS, 0, stats, STATS)
    ok = ok & (ok2 != 0)
    ng = tl.where(_masked(msk, g * S.R + wh.local) | (ok == 0), 0, tl.load(fwd_ntok + g))
    for t in range(b, ng, S.NB):
        ids = tl.load(fwd_ids + (g * S.T + t) * S.K + ks, mask=ks < S.K, other=-1)
        dest = tl.where(ids >= 0, ids // S.L - wh.host * S.R, -1)  # local rank, or none
        acc = tl.zeros([S.HP], tl.float32)
        went = tl.full([], 0, tl.int32)
        for q in tl.static_range(S.R):
            if tl.max((dest == q).to(tl.int32), 0) > 0:
                went = went | 1
                if ((msk >> (wh.host * S.R + q)) & 1) == 0:     # q not masked
                    p = tl.load(part + ((q * S.N + g) * S.T + t) * S.H + hs, mask=hm,
                                other=0.0)
                    acc = acc + p.to(tl.float32)
        if went != 0:
            if g == wh.host:
                tl.store(_at(wh.tab, wh.rank, wh.set_off + RG.BACK, DT)
                         + (g * S.T + t) * S.H + hs, acc.to(DT), mask=hm)
            else:
                at = wh.set_off + RG.STAGE_BACK + (g * S.T + t) * row_bytes
                if RAIL_FP8:
                    qb, sc = _quantize_row(acc, S.HP, False)
                    tl.store(_at(wh.tab, wh.rank, at, tl.uint8) + hs, qb, mask=hm)
                    ns = tl.arange(0, S.HP // FP8_BLOCK)
                    tl.store(_at(wh.tab, wh.rank, at + S.H, tl.float32) + ns, sc,
                             mask=ns < S.H // FP8_BLOCK)
                else:
                    tl.store(_at(wh.tab, wh.rank, at, DT) + hs, acc.to(DT), mask=hm)
                tl.debug_barrier()      # staged before the block puts it
                rail_send(wh.tab, wh.rank, g * S.R + wh.local,
                          wh.set_off + RG.BACK + (wh.host * S.T + t) * row_bytes, at,
                          put_bytes, wh.set_off + RG.BACK_SIG + (wh.host * S.T + t) * FLAG,
                          word, SHMEM)
                msgs, nbytes = ledger_add(msgs, nbytes, g, put_bytes, S)
    return ok, msk, msgs, nbytes


@triton.jit
def _partials_and_sums(eo, row_of, ntok_in, wp, fwd_ids, fwd_ntok, msk, ok, wh, word,
                       timeout_us, err, stats, DT: tl.constexpr, S, RG, STAGES: tl.constexpr,
                       SHMEM: tl.constexpr, MASKS: tl.constexpr, STATS: tl.constexpr,
                       CARRIED: tl.constexpr, RAIL_FP8: tl.constexpr):
    """Stages 3 and 4 (module doc), interleaved: the other hosts first, this host last; inside
    a host the sources from local rank ``b % R`` on, so each forwarder's rail source comes up
    at a different step in different blocks, and every block sums its forwarder's source as
    soon as the ranks here have formed its partials: host sums stream onto the rail while the
    rest of the partials are formed. With only one of the two stages in ``STAGES`` (launched
    apart), that one for every host. ``CARRIED`` without masks: the rail entry flags are
    waited for here, before the first sum leaves. Returns ``(ok, msk, messages, bytes)``."""
    b = tl.program_id(0)
    msgs = tl.zeros([S.RAIL_FLAGS_P2], tl.int64)
    nbytes = tl.zeros([S.RAIL_FLAGS_P2], tl.int64)
    for gi in range(S.N):
        g = (wh.host + 1 + gi) % S.N        # other hosts first, own host last
        for i in range(S.R):
            j = (b + i) % S.R
            if STAGE_PARTIALS & STAGES:
                _source_partials(g, j, eo, row_of, ntok_in, wp, msk, wh, word, S, RG)
            if STAGE_HOST_SUM & STAGES:
                if j == wh.local:
                    if CARRIED and not MASKS:
                        if gi == 0:
                            ok_r, msk = hosts_wait(
                                _at(wh.tab, wh.rank, wh.set_off + RG.RAIL_SIG, tl.int64), word,
                                timeout_us, err, OP_COMBINE, go=ok, msk=msk,
                                epoch=(word >> EPOCH_SHIFT), wh=wh, S=S, MASKS=MASKS, AGREE=0,
                                stats=stats, STATS=STATS)
                            ok = ok & (ok_r != 0)
                    ok, msk, msgs, nbytes = _host_sum(g, fwd_ids, fwd_ntok, msk, ok, msgs,
                                                      nbytes, wh, word, timeout_us, err, stats,
                                                      DT, S, RG, SHMEM, MASKS, STATS,
                                                      RAIL_FP8)
    return ok, msk, msgs, nbytes


@triton.jit
def _sums_arrived(topk, n_tok, msk, wh, word, timeout_us, err, go, S, RG,
                  SHMEM: tl.constexpr):
    """Wait for the host sums of this block's own tokens from every other host that holds
    one of their experts and is fed (``masks.fed``): flags ``c_back_sig[g, t]``, one lane per
    (token, host). 1, or 0 after an error naming the late hosts (a rail wait)."""
    b = tl.program_id(0)
    lane = tl.arange(0, S.TOK_P2 * S.RAIL_FLAGS_P2)
    t = b + S.NB * (lane // S.RAIL_FLAGS_P2)
    g = lane % S.RAIL_FLAGS_P2
    ks = tl.arange(0, S.KP)
    live = (t < n_tok) & (g < S.N) & (g != wh.host)
    ids = tl.load(topk + t[:, None] * S.K + ks[None, :], mask=live[:, None] & (ks < S.K)[None, :],
                  other=-1)
    routed = tl.max(((ids >= 0) & (ids < S.E) & (ids // (S.L * S.R) == g[:, None]))
                    .to(tl.int32), 1) != 0
    need = live & routed & fed(msk, g * S.R + wh.local, wh, S)
    flags = _at(wh.tab, wh.rank, wh.set_off + RG.BACK_SIG, tl.int64) + g * S.T + t
    return rail_wait(flags, need, g.to(tl.int64), word, timeout_us, err, OP_COMBINE, PHASE_EXIT,
                     go, SHMEM)


@triton.jit
def _host_sum_in(slot, g, wh, S, RAIL_FP8: tl.constexpr):
    """Host g's sum of a token (``[HP]`` fp32) from its slot ``c_back[g, t]`` (a buffer-dtype
    pointer): the buffer-dtype row, or with ``RAIL_FP8``, for another host, its e4m3 bytes
    times their 128-channel block's fp32 scale (the bytes, then the scales)."""
    hs = tl.arange(0, S.HP)
    hm = hs < S.H
    if RAIL_FP8:
        if g != wh.host:
            at = slot.to(tl.pointer_type(tl.uint8))
            q = tl.load(at + hs, mask=hm, other=0)
            sc = tl.load((at + S.H).to(tl.pointer_type(tl.float32)) + hs // FP8_BLOCK, mask=hm,
                         other=0.0)
            v = e4m3_value(q) * sc
        else:
            v = tl.load(slot + hs, mask=hm, other=0.0).to(tl.float32)
    else:
        v = tl.load(slot + hs, mask=hm, other=0.0).to(tl.float32)
    return v


@triton.jit
def _out(topk, n_tok, out, msk, wh, S, RG, RAIL_FP8: tl.constexpr):
    """Stage 5 (module doc). Masks (``msk``): a host whose rail rank is masked counts as
    zero, and every host does when this rank is masked (its tokens were skipped).
    ``RAIL_FP8``: another host's sum is its e4m3 bytes times their block's scale (fp32)."""
    b = tl.program_id(0)
    DT = out.dtype.element_ty
    hs = tl.arange(0, S.HP)
    hm = hs < S.H
    back = _at(wh.tab, wh.rank, wh.set_off + RG.BACK, DT)
    for t in range(b, n_tok, S.NB):
        hosts = _rank_bits(topk + t * S.K, S.K, S.E, S.L * S.R)
        acc = tl.zeros([S.HP], tl.float32)
        for g in tl.static_range(S.N):
            if (((hosts >> g) & 1) != 0) & fed(msk, g * S.R + wh.local, wh, S):
                acc = acc + _host_sum_in(back + (g * S.T + t) * S.H, g, wh, S, RAIL_FP8)
        tl.store(out + t * S.H + hs, acc.to(DT), mask=hm)


@triton.jit
def _poison_out(out, n_tok, S):
    """What a failed combine leaves: ``out`` poisoned (NaN)."""
    b = tl.program_id(0)
    hs = tl.arange(0, S.HP)
    for t in range(b, n_tok, S.NB):
        poison(out, t * S.H + hs, hs < S.H)


@triton.jit(do_not_specialize=EP_RANK_VARYING, repr=symbol("hosts_combine"))
def hosts_combine_kernel(
        eo,             # [L, W * T, H] expert outputs (buffer dtype)
        topk,           # [n_tok, K] int64, as given to the dispatch
        wts,            # [n_tok, K] fp32 top-k weights
        n_tok,          # tokens of this rank
        out,            # [n_tok, H] output
        row_of,         # [W, T, K] int32 handle (expert rank)
        ntok_in,        # [W] int32 handle: tokens of each source rank
        fwd_ids,        # [N, T, K] int32 handle (forwarder)
        fwd_ntok,       # [N] int32 handle (forwarder)
        tab, ctrl, err, rank, tag, timeout_us,
        ledger,         # [NB, N, 3] int64: messages, flags, bytes each block sent each host
        stats,          # [W] int64 wait statistics (STATS), or None
        SIZES: tl.constexpr,        # dispatch.HostSizes
        REGIONS: tl.constexpr,      # HostCombineRegions
        STAGES: tl.constexpr,       # HC_* bits
        SHMEM: tl.constexpr,        # rail.PLAIN, NVSHMEM or ROCSHMEM: the messages' backend
        MASKS: tl.constexpr = 0,    # 1: rank masks (err[ERR_MASK]; masks.py)
        STATS: tl.constexpr = 0,    # 1: wait statistics into stats (masks.masked_wait)
        PDL: tl.constexpr = 0,
        w_of=None,      # [W, T, K] fp32 handle: the weights the dispatch carried (CARRIED)
        CARRIED: tl.constexpr = 0,      # 1: no weights cross; the partials read w_of
        RAIL_FP8: tl.constexpr = 0):    # 1: host sums cross hosts as e4m3 + scales
    after_previous_kernel(PDL)
    b = tl.program_id(0)
    DT = out.dtype.element_ty
    timeout_us, broken = wait_bound(timeout_us, err)
    seq = tl.load(ctrl + b)
    word = ((seq + 1) << EPOCH_SHIFT) | tag
    wh = Where(tab, rank, rank // SIZES.R, rank % SIZES.R, (seq % 2) * REGIONS.SET_BYTES)
    msgs = tl.zeros([SIZES.RAIL_FLAGS_P2], tl.int64)
    nbytes = tl.zeros([SIZES.RAIL_FLAGS_P2], tl.int64)
    if STAGE_WEIGHTS & STAGES:
        if MASKS:
            announce(wh, wh.set_off + REGIONS.HOST_ENTRY, word, SIZES)
        if b == 0:
            msgs, nbytes = _weights_out(wts, n_tok, wh, word, SIZES, REGIONS, SHMEM, CARRIED)
        ledger_store(ledger, msgs, nbytes, SIZES, 0)
    # masks: each block uses its own waits' view, as on one host (a block's tokens depend on
    # its own waits only)
    msk = tl.full([], 0, tl.int64)
    if MASKS:
        msk = poll_read(err + ERR_MASK)
    ok = tl.full([], 1, tl.int32) != 0
    if (STAGE_FORWARD_WAIT & STAGES) and (MASKS or not CARRIED):     # else before the sums
        ok, msk = hosts_wait(_at(tab, rank, wh.set_off + REGIONS.RAIL_SIG, tl.int64), word,
                             timeout_us, err, OP_COMBINE, go=1, msk=msk, epoch=seq + 1, wh=wh,
                             S=SIZES, MASKS=MASKS, AGREE=0, stats=stats, STATS=STATS)
        if MASKS:
            ok_e, msk = entry_wait(_at(tab, rank, wh.set_off + REGIONS.HOST_ENTRY, tl.int64),
                                   word, timeout_us, err, OP_COMBINE, go=ok, msk=msk,
                                   epoch=seq + 1, wh=wh, S=SIZES, AGREE=0, stats=stats,
                                   STATS=STATS)
            ok = ok & ok_e
        if not CARRIED:     # the weights are read next
            if ok:
                ids_arrived(_at(tab, rank, wh.set_off + REGIONS.RAIL_SIG, tl.int64), word, wh,
                            SIZES, SHMEM)
    later_us = later_bound(timeout_us, MASKS)
    if STAGE_FORWARD & STAGES:
        if ok:
            _weights_in(wts, fwd_ntok, msk, wh, word, SIZES, REGIONS, CARRIED)
    if STAGE_PARTIALS_WAIT & STAGES:
        ok2, msk = ranks_wait(_at(tab, rank, wh.set_off + REGIONS.HOST_SIG, tl.int64), word,
                              later_us, err, OP_COMBINE, go=ok, msk=msk, epoch=seq + 1, wh=wh,
                              S=SIZES, MASKS=MASKS, AGREE=0, stats=stats, STATS=STATS)
        ok = ok & ok2
    if (STAGE_PARTIALS | STAGE_HOST_SUM) & STAGES:  # the sums' waits (HC_HOST_SUM_WAIT) inside
        if ok:
            if CARRIED:
                wp = w_of
            else:
                wp = _at(tab, rank, wh.set_off + REGIONS.HOST_W, tl.float32)
            ok, msk, h_msgs, h_bytes = _partials_and_sums(
                eo, row_of, ntok_in, wp, fwd_ids, fwd_ntok, msk, ok, wh, word, later_us, err,
                stats, DT, SIZES, REGIONS, STAGES, SHMEM, MASKS, STATS, CARRIED, RAIL_FP8)
            if STAGE_HOST_SUM & STAGES:
                ledger_store(ledger, h_msgs, h_bytes, SIZES, 1)
    if STAGE_OUT_WAIT & STAGES:
        ok = _sums_arrived(topk, n_tok, msk, wh, word, later_us, err, ok, SIZES, REGIONS,
                           SHMEM)
    if STAGE_OUT & STAGES:
        if (ok != 0) & (broken == 0):
            _out(topk, n_tok, out, msk, wh, SIZES, REGIONS, RAIL_FP8)
        else:
            _poison_out(out, n_tok, SIZES)
        tl.store(ctrl + b, seq + 1)

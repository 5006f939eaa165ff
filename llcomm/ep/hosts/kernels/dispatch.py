"""The two-level dispatch: a token crosses to each other host once, on its rail, and is
forwarded inside that host to the ranks that hold its experts.

Rank ``r`` is local rank ``l = r % R`` of host ``h = r // R``. One launch of NB blocks; block b
owns tokens ``b, b + NB, ...`` of every list it walks, and the expand's (source, local
expert) pairs ``b, b + NB, ...``.
Stages (``STAGES`` bits, ``HD_*``), separated by bounded waits:

1. send (``HD_SEND``): block 0 first sends the token count and every token's top-k ids (with
   ``CARRY`` their top-k weights after them, for the combine) to every other host
   (``d_rail_ids[h]``, flag ``d_rail_sig[h]``); then each block stages each
   own token's row in the heap (FP8: quantised here, once) and sends it once to every *other*
   host holding one of its experts, at the rank of local index l there (its rail rank):
   ``d_rail_rows[h, t]``, flag ``d_row_sig[h, t]``. Each message is one put-with-signal with a
   flag of its own (``rail.py``).
2. forward (``forward.py``). Own tokens (``HD_FORWARD_OWN``, in the send half, no wait): each
   goes from the staging area to the ranks of this host that hold its experts,
   ``d_host_rows[s, t]`` there (with ``CARRY`` its weights too, ``d_host_w[s, t]``), and its
   ids to every rank of this host and into the handle (``fwd_ids``: the combine retraces the
   route). Then (``HD_FORWARD``) the same for the
   tokens of every other source ``s = g * R + l`` of its rail: host by host as their id blocks
   arrive, each token as soon as its row's flag is set (with masks, ``HD_FORWARD_WAIT`` first
   waits for every host's id block and agrees on the mask). Each block then signals
   ``d_host_sig[b, l]`` on every rank of the host.
3. expand (``HD_EXPAND``, after ``HD_EXPAND_WAIT`` for every forwarder's signals): for each
   local expert, the rows routed to it, sources in rank order, tokens in order, packed from 0
   into ``recv_x``, with ``src_info``, ``row_of`` and ``recv_count``: the single-host layout
   (with ``CARRY`` each entry's weight into the handle beside ``row_of``, ``w_of``).
   The forwarders counted each source's tokens per expert (``d_host_cnt``), so each (source,
   expert) pair knows where its rows start, and the blocks share the pairs.

The messages across hosts go through ``rail.py`` (SHMEM, or plain stores with ``SHMEM`` = 0),
and each block counts them in its row of ``ledger`` (the wire ledger); everything inside a host
is stores through the region table. Flags are int64 words
``((counter + 1) << EPOCH_SHIFT) | tag`` as in the single-host kernels; the block counter
``ctrl[b]`` picks the buffer set and advances at the end of the expand. Rank masks
(``MASKS``) and wait statistics (``STATS``): ``masks.py``.
"""
from collections import namedtuple

import triton
import triton.language as tl

from ....runtime.kernels.sync import (EPOCH_SHIFT, after_previous_kernel, poison, poll_read,
                                     wait_bound)
from .. import layout as HL
from ...kernels.common import (EP_RANK_VARYING, ERR_MASK, OP_DISPATCH, _at,
                               _rank_bits, symbol)
from ...kernels.fp8_rows import _quantize_row
from .masks import (ERR_ENTRY_VERDICT, ERR_HOST_VERDICT, ERR_RAIL_VERDICT, announce,
                    entry_wait, fed, hosts_wait, later_bound, ranks_wait)
from .forward import forward_host, forward_own, next_host
from .rail import FLAG, copy_words, host_signal, rail_arrived, rail_send

HD_SEND, HD_FORWARD_OWN, HD_FORWARD_WAIT, HD_FORWARD, HD_EXPAND_WAIT, HD_EXPAND = (
    1, 2, 4, 8, 16, 32)
HOSTS_DISPATCH_ALL = 63
#: ``return_recv_hook``: the send half is the rail puts and the own tokens' forward, which wait
#: for nothing; the rest waits for peers.
HOSTS_DISPATCH_SEND_HALF = HD_SEND | HD_FORWARD_OWN
HOSTS_DISPATCH_RECV_HALF = HD_FORWARD_WAIT | HD_FORWARD | HD_EXPAND_WAIT | HD_EXPAND
#: The stages between waits, in order: launched one group at a time on every rank in turn, each
#: group's waits find their signals set (how ``llcomm/bench/ep_interp.py`` runs the ranks).
HOSTS_DISPATCH_STEPS = (HD_SEND | HD_FORWARD_OWN, HD_FORWARD_WAIT | HD_FORWARD,
                        HD_EXPAND_WAIT | HD_EXPAND)
STAGE_SEND = tl.constexpr(HD_SEND)
STAGE_FORWARD_OWN = tl.constexpr(HD_FORWARD_OWN)
STAGE_FORWARD_WAIT = tl.constexpr(HD_FORWARD_WAIT)
STAGE_FORWARD = tl.constexpr(HD_FORWARD)
STAGE_EXPAND_WAIT = tl.constexpr(HD_EXPAND_WAIT)
STAGE_EXPAND = tl.constexpr(HD_EXPAND)

#: Words of an id block before the ids: the token count first.
ID_HEADER = tl.constexpr(HL.ID_HEADER_WORDS)
#: The word of ``err`` that holds the address of the host's input-error count.
ERR_INPUT_ADDR = tl.constexpr(HL.ERR_INPUT_ADDR)
#: Tokens per tile of the expand's scan, and int32 words per step of its row copies.
EXPAND_TILE = tl.constexpr(8)
COPY_CHUNK = tl.constexpr(512)

#: Sizes of the two-level kernels (constexpr ``SIZES``): hosts N, ranks per host R, ranks W,
#: max tokens T, hidden H and pow2 HP, top-k K and pow2 KP, experts E, local experts L, blocks
#: NB, and a row slot: its stride in bytes (``ROW_BYTES``), the bytes a call's row fills and
#: sends (``PUT_BYTES``: an FP8 row in a buffer sized for bf16 is about half; its int32
#: words' pow2 ``PUT_WP``: the forwarder loads a row as one tile), its int32 words to
#: recv_x (``RX_WORDS``) and FP8 scales (``SCALES``, pow2 ``SCALES_P2``; 0 without FP8).
#: Also pow2s: of the hosts, the flags of a rail wait (``RAIL_FLAGS_P2``: one per host), of
#: the flags of a host wait (``HOST_FLAGS_P2``: ``NB * R``), and of a block's share of T
#: tokens (``TOK_P2``: its lanes in a wait for its messages, ``rail.rail_wait`` and
#: ``forward.forward_host``); and of W (``WP``), L (``LP``) and the host's experts R L
#: (``EHP``): the expert counts' lanes. ``SUM_FP8_BYTES``: a host sum crossing hosts in FP8
#: (``layout.fp8_sum_bytes``; 0 where hidden is no multiple of 128).
HostSizes = namedtuple("HostSizes", ["N", "R", "W", "T", "H", "HP", "K", "KP", "E", "L", "NB",
                                     "ROW_BYTES", "PUT_BYTES", "PUT_WP", "RX_WORDS", "SCALES",
                                     "SCALES_P2",
                                     "RAIL_FLAGS_P2", "HOST_FLAGS_P2", "TOK_P2", "WP", "LP",
                                     "EHP", "SUM_FP8_BYTES"])
#: Byte offsets of the dispatch's regions in set 0 (``layout.py``), the set's size and an
#: id block's size.
HostDispatchRegions = namedtuple("HostDispatchRegions", [
    "SET_BYTES", "IDS_BYTES", "RAIL_SIG", "ROW_SIG", "HOST_SIG", "HOST_ENTRY", "STAGE_IDS", "STAGE",
    "RAIL_IDS", "RAIL_ROWS", "HOST_NTOK", "HOST_CNT", "HOST_IDS", "HOST_W", "HOST_ROWS"])
#: Where this call's data lives (runtime values): region table, this rank, its host and local
#: index, the set's byte offset.
Where = namedtuple("Where", ["tab", "rank", "host", "local", "set_off"])


@triton.jit
def _stage_row(x, t, at, S, FP8: tl.constexpr):
    """Token t's row into this rank's heap at ``at`` (an int32 pointer): the buffer-dtype row,
    or (FP8) its e4m3 bytes then its fp32 scales."""
    hs = tl.arange(0, S.HP)
    hm = hs < S.H
    if FP8:
        v = tl.load(x + t * S.H + hs, mask=hm, other=0.0).to(tl.float32)
        qb, sc = _quantize_row(v, S.HP, FP8 == 2)
        tl.store(at.to(tl.pointer_type(tl.uint8)) + hs, qb, mask=hm)
        ns = tl.arange(0, S.HP // 128)
        tl.store((at + S.RX_WORDS).to(tl.pointer_type(tl.float32)) + ns, sc, mask=ns < S.SCALES)
    else:
        copy_words(at, (x + t * S.H).to(tl.pointer_type(tl.int32)), S.RX_WORDS, COPY_CHUNK)


@triton.jit
def ledger_add(msgs, nbytes, g, n_bytes, S):
    """The wire ledger of a block (``[RAIL_FLAGS_P2]`` per destination host): one more
    message (each with its flag) of ``n_bytes`` to host g."""
    at = tl.arange(0, S.RAIL_FLAGS_P2) == g
    return msgs + at.to(tl.int64), nbytes + tl.where(at, n_bytes, 0).to(tl.int64)


@triton.jit
def ledger_store(ledger, msgs, nbytes, S, ADD: tl.constexpr):
    """This block's ledger row ``ledger[b, g] = (messages, flags, bytes)`` for every host g
    (``ADD``: added to what an earlier launch of the call stored)."""
    gs = tl.arange(0, S.RAIL_FLAGS_P2)
    at = ledger + (tl.program_id(0) * S.N + gs) * 3
    m = gs < S.N
    if ADD:
        tl.atomic_add(at, msgs, mask=m, sem="relaxed", scope="gpu")
        tl.atomic_add(at + 1, msgs, mask=m, sem="relaxed", scope="gpu")
        tl.atomic_add(at + 2, nbytes, mask=m, sem="relaxed", scope="gpu")
    else:
        tl.store(at, msgs, mask=m)
        tl.store(at + 1, msgs, mask=m)
        tl.store(at + 2, nbytes, mask=m)


@triton.jit
def _send(x, topk, wts, n_tok, err, wh, word, ledger, S, RG, FP8: tl.constexpr,
          SHMEM: tl.constexpr, CARRY: tl.constexpr):
    """Stage 1 (module doc): each message one put-with-signal with a flag of its own (a row:
    ``d_row_sig[h, t]``; the id block: ``d_rail_sig[h]``). ``CARRY``: the id block holds the
    top-k weights ``wts`` after the ids. Stores this block's ledger row."""
    b = tl.program_id(0)
    msgs = tl.zeros([S.RAIL_FLAGS_P2], tl.int64)
    nbytes = tl.zeros([S.RAIL_FLAGS_P2], tl.int64)
    if b == 0:      # first the token count and every token's ids, to every other host
        idp = _at(wh.tab, wh.rank, wh.set_off + RG.STAGE_IDS, tl.int32)
        tl.store(idp, n_tok)
        ks = tl.arange(0, S.KP)
        nbad = tl.full([], 0, tl.int32)
        for t0 in range(0, n_tok, EXPAND_TILE):
            ts = t0 + tl.arange(0, EXPAND_TILE)
            m2 = (ts < n_tok)[:, None] & (ks < S.K)[None, :]
            ids = tl.load(topk + ts[:, None] * S.K + ks[None, :], mask=m2, other=-1)
            nbad += tl.sum(tl.sum((m2 & ((ids < -1) | (ids >= S.E))).to(tl.int32), 1), 0)
            ids = tl.where((ids >= 0) & (ids < S.E), ids, -1).to(tl.int32)
            tl.store(idp + ID_HEADER + ts[:, None] * S.K + ks[None, :], ids, mask=m2)
            if CARRY:
                w = tl.load(wts + ts[:, None] * S.K + ks[None, :], mask=m2, other=0.0)
                tl.store(idp.to(tl.pointer_type(tl.float32)) + ID_HEADER + n_tok * S.K
                         + ts[:, None] * S.K + ks[None, :], w, mask=m2)
        if nbad > 0:        # out-of-range top-k entries, for the host to report
            tl.store(tl.load(err + ERR_INPUT_ADDR).to(tl.pointer_type(tl.int64)),
                     nbad.to(tl.int64))
        tl.debug_barrier()
        ids_bytes = (ID_HEADER * 4 + n_tok * S.K * 4 * (1 + CARRY) + 15) // 16 * 16
        for g in range(S.N):
            if g != wh.host:
                rail_send(wh.tab, wh.rank, g * S.R + wh.local,
                          wh.set_off + RG.RAIL_IDS + wh.host * RG.IDS_BYTES,
                          wh.set_off + RG.STAGE_IDS, ids_bytes,
                          wh.set_off + RG.RAIL_SIG + wh.host * FLAG, word, SHMEM)
                msgs, nbytes = ledger_add(msgs, nbytes, g, ids_bytes, S)
    for t in range(b, n_tok, S.NB):
        row_off = wh.set_off + RG.STAGE + t * S.ROW_BYTES
        _stage_row(x, t, _at(wh.tab, wh.rank, row_off, tl.int32), S, FP8)
        tl.debug_barrier()          # the row is staged before the block puts it
        hosts = _rank_bits(topk + t * S.K, S.K, S.E, S.L * S.R)
        for g in range(S.N):
            if (g != wh.host) & (((hosts >> g) & 1) != 0):
                rail_send(wh.tab, wh.rank, g * S.R + wh.local,
                          wh.set_off + RG.RAIL_ROWS + (wh.host * S.T + t) * S.ROW_BYTES,
                          row_off, S.PUT_BYTES,
                          wh.set_off + RG.ROW_SIG + (wh.host * S.T + t) * FLAG, word, SHMEM)
                msgs, nbytes = ledger_add(msgs, nbytes, g, S.PUT_BYTES, S)
    ledger_store(ledger, msgs, nbytes, S, 0)


@triton.jit
def ids_arrived(flags, word, wh, S, SHMEM: tl.constexpr):
    """After the rail wait: SHMEM's wait, once, on each other host's id flag (``flags``: its
    ``[N]`` flags) that holds ``word`` (a masked host's may not: SHMEM's wait never gives
    up)."""
    for g in range(S.N):
        if g != wh.host:
            if poll_read(flags + g) == word:
                rail_arrived(flags + g, word, SHMEM)


@triton.jit
def _forward(fwd_ids, fwd_ntok, msk, wh, word, timeout_us, err, stats, S, RG,
             SHMEM: tl.constexpr, MASKS: tl.constexpr, STATS: tl.constexpr,
             CARRY: tl.constexpr):
    """Stage 2 for the other hosts' sources (``forward.py``): without masks each host as its
    id block arrives (``next_host``), with masks (their id blocks already waited for) in host
    order; each host's tokens as their rows arrive. Then this block signals every rank of the
    host. Returns 1, or 0 after an error (then nothing is signalled: the ranks of this host
    time out rather than read rows that never came)."""
    b = tl.program_id(0)
    ok = tl.full([], 1, tl.int32) != 0
    if MASKS:
        bound = later_bound(timeout_us, MASKS)
        for g in range(S.N):
            if (g != wh.host) & ok:
                ok = forward_host(g, fwd_ids, fwd_ntok, msk, wh, word, bound, err, S, RG, SHMEM,
                                  CARRY)
    else:
        pending = ((tl.full([], 1, tl.int64) << S.N) - 1) & ~(tl.full([], 1, tl.int64)
                                                             << wh.host)
        while (pending != 0) & ok:
            g = next_host(_at(wh.tab, wh.rank, wh.set_off + RG.RAIL_SIG, tl.int64), pending,
                          word, timeout_us, err, wh, stats, S, SHMEM, STATS)
            if g < 0:
                ok = g >= 0
            else:
                ok = forward_host(g, fwd_ids, fwd_ntok, msk, wh, word, timeout_us, err, S, RG,
                                  SHMEM, CARRY)
                pending = pending & ~(tl.full([], 1, tl.int64) << g)
    if ok:
        for q in tl.static_range(S.R):
            host_signal(wh.tab, wh.host * S.R + q,
                        wh.set_off + RG.HOST_SIG + (b * S.R + wh.local) * FLAG, word)
    return ok


@triton.jit
def _expand(recv_x, recv_scales, row_of, w_of, src_info, recv_count, ntok_out, msk, wh, S, RG,
            FP8: tl.constexpr, CARRY: tl.constexpr):
    """Stage 3 (module doc), spread over every (source, local expert) pair with rows: pair
    (s, e) starts at the rows of e from the sources before s (the forwarders' counts,
    ``d_host_cnt``), so the pairs need no order among them and every block takes a share. A
    source that is masked or whose forwarder here is masked (``msk``) counts as having sent
    nothing. ``CARRY``: each entry's weight into the handle (``w_of``) beside ``row_of``."""
    b = tl.program_id(0)
    ks = tl.arange(0, S.KP)
    km = ks < S.K
    ntp = _at(wh.tab, wh.rank, wh.set_off + RG.HOST_NTOK, tl.int32)
    cntp = _at(wh.tab, wh.rank, wh.set_off + RG.HOST_CNT, tl.int32)
    idp = _at(wh.tab, wh.rank, wh.set_off + RG.HOST_IDS, tl.int32)
    wp = _at(wh.tab, wh.rank, wh.set_off + RG.HOST_W, tl.float32)
    rows = _at(wh.tab, wh.rank, wh.set_off + RG.HOST_ROWS, tl.int32)
    rx = recv_x.to(tl.pointer_type(tl.int32))
    ROW_WORDS: tl.constexpr = S.ROW_BYTES // 4
    ws = tl.arange(0, S.WP)
    fed_w = (ws < S.W) & fed(msk, ws, wh, S)
    if b == 0:
        tl.store(ntok_out + ws, tl.where(fed_w, tl.load(ntp + ws, mask=ws < S.W), 0),
                 mask=ws < S.W)
        ls = tl.arange(0, S.LP)
        c = tl.load(cntp + ws[:, None] * S.L + ls[None, :],
                    mask=fed_w[:, None] & (ls < S.L)[None, :], other=0)
        tl.store(recv_count + ls, tl.sum(c, 0), mask=ls < S.L)
    # row_of of the entries whose expert is not here: -1 (the pairs write the rest)
    for s in range(S.W):
        for t in range(b, tl.where(fed(msk, s, wh, S), tl.load(ntp + s), 0), S.NB):
            ids = tl.load(idp + (s * S.T + t) * S.K + ks, mask=km, other=-1)
            here = (ids >= 0) & (ids // S.L == wh.rank)
            tl.store(row_of + (s * S.T + t) * S.K + ks, tl.full([S.KP], -1, tl.int32),
                     mask=km & ~here)
    cs = tl.arange(0, COPY_CHUNK)
    for p in range(b, S.W * S.L, S.NB):
        s = p // S.L
        e = p % S.L
        eg = wh.rank * S.L + e
        if tl.where(fed(msk, s, wh, S), tl.load(cntp + s * S.L + e), 0) > 0:
            pos = tl.sum(tl.load(cntp + ws * S.L + e, mask=fed_w & (ws < s), other=0), 0)
            ns = tl.load(ntp + s)
            for t0 in range(0, ns, EXPAND_TILE):
                ts = t0 + tl.arange(0, EXPAND_TILE)
                m2 = (ts < ns)[:, None] & km[None, :]
                ids = tl.load(idp + (s * S.T + ts[:, None]) * S.K + ks[None, :], mask=m2,
                              other=-1)
                hit = (ids == eg) & m2
                routed = tl.max(hit.to(tl.int32), 1)       # a token listing e twice: one row
                pre = pos + tl.cumsum(routed, 0) - routed
                go = routed != 0
                tl.store(src_info + e * S.W * S.T + pre, s * S.T + ts, mask=go)
                tl.store(row_of + (s * S.T + ts[:, None]) * S.K + ks[None, :],
                         (e * S.W * S.T + pre)[:, None] + tl.zeros([1, S.KP], tl.int32),
                         mask=hit)
                if CARRY:
                    at = (s * S.T + ts[:, None]) * S.K + ks[None, :]
                    tl.store(w_of + at, tl.load(wp + at, mask=hit), mask=hit)
                src = rows + (s * S.T + ts) * ROW_WORDS
                dst = rx + (e * S.W * S.T + pre) * S.RX_WORDS
                for w0 in range(0, S.RX_WORDS, COPY_CHUNK):
                    wm = go[:, None] & ((w0 + cs) < S.RX_WORDS)[None, :]
                    tl.store(dst[:, None] + w0 + cs[None, :],
                             tl.load(src[:, None] + w0 + cs[None, :], mask=wm), mask=wm)
                if FP8:
                    ns_ = tl.arange(0, S.SCALES_P2)
                    sm = go[:, None] & (ns_ < S.SCALES)[None, :]
                    sc = tl.load((src + S.RX_WORDS)[:, None] + ns_[None, :], mask=sm)
                    tl.store(recv_scales.to(tl.pointer_type(tl.int32))
                             + ((e * S.W * S.T + pre) * S.SCALES)[:, None] + ns_[None, :], sc,
                             mask=sm)
                pos += tl.sum(routed, 0)


@triton.jit
def _poison_counts(recv_count, ntok_out, S):
    """What a failed dispatch leaves: every count and token count poisoned (-1); block 0."""
    if tl.program_id(0) == 0:
        cs = tl.arange(0, 64)
        for i0 in range(0, S.L, 64):
            poison(recv_count, i0 + cs, i0 + cs < S.L)
        for i0 in range(0, S.W, 64):
            poison(ntok_out, i0 + cs, i0 + cs < S.W)


@triton.jit(do_not_specialize=EP_RANK_VARYING, repr=symbol("hosts_dispatch"))
def hosts_dispatch_kernel(
        x,              # [n_tok, H] this rank's tokens (buffer dtype, 16-byte aligned rows)
        topk,           # [n_tok, K] int64 global expert ids, -1 = none
        n_tok,          # tokens of this rank (<= T)
        recv_x,         # [L, W * T, H] output (FP8: its uint8 view)
        recv_scales,    # [L, W * T, SCALES] fp32 output (FP8; any pointer otherwise)
        row_of,         # [W, T, K] int32 handle: flat row e * W * T + row of (s, t, k), or -1
        src_info,       # [L, W * T] int32 handle: s * T + t of each row
        recv_count,     # [L] int32 output
        ntok_out,       # [W] int32 handle: tokens of each source rank
        fwd_ids,        # [N, T, K] int32 handle: ids of the tokens this rank forwarded
        fwd_ntok,       # [N] int32 handle: tokens of each rail source
        tab,            # [W] int64: region base of every rank (this host's; own for SHMEM)
        ctrl,           # [NB] int64: block counters
        err,            # int64: device error word, host error address, host input-error address
        rank, tag, timeout_us,
        ledger,         # [NB, N, 3] int64: messages, flags, bytes each block sent each host
        stats,          # [W] int64 wait statistics (STATS), or None
        SIZES: tl.constexpr,        # HostSizes
        REGIONS: tl.constexpr,      # HostDispatchRegions
        FP8: tl.constexpr,          # 0: buffer dtype; 1: e4m3 + scales; 2: pow2 scales
        STAGES: tl.constexpr,       # HD_* bits
        SHMEM: tl.constexpr,        # rail.PLAIN, NVSHMEM or ROCSHMEM: the messages' backend
        MASKS: tl.constexpr = 0,    # 1: rank masks (err[ERR_MASK]; masks.py)
        STATS: tl.constexpr = 0,    # 1: wait statistics into stats (masks.masked_wait)
        PDL: tl.constexpr = 0,
        wts=None,       # [n_tok, K] fp32 top-k weights the dispatch carries (CARRY)
        w_of=None,      # [W, T, K] fp32 handle: the weight of each entry row_of holds (CARRY)
        CARRY: tl.constexpr = 0):   # 1: the weights travel with the ids, for the combine
    after_previous_kernel(PDL)
    b = tl.program_id(0)
    timeout_us, broken = wait_bound(timeout_us, err)
    seq = tl.load(ctrl + b)
    word = ((seq + 1) << EPOCH_SHIFT) | tag
    wh = Where(tab, rank, rank // SIZES.R, rank % SIZES.R, (seq % 2) * REGIONS.SET_BYTES)
    if STAGE_SEND & STAGES:
        if MASKS:
            announce(wh, wh.set_off + REGIONS.HOST_ENTRY, word, SIZES)
        _send(x, topk, wts, n_tok, err, wh, word, ledger, SIZES, REGIONS, FP8, SHMEM, CARRY)
    msk = tl.full([], 0, tl.int64)     # masked ranks (MASKS only)
    if MASKS:
        msk = poll_read(err + ERR_MASK)
    if STAGE_FORWARD_OWN & STAGES:
        forward_own(topk, wts, n_tok, fwd_ids, fwd_ntok, msk, wh, SIZES, REGIONS, CARRY)
    ok = tl.full([], 1, tl.int32) != 0
    if STAGE_FORWARD_WAIT & STAGES:
        if MASKS:   # every host's id block first: the call's mask is agreed before rows move
            ok, msk = hosts_wait(_at(tab, rank, wh.set_off + REGIONS.RAIL_SIG, tl.int64), word,
                                 timeout_us, err, OP_DISPATCH, go=1, msk=msk, epoch=seq + 1,
                                 wh=wh, S=SIZES, MASKS=MASKS, AGREE=ERR_RAIL_VERDICT,
                                 stats=stats, STATS=STATS)
            ok_e, msk = entry_wait(_at(tab, rank, wh.set_off + REGIONS.HOST_ENTRY, tl.int64),
                                   word, timeout_us, err, OP_DISPATCH, go=ok, msk=msk,
                                   epoch=seq + 1, wh=wh, S=SIZES, AGREE=ERR_ENTRY_VERDICT,
                                   stats=stats, STATS=STATS)
            ok = ok & ok_e
            if ok:
                ids_arrived(_at(tab, rank, wh.set_off + REGIONS.RAIL_SIG, tl.int64), word, wh,
                            SIZES, SHMEM)
    if STAGE_FORWARD & STAGES:
        if ok:
            ok = _forward(fwd_ids, fwd_ntok, msk, wh, word, timeout_us, err, stats, SIZES,
                          REGIONS, SHMEM, MASKS, STATS, CARRY)
    if STAGE_EXPAND_WAIT & STAGES:
        ok2, msk = ranks_wait(_at(tab, rank, wh.set_off + REGIONS.HOST_SIG, tl.int64), word,
                              later_bound(timeout_us, MASKS), err, OP_DISPATCH, go=ok, msk=msk,
                              epoch=seq + 1, wh=wh, S=SIZES, MASKS=MASKS,
                              AGREE=ERR_HOST_VERDICT, stats=stats, STATS=STATS)
        ok = ok & ok2
    if STAGE_EXPAND & STAGES:
        if (ok != 0) & (broken == 0):
            _expand(recv_x, recv_scales, row_of, w_of, src_info, recv_count, ntok_out, msk, wh,
                    SIZES, REGIONS, FP8, CARRY)
        else:
            _poison_counts(recv_count, ntok_out, SIZES)
        tl.store(ctrl + b, seq + 1)

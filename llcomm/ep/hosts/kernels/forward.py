"""The forwarder of the two-level dispatch (``dispatch.py``, stage 2): every token of a rail
source moves on to the ranks of this host that hold its experts as soon as it is here.

A rank forwards the tokens of the N sources of its rail (source ``s = g * R + l`` on host g):

- its own (g = h) from its staging area, at once, in the send half: they wait for nothing;
- another host's once its id block (count and top-k ids, sent first, before any row) and then
  each row have arrived. Without rank masks the hosts are taken in the order their id blocks
  arrive (``next_host``), so a host whose id block is late holds back no other host's tokens
  (one taken up is seen through, its rows in order as they arrive, before the next); with
  masks every host's id block is waited for first (the call's mask must be agreed before rows
  move, ``masks.py``), then the hosts in order.

Inside a host's tokens a block walks its share (tokens ``b, b + NB, ...``, the order in which
the sender's block ``b`` put them) and forwards the longest prefix whose rows have arrived,
polling again for the rest (``forward_host``). Per token, its flag is the signal that came with
the row (no extra message: the put-with-signal carries it), and one SHMEM consistency step
covers each batch of flags seen together, not each token. The alternative, a counter per block
of tokens, would save no message (each row is a put of its own either way) and needs a signal
that adds instead of sets, whose count the receiver must know in advance (docs/multihost.md,
"Pipelining").
"""
import triton
import triton.language as tl

from ....runtime.kernels.sync import (EPOCH_SHIFT, STATUS_MISMATCH, STATUS_TIMEOUT,
                                      global_time_lanes, global_time_ns, poll_read, report_error)
from .. import layout as HL
from ...kernels.common import (BLOCK_WIDE, OP_DISPATCH, PHASE_ENTRY, SEEN_SHIFT, _at, _bit_or,
                               _masked)
from .rail import rail_arrived

#: Tokens per step of a source's expert count (a [COUNT_TILE, R L] tile of bits per step).
COUNT_TILE = tl.constexpr(32)
#: Words of an id block before the ids: the token count first.
ID_HEADER = tl.constexpr(HL.ID_HEADER_WORDS)
#: A poll's verdict, reduced block-wide in one maximum: a mismatch at SEEN_SHIFT, a lane index
#: (``NP - index``) at PICK_SHIFT, the elapsed ns below it.
PICK_SHIFT = tl.constexpr(52)
PICK_MASK = tl.constexpr(255)
ELAPSED_BITS = tl.constexpr((1 << 52) - 1)


@triton.jit
def ids_row(ptr, valid, S):
    """``[KP]`` int32 top-k ids at ``ptr`` (int32 or int64), out-of-range ids as -1."""
    ks = tl.arange(0, S.KP)
    ids = tl.load(ptr + ks, mask=(ks < S.K) & valid, other=-1)
    return tl.where((ids >= 0) & (ids < S.E), ids, -1).to(tl.int32)


@triton.jit
def _weights_row(base, at, S, CARRY: tl.constexpr):
    """``[KP]`` fp32 top-k weights at element ``at`` of ``base`` (a pointer read as fp32; None
    without ``CARRY``, which gives zeros)."""
    ks = tl.arange(0, S.KP)
    w = tl.zeros([S.KP], tl.float32)
    if CARRY:
        w = tl.load(base.to(tl.pointer_type(tl.float32)) + at + ks, mask=ks < S.K, other=0.0)
    return w


@triton.jit
def _forward_token(g, t, ids, w, src_off, fwd_ids, wh, S, RG, CARRY: tl.constexpr):
    """Token t of the rail source on host g: its ids into the handle (``fwd_ids``) and to every
    rank of this host (with ``CARRY`` its weights ``w`` too), its row (at byte ``src_off`` of
    this rank's heap) to those holding one of its experts. The row is loaded once, as one tile,
    and stored to each of them: a step per token, not per chunk and rank."""
    s = g * S.R + wh.local
    ks = tl.arange(0, S.KP)
    km = ks < S.K
    tl.store(fwd_ids + (g * S.T + t) * S.K + ks, ids, mask=km)
    dest = tl.where(ids >= 0, ids // S.L - wh.host * S.R, -1)   # local rank, or none
    ws = tl.arange(0, S.PUT_WP)
    wm = ws < S.PUT_BYTES // 4
    here = tl.max(((dest >= 0) & (dest < S.R)).to(tl.int32), 0)      # read only if needed
    row = tl.load(_at(wh.tab, wh.rank, src_off, tl.int32) + ws,
                  mask=ws < tl.where(here > 0, S.PUT_BYTES // 4, 0), other=0)
    for q in tl.static_range(S.R):
        qr = wh.host * S.R + q
        tl.store(_at(wh.tab, qr, wh.set_off + RG.HOST_IDS, tl.int32) + (s * S.T + t) * S.K + ks,
                 ids, mask=km)
        if tl.max((dest == q).to(tl.int32), 0) > 0:
            if CARRY:
                tl.store(_at(wh.tab, qr, wh.set_off + RG.HOST_W, tl.float32)
                         + (s * S.T + t) * S.K + ks, w, mask=km)
            tl.store(_at(wh.tab, qr, wh.set_off + RG.HOST_ROWS, tl.int32)
                     + (s * S.T + t) * (S.ROW_BYTES // 4) + ws, row, mask=wm)


@triton.jit
def _count(ids, ng, g, wh, S, RG):
    """Block ``g % NB``: how many of source ``s = g * R + l``'s ng tokens (top-k ids at
    ``ids``, int32 or int64, ``[ng, K]``) go to each expert of this host, a token that lists
    one twice counted once, into ``d_host_cnt[s]`` of the rank holding the expert: where the
    expand places s's rows needs only these counts (``dispatch._expand``)."""
    if tl.program_id(0) == g % S.NB:
        s = g * S.R + wh.local
        bins = tl.arange(0, S.EHP)
        first = wh.host * S.R * S.L            # this host's first expert
        cnt = tl.zeros([S.EHP], tl.int32)
        for t0 in range(0, ng, COUNT_TILE):
            ts = t0 + tl.arange(0, COUNT_TILE)
            tm = ts < ng
            # which of this host's experts each token lists: a token naming one twice sets
            # its bit once; then one block-wide sum per tile
            lists = tl.zeros([COUNT_TILE, S.EHP], tl.int32) != 0
            for k in tl.static_range(S.K):
                idk = tl.load(ids + ts * S.K + k, mask=tm, other=-1)
                e = tl.where((idk >= 0) & (idk < S.E), idk - first, -1).to(tl.int32)
                lists = lists | (e[:, None] == bins[None, :])
            cnt += tl.sum(lists.to(tl.int32), axis=0)
        for q in tl.static_range(S.R):
            tl.store(_at(wh.tab, wh.host * S.R + q, wh.set_off + RG.HOST_CNT, tl.int32)
                     + s * S.L + bins - q * S.L, cnt,
                     mask=(bins >= q * S.L) & (bins < (q + 1) * S.L))


@triton.jit
def announce_count(g, ng, fwd_ntok, wh, S, RG):
    """Block 0: the token count ng of source ``g * R + l`` into the handle (``fwd_ntok``) and
    to every rank of this host (``d_host_ntok``)."""
    if tl.program_id(0) == 0:
        tl.store(fwd_ntok + g, ng)
        for q in tl.static_range(S.R):
            tl.store(_at(wh.tab, wh.host * S.R + q, wh.set_off + RG.HOST_NTOK, tl.int32)
                     + g * S.R + wh.local, ng)


@triton.jit
def forward_own(topk, wts, n_tok, fwd_ids, fwd_ntok, msk, wh, S, RG, CARRY: tl.constexpr):
    """This rank's own tokens (module doc): from the staging area, nothing to wait for. None
    when this rank is masked (``msk``). ``CARRY``: their weights ``wts`` go along."""
    b = tl.program_id(0)
    ng = tl.where(_masked(msk, wh.rank), 0, n_tok)
    _count(topk, ng, wh.host, wh, S, RG)
    announce_count(wh.host, ng, fwd_ntok, wh, S, RG)
    for t in range(b, ng, S.NB):
        _forward_token(wh.host, t, ids_row(topk + t * S.K, True, S),
                       _weights_row(wts, t * S.K, S, CARRY),
                       wh.set_off + RG.STAGE + t * S.ROW_BYTES, fwd_ids, wh, S, RG, CARRY)


@triton.jit
def forward_host(g, fwd_ids, fwd_ntok, msk, wh, word, timeout_us, err, S, RG,
                 SHMEM: tl.constexpr, CARRY: tl.constexpr):
    """The tokens of the rail source on host g, after its id block has arrived: this block's
    share, each forwarded once its row's flag ``d_row_sig[g, t]`` holds ``word`` (module doc:
    the longest arrived prefix at a time). None for a masked source (``msk``). Returns 1, or 0
    after writing the error word (a mismatch, or a timeout naming host g as a rail wait
    does). ``CARRY``: the id block holds the tokens' weights after their ids."""
    b = tl.program_id(0)
    s = g * S.R + wh.local
    ids_at = _at(wh.tab, wh.rank, wh.set_off + RG.RAIL_IDS + g * RG.IDS_BYTES, tl.int32)
    ng = tl.where(_masked(msk, s), 0, tl.load(ids_at))
    _count(ids_at + ID_HEADER, ng, g, wh, S, RG)
    announce_count(g, ng, fwd_ntok, wh, S, RG)
    NP: tl.constexpr = S.TOK_P2
    lane = tl.arange(0, NP)
    ts = b + S.NB * lane
    ks = tl.arange(0, S.KP)
    ids = tl.load(ids_at + ID_HEADER + ts[:, None] * S.K + ks[None, :],
                  mask=(ts < ng)[:, None] & (ks < S.K)[None, :], other=-1)
    need = (ts < ng) & (tl.max(((ids >= 0) & (ids < S.E) & (ids // (S.L * S.R) == wh.host))
                               .to(tl.int32), 1) != 0)
    flags = _at(wh.tab, wh.rank, wh.set_off + RG.ROW_SIG, tl.int64) + g * S.T + ts
    n_lanes = tl.where(b < ng, (ng - b + S.NB - 1) // S.NB, 0)
    epoch = word >> EPOCH_SHIFT
    limit_ns = timeout_us.to(tl.int64) * 1000
    t0 = global_time_ns(BLOCK_WIDE)
    done = tl.full([], 0, tl.int32)
    status = tl.where(n_lanes > 0, 0, -1)
    while status == 0:
        pend = need & (lane >= done)
        got = poll_read(flags, pend, 0)
        waiting = pend & (got != word)
        wrong = waiting & ((got >> EPOCH_SHIFT) >= epoch)
        first = tl.min(tl.where(waiting, lane, NP), axis=0)      # lanes before it are here
        view = ((tl.max(wrong.to(tl.int64), axis=0) << SEEN_SHIFT)
                | ((NP - first).to(tl.int64) << PICK_SHIFT))
        # one verdict for the block: the least prefix any warp saw, with the clock
        both = tl.max(view | tl.maximum(global_time_lanes(BLOCK_WIDE) - t0, 0), axis=0)
        upto = tl.minimum(NP - ((both >> PICK_SHIFT) & PICK_MASK).to(tl.int32), n_lanes)
        if (both >> SEEN_SHIFT) != 0:
            status = STATUS_MISMATCH
        elif upto > done:
            batch = need & (lane >= done) & (lane < upto)
            tl.atomic_add(flags, tl.zeros([NP], tl.int64), mask=batch, sem="acquire",
                          scope="sys")
            last = tl.max(tl.where(batch, lane, -1), axis=0)
            if last >= 0:       # SHMEM's consistency step, once for the batch
                rail_arrived(_lane_ptr(flags, lane, last), word, SHMEM)
            for i in range(done, upto):
                t = b + S.NB * i
                _forward_token(g, t, ids_row(ids_at + ID_HEADER + t * S.K, True, S),
                               _weights_row(ids_at, ID_HEADER + (ng + t) * S.K, S, CARRY),
                               wh.set_off + RG.RAIL_ROWS + (g * S.T + t) * S.ROW_BYTES,
                               fwd_ids, wh, S, RG, CARRY)
            done = upto
            if done >= n_lanes:
                status = -1
        elif (both & ELAPSED_BITS) > limit_ns:
            status = STATUS_TIMEOUT
    ok = status == -1
    if not ok:
        report_error(err, status, OP_DISPATCH, PHASE_ENTRY, tl.full([], 1, tl.int64) << g)
    tl.debug_barrier()
    return ok


@triton.jit
def _lane_ptr(ptrs, lane, i):
    """The pointer of lane ``i`` of ``ptrs`` (one lane each), as a scalar."""
    return tl.sum(tl.where(lane == i, ptrs.to(tl.int64), 0), axis=0).to(tl.pointer_type(tl.int64))


@triton.jit
def next_host(flags, pending, word, timeout_us, err, wh, stats, S, SHMEM: tl.constexpr,
              STATS: tl.constexpr):
    """Without masks: a bounded wait until one of the hosts in the bit set ``pending`` has its
    id flag (``flags``: ``d_rail_sig``, ``[N]``) holding ``word``; returns the lowest such host
    after SHMEM's consistency step on its flag, or -1 after writing the error word (a
    mismatch, or a timeout naming the pending hosts' rail ranks, reported as the call's entry
    barrier as ``masks.hosts_wait`` does). Wait statistics (``STATS``): the ns from the wait's
    start to the poll that took the host up, at the host's rail rank."""
    NP: tl.constexpr = S.RAIL_FLAGS_P2
    lane = tl.arange(0, NP)
    live = (lane < S.N) & (((pending >> lane) & 1) != 0)
    epoch = word >> EPOCH_SHIFT
    limit_ns = timeout_us.to(tl.int64) * 1000
    t0 = global_time_ns(BLOCK_WIDE)
    status = tl.full([], 0, tl.int32)
    g = tl.full([], -1, tl.int32)
    both = tl.full([], 0, tl.int64)
    wrong = lane < 0
    while status == 0:
        got = poll_read(flags + lane, live, 0)
        here = live & (got == word)
        wrong = live & (got != word) & ((got >> EPOCH_SHIFT) >= epoch)
        pick = tl.max(tl.where(here, NP - lane, 0), axis=0)      # the lowest arrived host
        view = (tl.max(wrong.to(tl.int64), axis=0) << SEEN_SHIFT) | (pick.to(tl.int64)
                                                                     << PICK_SHIFT)
        both = tl.max(view | tl.maximum(global_time_lanes(BLOCK_WIDE) - t0, 0), axis=0)
        picked = ((both >> PICK_SHIFT) & PICK_MASK).to(tl.int32)
        if (both >> SEEN_SHIFT) != 0:
            status = STATUS_MISMATCH
        elif picked != 0:
            g = NP - picked
            status = -1
        elif (both & ELAPSED_BITS) > limit_ns:
            status = STATUS_TIMEOUT
    if STATS:
        late = tl.where(status == -1, lane == g, live)
        for h in tl.static_range(S.N):
            if tl.max((late & (lane == h)).to(tl.int32), axis=0) != 0:
                tl.atomic_add(stats + h * S.R + wh.local, both & ELAPSED_BITS, sem="relaxed",
                              scope="gpu")
    if status == -1:
        tl.atomic_add(flags + g, 0, sem="acquire", scope="sys")
        rail_arrived(flags + g, word, SHMEM)
    else:
        late = tl.where(status == STATUS_MISMATCH, wrong, live)
        bad = tl.reduce(tl.zeros([BLOCK_WIDE], tl.int64)
                        + tl.reduce(tl.where(late, tl.full([NP], 1, tl.int64) << lane, 0), 0,
                                    _bit_or), 0, _bit_or)
        report_error(err, status, OP_DISPATCH, PHASE_ENTRY, bad)
    tl.debug_barrier()
    return g

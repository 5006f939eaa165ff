"""What the EP kernels share: stage bits, addressing a rank's region, flag signals and bounded
waits, rank masks, profiling stamps, the token ownership rule and LL words.

A flag is one int64 word ``((op counter + 1) << EPOCH_SHIFT) | tag`` per (phase, block, source
rank) in every rank's signal region. A sender's block stores its rows, then (after a barrier)
writes its flag on every rank with a system-scope release; a receiver's block polls every flag
it needs with volatile loads, then makes one acquire pass over them before reading the data. On
AMD every poll is a system-scope acquire atomic instead (``sync.poll_read``: Triton's AMD
backend does not keep these loads volatile).
"""
from collections import namedtuple

import triton
import triton.language as tl

from ...runtime import protocol as P
from ...runtime.kernels.sync import (EPOCH_SHIFT, RANK_VARYING, global_time_lanes, global_time_ns,
                                     poison, poll_read, report_error, sm_cycles)
from .. import layout as EL

#: The sizes every EP kernel is compiled for (its ``SIZES`` constexpr; the host builds it:
#: ``peer.kernel_consts``): the buffer's max tokens per rank, hidden (H) and its pow2 (HP),
#: top-k (K) and pow2 (KP), experts (E), local experts per rank (L), ranks (W) and pow2 (WP),
#: blocks (NB), and the metadata and weights slot stride (layout.MAX_TOPK).
Sizes = namedtuple("Sizes", ["MAX_TOKENS", "H", "HP", "K", "KP", "E", "L", "W", "WP", "NB",
                             "MAX_TOPK"])
#: Where a call's data lives (runtime values): the table of every rank's EP region base address,
#: this rank, and the byte offset of the buffer set the call uses.
Region = namedtuple("Region", ["tab", "rank", "set_off"])

STATUS_TIMEOUT = tl.constexpr(P.STATUS_TIMEOUT)
STATUS_MISMATCH = tl.constexpr(P.STATUS_MISMATCH)
PHASE_ENTRY = tl.constexpr(P.PHASE_ENTRY)
PHASE_EXIT = tl.constexpr(P.PHASE_EXIT)
PHASE_DATA = tl.constexpr(P.PHASE_DATA)
OP_DISPATCH = tl.constexpr(P.OP_DISPATCH)
OP_COMBINE = tl.constexpr(P.OP_COMBINE)
#: Token counts differ between ranks too (see runtime/kernels/sync.RANK_VARYING).
EP_RANK_VARYING = RANK_VARYING + ["n_tok"]


def symbol(name: str):
    """``triton.jit``'s ``repr`` for an EP kernel: its symbol is the C++ name
    ``llcomm::ep::<name>()``, mangled (Itanium ABI), so profilers show it demangled under
    llcomm's namespace and tools written for DeepEP's kernels, which look for ``::dispatch`` and
    ``::combine`` in kernel names, find llcomm's (docs/deep_ep.md, "What differs")."""
    mangled = f"_ZN6llcomm2ep{len(name)}{name}Ev"
    return lambda specialization: mangled


# Stage bits (python ints for the host; the kernels test the same numbers). A launch runs the
# stages in its STAGES mask: everything, or for ``return_recv_hook=True`` a send half and a
# receive half in two launches.
D_SEND, D_RECV, D_SIGNAL, D_WAIT = 1, 2, 4, 8
DISPATCH_ALL = D_SEND | D_RECV | D_SIGNAL | D_WAIT
DISPATCH_SEND_HALF = D_SEND | D_SIGNAL          # push rows, counts, metadata; signal
DISPATCH_RECV_HALF = D_WAIT | D_RECV            # wait; expand; advance the counter
C_WEIGHTS, C_REDUCE, C_SUM, C_SYNC_W, C_SIGNAL_P, C_WAIT_P = 1, 2, 4, 8, 16, 32
COMBINE_ALL = C_WEIGHTS | C_REDUCE | C_SUM | C_SYNC_W | C_SIGNAL_P | C_WAIT_P
# weights, signal, wait for them, reduce and push partials, signal | wait for partials; sum
COMBINE_SEND_HALF = C_WEIGHTS | C_SYNC_W | C_REDUCE | C_SIGNAL_P
COMBINE_RECV_HALF = C_WAIT_P | C_SUM
# The same bits as the kernels test them (a kernel reads only tl.constexpr globals), written
# first in a test, ``STAGE_SEND & STAGES``: the interpreter passes STAGES as a Python int,
# which cannot take a constexpr on its right.
STAGE_SEND, STAGE_RECV = tl.constexpr(D_SEND), tl.constexpr(D_RECV)
STAGE_SIGNAL, STAGE_WAIT = tl.constexpr(D_SIGNAL), tl.constexpr(D_WAIT)
STAGE_WEIGHTS, STAGE_REDUCE = tl.constexpr(C_WEIGHTS), tl.constexpr(C_REDUCE)
STAGE_SUM, STAGE_SYNC_WEIGHTS = tl.constexpr(C_SUM), tl.constexpr(C_SYNC_W)
STAGE_SIGNAL_PARTIALS, STAGE_WAIT_PARTIALS = tl.constexpr(C_SIGNAL_P), tl.constexpr(C_WAIT_P)

# Flag phases of a set, and the metadata word ``(local expert << META_SHIFT) | prefix``.
SIG_DISPATCH = tl.constexpr(EL.PHASE_DISPATCH)
SIG_WEIGHTS = tl.constexpr(EL.PHASE_COMBINE_WEIGHTS)
SIG_PARTIALS = tl.constexpr(EL.PHASE_COMBINE_PARTIALS)
META_SHIFT = tl.constexpr(EL.META_SHIFT)
META_MASK = tl.constexpr((1 << EL.META_SHIFT) - 1)

#: A wait's verdicts and clock readings are reduced over this many lanes: at least every thread
#: of a block (32 warps at most), so the maximum goes through shared memory and the whole block
#: agrees; the wait's loop holds block-wide reductions, whose barriers must not be split. Also
#: the most flags a wait polls (one or more lanes per flag): layout.MAX_WAIT_FLAGS.
BLOCK_WIDE = tl.constexpr(EL.MAX_WAIT_FLAGS)
WAIT_SKIPPED = tl.constexpr(-2)         # _wait_flags status: not waited (an earlier wait failed)
# _wait_flags: what a lane saw in one poll, packed above the elapsed ns for one block maximum
SEEN_WAITING = tl.constexpr(1)          # a flag does not hold the word yet
SEEN_WRONG = tl.constexpr(2)            # a flag holds another op's word (mismatch)
SEEN_SHIFT = tl.constexpr(60)
ELAPSED_MASK = tl.constexpr((1 << 60) - 1)

# Rank masks (EPBuffer(enable_masks=True), MASKS = 1): words of the buffer's private ``err``
# tensor. Every wait skips the masked ranks' flags, and a wait that runs out adds the late
# ranks to the mask instead of writing the error word. Data stages skip masked sources.
ERR_MASK = tl.constexpr(EL.ERR_MASK)    # bit s: rank s is masked (set by the waits; set and
#                                         cleared by the host: llcomm/ep/masks.py)
ERR_VERDICT = tl.constexpr(4)           # dispatch: (epoch << 32) | the mask its blocks agreed on
VERDICT_SHIFT = tl.constexpr(32)
VERDICT_EPOCH = tl.constexpr(0x7FFFFFFF)    # epoch bits kept: consecutive calls differ
VERDICT_RANKS = tl.constexpr(0xFFFFFFFF)    # rank bits (masks need num_ranks <= 32)

# Profiling (PROFILE = 1, LLCOMM_EP_PROFILE=1; tools/ep_timeline.py reads them): block b keeps
# PROF_WORDS words of ``err`` from ERR_PROF + b * PROF_WORDS on: SM cycle stamps at the stage
# boundaries (slot i = after stage i, slot 0 = kernel start), and global-timer readings at start
# and end (slots PROF_GT0, PROF_GT1) to convert cycles to ns.
ERR_PROF = tl.constexpr(EL.ERR_PROF)
PROF_WORDS = tl.constexpr(EL.PROF_WORDS)
PROF_GT0 = tl.constexpr(EL.PROF_WORDS - 2)
PROF_GT1 = tl.constexpr(EL.PROF_WORDS - 1)
PROF_LAST = tl.constexpr(EL.PROF_WORDS - 3)     # the kernel's end

# LL words (the LL dispatch, dispatch_ll.py): ``(epoch << 32) | value``. A row word that has not
# arrived, and what a row word equal to it is sent as instead (both NaNs in every float format;
# e4m3 bytes 0xFF / 0x7F are NaN).
ROW_SENTINEL = tl.constexpr(-1)             # 0xFFFFFFFF, the armed state (layout.ARM_BYTE)
ROW_ESCAPE = tl.constexpr(0x7FFFFFFF)
LL_HI = tl.constexpr(32)                    # an LL word's epoch sits above bit 32
LL_LOW = tl.constexpr(0xFFFFFFFF)           # an LL word's value bits
NTOK_BITS = tl.constexpr(17)                # the ntok word: tag bits above the token count
NTOK_MASK = tl.constexpr((1 << 17) - 1)     # (at most MAX_TOKENS_LIMIT = 2**16 tokens)
NTOK_TAG_MASK = tl.constexpr((1 << 15) - 1)


#: A failed call's outputs (``_poison_received``, ``_poison_sum``) are filled in flat chunks of
#: this many elements per block and step (failure paths only).
POISON_CHUNK = tl.constexpr(1024)


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _at(tab, r, byte_off, DTYPE: tl.constexpr):
    """Pointer ``byte_off`` bytes into rank r's EP region, as DTYPE. Every region offset is a
    multiple of 256 and every base is 256-aligned, so the 16-byte claim holds."""
    base = tl.load(tab + r)
    return tl.multiple_of((base + byte_off).to(tl.pointer_type(DTYPE)), 16)


@triton.jit
def _signal(tab, word_idx, word, W: tl.constexpr, WP: tl.constexpr):
    """Store ``word`` at int64 index ``word_idx`` of every rank's EP region (release, system
    scope). Caller issues ``tl.debug_barrier()`` first so the whole block's stores precede it."""
    ps = tl.arange(0, WP)
    live = ps < W
    bases = tl.load(tab + ps, mask=live, other=0)
    ptrs = bases.to(tl.pointer_type(tl.int64)) + word_idx
    tl.atomic_xchg(ptrs, tl.full([WP], 0, tl.int64) + word, mask=live, sem="release", scope="sys")


@triton.jit
def _wait_flags(flags, word, timeout_us, err, op, phase, go,
                N: tl.constexpr, NP: tl.constexpr, W: tl.constexpr,
                skip, MASKS: tl.constexpr, stats=None,
                STATS: tl.constexpr = 0, STATS_STRIDE: tl.constexpr = 1):
    """Spin until the ``N`` int64 flags at ``flags`` (laid out ``[N // W][W]``, source rank
    fastest) all equal ``word``; bounded by ``timeout_us``. Polls with volatile loads (on AMD
    acquire atomics: ``poll_read``), then one acquire pass over the flags orders the reads that
    follow. Returns 1, or 0 after writing the error word (its mask names the source ranks that
    were late or disagreed).

    ``go == 0`` (an earlier wait of this op failed) skips the wait and returns 0. Every thread
    reaches the closing barrier either way; callers keep their barriers outside ``if ok`` all
    the same. Each poll's verdict (all arrived / a mismatch / still waiting) and the clock are
    reduced together over BLOCK_WIDE lanes, through shared memory, so the whole block agrees
    and leaves the loop (whose reductions hold barriers) at the same iteration.

    Rank masks: flags of the source ranks in the bit mask ``skip`` are not waited for (they
    count as arrived and are never a mismatch). With ``MASKS`` a timeout writes no error word:
    the wait returns ``(1, late)``, ``late`` the bit mask of the ranks that had not arrived, for
    the caller to mask. Otherwise it returns ``(ok, 0)``.

    Wait statistics (``STATS``, ``dispatch(wait_stats=...)``): adds to ``stats[s]`` (int64,
    one per source rank) the nanoseconds this block waited for source s's flags: from the
    wait's start to the poll that first saw the last of them (one read's latency when they were
    all there at once; 0 for ranks in ``skip``, never waited for, and when ``go == 0``). A wait
    that runs out counts the time until then. ``_add_wait_stats`` adds them; source s's entry is
    ``stats[s * STATS_STRIDE]`` (the two-level kernels number a level's sources apart from the
    ranks: ``hosts.kernels.masks.masked_wait``)."""
    # One lane per flag (NP of them), replicated across warps (each warp has its own view),
    # reduced first, then the block-wide maximum with the clock's BLOCK_WIDE lanes; where the
    # flags fill the block (NP = BLOCK_WIDE) the views go straight into that maximum. Polling
    # over all BLOCK_WIDE lanes instead measured about 2 us slower in the flag dispatch
    # (bench/results/ab/2026-11-30-ep-block-shape/).
    tl.static_assert(NP <= BLOCK_WIDE)
    lane = tl.arange(0, NP)
    i = lane % NP
    live = i < N
    ptrs = flags + i
    src = (i % W).to(tl.int64)
    epoch = word >> EPOCH_SHIFT
    limit_ns = timeout_us.to(tl.int64) * 1000   # i32 microseconds: see launch.py
    t0 = global_time_ns(BLOCK_WIDE)
    status = tl.where((tl.full([], 0, tl.int32) + go) != 0, 0, WAIT_SKIPPED)
    bad = tl.zeros([NP], tl.int64)
    skipped = ((skip >> src) & 1) != 0         # masks: ranks not waited for
    if STATS:   # per lane: elapsed ns of the poll that first saw its flag; not seen yet
        seen_at = tl.zeros([NP], tl.int64)
        was_waiting = live & (skipped == 0)
        last_ns = tl.full([], 0, tl.int64)     # elapsed ns of the latest poll
    while status == 0:
        got = poll_read(ptrs, live, 0)
        waiting = live & (got != word) & (skipped == 0)
        wrong = waiting & ((got >> EPOCH_SHIFT) >= epoch)
        # what each lane saw, above its elapsed ns: the block's maximum is SEEN_WRONG if any
        # lane saw another op's word, SEEN_WAITING if any lane still waits, else 0 (all
        # arrived), with the largest elapsed time below: one verdict for every warp
        seen = tl.where(wrong, SEEN_WRONG, tl.where(waiting, SEEN_WAITING, 0)).to(tl.int64)
        elapsed = tl.maximum(global_time_lanes(BLOCK_WIDE) - t0, 0)
        if NP == BLOCK_WIDE:
            both = tl.max((seen << SEEN_SHIFT) | elapsed, axis=0)
        else:
            both = tl.max((tl.max(seen, axis=0) << SEEN_SHIFT) | elapsed, axis=0)
        verdict = both >> SEEN_SHIFT
        if STATS:
            last_ns = both & ELAPSED_MASK
            seen_at = tl.where(was_waiting, last_ns, seen_at)
            was_waiting = waiting
        if verdict == SEEN_WRONG:
            status = STATUS_MISMATCH
            bad = wrong.to(tl.int64)
        elif verdict == 0:
            status = -1
        elif (both & ELAPSED_MASK) > limit_ns:
            status = STATUS_TIMEOUT
            bad = waiting.to(tl.int64)
    if STATS:   # a lane still waiting when the wait ended (timeout) waited until then
        _add_wait_stats(stats, tl.where(was_waiting & (status > 0), last_ns, seen_at), src, W,
                        STATS_STRIDE)
    # the source ranks that were late or disagreed, by any lane of any warp (shared memory:
    # uniform); only on failure, so success costs no extra round
    bad_ranks = tl.full([], 0, tl.int64)
    if status > 0:
        bad_ranks = tl.reduce(tl.zeros([BLOCK_WIDE], tl.int64)
                              + tl.reduce(bad << src, 0, _bit_or), 0, _bit_or)
    # masks: a timeout masks the late ranks instead of failing the call
    late = tl.full([], 0, tl.int64)
    if MASKS:
        if status == STATUS_TIMEOUT:
            late = bad_ranks
            status = -1
            skipped = skipped | (((late >> src) & 1) != 0)
    ok = status == -1
    if ok:      # one acquire per flag (its first lane)
        tl.atomic_add(ptrs, tl.zeros([NP], tl.int64),
                      mask=live & (lane < NP) & (skipped == 0), sem="acquire", scope="sys")
    elif status != WAIT_SKIPPED:
        report_error(err, status, op, phase, bad_ranks)
    tl.debug_barrier()
    return ok, late


@triton.jit
def _add_wait_stats(stats, ns, src, W: tl.constexpr, STRIDE: tl.constexpr = 1):
    """Wait statistics: ``stats[s * STRIDE] += max(ns[i] for lanes i of source s)`` for each
    source s of the W ranks (one relaxed atomic per source and block; the block's lanes agree
    through the maxima, so one thread adds for the block)."""
    for s in tl.static_range(W):
        t = tl.max(tl.where(src == s, ns, 0), axis=0)
        tl.atomic_add(stats + s * STRIDE, t, sem="relaxed", scope="gpu")


@triton.jit
def _add_stats_by_rank(stats, acc, WP: tl.constexpr, W: tl.constexpr):
    """Wait statistics: ``stats[s] += acc[s]`` for each of the W ranks (``acc``: ``[WP]``, one
    block's totals; one relaxed atomic per rank and block)."""
    ps = tl.arange(0, WP)
    for s in tl.static_range(W):
        tl.atomic_add(stats + s, tl.sum(tl.where(ps == s, acc, 0), axis=0), sem="relaxed",
                      scope="gpu")


@triton.jit
def _agree_mask(err, epoch, m, AT: tl.constexpr):
    """Masks, dispatch: the mask every block of this call uses. The first block to get here
    (after its wait) installs ``m`` with the call's epoch in ``err[AT]`` (``ERR_VERDICT``, or
    one word per agreement where a call agrees twice); every other block adopts it. Blocks must
    agree: the row of a token depends on the counts of every source before it, so one block
    skipping a source another one keeps would misplace rows."""
    key = (epoch & VERDICT_EPOCH) << VERDICT_SHIFT
    cur = tl.atomic_add(err + AT, tl.full([], 0, tl.int64), sem="relaxed", scope="gpu")
    while (cur >> VERDICT_SHIFT) != (key >> VERDICT_SHIFT):
        old = tl.atomic_cas(err + AT, cur, key | m, sem="relaxed", scope="gpu")
        cur = tl.where(old == cur, key | m, old)
    return cur & VERDICT_RANKS


@triton.jit
def _seq_at(ctrl, b, SEND: tl.constexpr, NB: tl.constexpr, IN_FLIGHT: tl.constexpr):
    """This launch's call count of its op, and where its receive stage advances it.

    ``IN_FLIGHT`` 1: one counter per block (``ctrl[b]``), read by every launch and advanced by
    the receive stage, so a send half and its receive half agree. ``IN_FLIGHT`` 2 (two send
    halves in flight): ``ctrl`` is ``[2, NB]``, a send counter and a receive counter; a launch
    with the send stage (``SEND``) reads the send counter and advances it (``_seq_sent``), any
    other reads the receive counter, which its receive stage advances. The host runs receive
    halves in the order of their send halves, so receive k reads the count send k read."""
    recv_ctr = ctrl + (IN_FLIGHT - 1) * NB + b
    if SEND:
        seq = tl.load(ctrl + b)
    else:
        seq = tl.load(recv_ctr)
    return seq, recv_ctr


@triton.jit
def _seq_sent(ctrl, b, seq, SEND: tl.constexpr, IN_FLIGHT: tl.constexpr):
    """``IN_FLIGHT`` 2: a launch with the send stage advances the send counter (``_seq_at``)."""
    if IN_FLIGHT > 1:
        if SEND:
            tl.store(ctrl + b, seq + 1)


@triton.jit
def _stamp(err, i: tl.constexpr, PROFILE: tl.constexpr, KIND: tl.constexpr, NB: tl.constexpr):
    """Profiling: this block's SM cycle count into its slot i (the global timer as well at the
    first and last slot); dispatch (KIND 0) and combine (KIND 1) have NB blocks of slots each.
    Nothing at all without PROFILE."""
    if PROFILE:
        base = err + ERR_PROF + (KIND * NB + tl.program_id(0)) * PROF_WORDS
        if i == 0:
            tl.store(base + PROF_GT0, global_time_ns())
        tl.store(base + i, sm_cycles())
        if i == PROF_LAST:
            tl.store(base + PROF_GT1, global_time_ns())


@triton.jit
def _masked(msk, s):
    """Rank s is in the bit mask ``msk`` (masks; 0 otherwise)."""
    return ((msk >> s) & 1) != 0


@triton.jit
def _first_token(b, s, NB: tl.constexpr, W: tl.constexpr):
    """The first token of source rank s that block b owns after the dispatch's send (expand,
    and every stage of combine): token t of source s belongs to block ``(t + s * (NB // W)) %
    NB``, so at small token counts the sources' tokens land on different blocks instead of all
    on block 0 (one token per rank: two chains of dependent loads in parallel, not in a row).
    Every stage of combine uses this one rule: block b of a receiver waits only for block b of
    the senders."""
    return (b + NB - (s * (NB // W)) % NB) % NB


@triton.jit
def _rank_bits(row, K: tl.constexpr, E: tl.constexpr, L: tl.constexpr):
    """Bit d set when one of the K expert ids at ``row`` lives on rank d (scalar loads: every
    thread computes the same mask, no reduction across threads)."""
    bits = tl.full([], 0, tl.int64)
    for k in tl.static_range(K):
        e = tl.load(row + k)
        bits = bits | tl.where((e >= 0) & (e < E), tl.full([], 1, tl.int64) << (e // L), 0)
    return bits


@triton.jit
def _first_entries(m, valid, earlier):
    """Entries of a pair's metadata words ``m`` that are valid and name their local expert for
    the first time (``earlier[k, i]``: entry i comes before entry k): one row per expert."""
    return valid & (tl.max(((m[:, None] == m[None, :]) & earlier).to(tl.int32), axis=1) == 0)


@triton.jit
def _ll_word(ehi, v):
    """LL word: the epoch bits ``ehi`` above the 32 bits of ``v`` (int32 or fp32)."""
    return ehi | v.to(tl.uint32, bitcast=True).to(tl.int64)


@triton.jit
def _row_words(v):
    """int32 row words as the LL dispatch sends them: ROW_SENTINEL goes as ROW_ESCAPE."""
    return tl.where(v == ROW_SENTINEL, ROW_ESCAPE, v)


@triton.jit
def _push_weights(wts, n_tok, reg, SIZES, OFFSET: tl.constexpr, ehi=0, LL: tl.constexpr = 0):
    """Combine stage A (or a dispatch with CARRY): this rank's top-k weights into slot
    (rank, t) of the weights region at byte ``reg.set_off + OFFSET`` of every rank (LL: as LL
    words with the epoch bits ``ehi``)."""
    b = tl.program_id(0)
    ks = tl.arange(0, SIZES.KP)
    kmask = ks < SIZES.K
    for t in range(_first_token(b, reg.rank, SIZES.NB, SIZES.W), n_tok, SIZES.NB):
        w = tl.load(wts + t * SIZES.K + ks, mask=kmask, other=0.0)
        for d in tl.static_range(SIZES.W):
            if LL:
                wp = (_at(reg.tab, d, reg.set_off + OFFSET, tl.int64)
                      + (reg.rank * SIZES.MAX_TOKENS + t) * SIZES.MAX_TOPK)
                tl.store(wp + ks, _ll_word(ehi, w), mask=kmask)
            else:
                wp = (_at(reg.tab, d, reg.set_off + OFFSET, tl.float32)
                      + (reg.rank * SIZES.MAX_TOKENS + t) * SIZES.MAX_TOPK)
                tl.store(wp + ks, w, mask=kmask)


@triton.jit
def _poison_flat(ptr, total, b, NB: tl.constexpr):
    """``poison`` block b's share of ``total`` elements at ``ptr``: chunks of POISON_CHUNK in
    turn over the blocks, so the blocks of a failed call fill a large output together."""
    lanes = tl.arange(0, POISON_CHUNK)
    for start in range(b * POISON_CHUNK, total, NB * POISON_CHUNK):
        offs = lanes.to(tl.int64) + start      # large outputs pass 2**31 elements
        poison(ptr, offs, offs < total)


@triton.jit
def _poison_received(out, SIZES, SCALES: tl.constexpr, FP8: tl.constexpr):
    """A dispatch block whose wait failed (or that started after this rank had failed) poisons
    instead of expanding: its share of ``recv_x`` (NaN rows; FP8: e4m3 0xFF bytes) and FP8
    ``recv_scales`` (NaN), and, in the block that writes ``recv_count`` (the last), a count of
    protocol.POISON_COUNT (-1) for every local expert, which no real count is. The handle's
    ``row_of`` / ``src_info`` / token counts are left as they are: a failed dispatch's handle
    serves no combine (that combine starts on a failed rank, so it poisons its own output)."""
    b = tl.program_id(0)
    _poison_flat(out.recv_x, SIZES.L * SIZES.W * SIZES.MAX_TOKENS * SIZES.H, b, SIZES.NB)
    if FP8:
        _poison_flat(out.recv_scales, SIZES.L * SIZES.W * SIZES.MAX_TOKENS * SCALES, b, SIZES.NB)
    if b == SIZES.NB - 1:
        ls = tl.arange(0, POISON_CHUNK)
        for l0 in range(0, SIZES.L, POISON_CHUNK):
            poison(out.recv_count, l0 + ls, l0 + ls < SIZES.L)


@triton.jit
def _poison_sum(out, n_tok, rank, SIZES):
    """A combine block whose wait failed (or that started after this rank had failed) poisons
    the rows of ``out`` it would have summed (its own tokens, ``_first_token``) with NaN."""
    b = tl.program_id(0)
    hs = tl.arange(0, SIZES.HP)
    for t in range(_first_token(b, rank, SIZES.NB, SIZES.W), n_tok, SIZES.NB):
        poison(out, t * SIZES.H + hs, hs < SIZES.H)

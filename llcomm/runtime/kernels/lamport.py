"""The Lamport protocol of ``lamport_all_reduce.lamport_kernel`` and
``fused_norm.lamport_norm_kernel``:
data that is its own flag, plus a tag word that says which call wrote it.

Every rank's Lamport region (``lam_tab[r]``: data, ``tag_tab[r]``: tags, after the data)::

    data  [2 halves][W source ranks][cap]   words of the int view; idle = SENTINEL
    tags  [2 halves][NB blocks][W sources]  int32; idle = 0

Op k, block b, on every rank: store this rank's tag (``protocol.lamport_tag``: the op code and a
hash of element count and dtype, never 0) into ``tags[k % 2][b][rank]`` of every rank, then the
data into ``data[k % 2][rank]`` of every rank (plain stores: a tag is its own flag, like a data
word, and the reader waits for both, so they need no order). Then, for each source p, poll
``tags[k % 2][b][p]`` in the same loop as p's first data words, compare the tag with this rank's
own, sum in rank order, and write the idle values (SENTINEL, 0) back. A tag that differs is a
mismatch (another op, size or dtype): reported with the source's bit, and its data is not waited
for. Every block of the fixed grid stores and takes its tags whether it has data or not, so each
tag written is consumed by the op that wrote it and a receiving block always gets one.

Why a reset word is not overwritten early: a peer writes ``tags[h][b][p]`` again two ops later,
and by then it has finished the op in between, which waited for this rank's part of that op,
pushed only after this rank's kernel (and its resets) ended. The data words' argument, with one
difference that makes it stronger: every block now waits for every peer.

``STAGES`` (PUSH | REDUCE) runs only the push or only the reduce half; only ``ALL_STAGES`` polls
(reads the GPU clock). A reduce half alone reads each source once and reports what a wait would
have: the CPU tests run virtual ranks in turn under ``TRITON_INTERPRET=1`` that way.
"""
import triton
import triton.language as tl

from .sync import RANK_VARYING, global_time_ns, poll_read, ptr_from_table, report_error
from .. import protocol as P

#: Not specialised on, besides RANK_VARYING: the tag is only compared, so specialising on its
#: divisibility by 16 would only compile a second kernel for one size in sixteen.
NO_SPECIALIZE = RANK_VARYING + ["tag"]

# Stage bits: python ints for the host and the tests, constexprs for the kernels, which test
# them constant first (``STAGE_PUSH & STAGES``): the interpreter cannot take int & constexpr.
PUSH, REDUCE = 1, 2
ALL_STAGES = PUSH | REDUCE
STAGE_PUSH = tl.constexpr(PUSH)
STAGE_REDUCE = tl.constexpr(REDUCE)
STAGE_ALL = tl.constexpr(ALL_STAGES)

PHASE_DATA = tl.constexpr(P.PHASE_DATA)
STATUS_TIMEOUT = tl.constexpr(P.STATUS_TIMEOUT)
STATUS_MISMATCH = tl.constexpr(P.STATUS_MISMATCH)
# _poll: what a lane saw, packed above the elapsed clock ticks so that ONE block-wide maximum
# (int32, as cheap as the sum it replaces) gives every warp the same verdict and deadline.
SEEN_WAITING = tl.constexpr(1)      # a data word is still SENTINEL, or the tag is not written
SEEN_WRONG = tl.constexpr(2)        # the tag is another call's (mismatch)
SEEN_SHIFT = tl.constexpr(29)
CLOCK_SHIFT = 12                    # elapsed ns >> 12: ticks of 4.096 us
TICK_SHIFT = tl.constexpr(CLOCK_SHIFT)
TICKS_MAX = (1 << 29) - 1           # saturation: 2199 s, above the longest timeout
TICKS_MASK = tl.constexpr(TICKS_MAX)
assert (P.MAX_TIMEOUT_MS * P.NS_PER_MS) >> CLOCK_SHIFT < TICKS_MAX
POLL_DONE = tl.constexpr(-1)        # _poll status: the tag matched and every word arrived
POLL_SKIPPED = tl.constexpr(-2)     # _poll status: not waited for (an earlier wait failed)


@triton.jit
def _clock(POLL: tl.constexpr):
    """This thread's reading of the global timer (ns), 0 where the kernel does not poll."""
    now = tl.full([], 0, tl.int64)
    if POLL:
        now = global_time_ns()
    return now


@triton.jit
def limit_ticks(timeout_us, POLL: tl.constexpr):
    """The wait bound in clock ticks; -1 where the kernel does not poll, so that a word or tag
    that has not arrived at the single read is reported as a timeout at once."""
    ticks = (timeout_us.to(tl.int64) * 1000) >> TICK_SHIFT   # i32 microseconds: see launch.py
    if not POLL:
        ticks = tl.full([], -1, tl.int64)
    return ticks


@triton.jit
def tag_slots(tag_tab, r, half, b, NB: tl.constexpr, W: tl.constexpr):
    """Pointer to ``tags[half][b][0]`` of rank r (int32; source p's tag is at ``+ p``)."""
    return ptr_from_table(tag_tab, r, tl.int32) + (half * NB + b) * W


@triton.jit
def receive_context(data_tab, tag_tab, rank, half, b, timeout_us, cap, DT: tl.constexpr,
                    NB: tl.constexpr, W: tl.constexpr, POLL: tl.constexpr):
    """What a block's receive half needs: this rank's half ``half`` of its data region (DT
    words; source p's slot at ``+ p * cap``), its tag words of (half, b), and the wait bound."""
    local = tl.multiple_of(ptr_from_table(data_tab, rank, DT), 16) + half * W * cap
    return local, tag_slots(tag_tab, rank, half, b, NB, W), limit_ticks(timeout_us, POLL)


@triton.jit
def push_tag(tag_tab, half, b, rank, tag, NB: tl.constexpr, W: tl.constexpr,
             WP: tl.constexpr):
    """Store this rank's ``tag`` into ``tags[half][b][rank]`` of every rank: one plain store
    per rank, issued before the data (the tag is its own flag)."""
    ps = tl.arange(0, WP)
    live = ps < W
    bases = tl.load(tag_tab + ps, mask=live, other=0)
    ptrs = bases.to(tl.pointer_type(tl.int32)) + (half * NB + b) * W + rank
    tl.store(ptrs, tl.full([WP], 0, tl.int32) + tag, mask=live)


@triton.jit
def _pending(v, m, SENTINEL: tl.constexpr, epoch, LL: tl.constexpr):
    """Lanes whose word has not arrived: Lamport, the word is SENTINEL; LL (``kernels/ll.py``),
    its high 32 bits are not this op's int32 ``epoch`` (lanes outside ``m`` never wait)."""
    if LL:
        pending = m & ((v >> 32).to(tl.int32) != epoch)
    else:
        pending = v == SENTINEL
    return pending


@triton.jit
def _read(ptrs, m, other, ACQUIRE: tl.constexpr):
    """One read of ``_poll``: a volatile load, or ``sync.poll_read`` with ``ACQUIRE``."""
    if ACQUIRE:
        return poll_read(ptrs, m, other)
    else:
        return tl.load(ptrs, mask=m, other=other, volatile=True)


@triton.jit
def _poll(src, m, tag_ptr, tag, check_tag, failed, limit, SENTINEL: tl.constexpr,
          POLL: tl.constexpr, epoch=0, LL: tl.constexpr = 0, ACQUIRE: tl.constexpr = 0):
    """Read the words at ``src`` (lanes ``m``) until every one has arrived (``_pending``) and,
    if ``check_tag``, the tag at ``tag_ptr`` is written; bounded by ``limit`` ticks. Returns
    (words, status): status POLL_DONE, STATUS_MISMATCH (the tag is not ``tag``: the words are
    not waited for), STATUS_TIMEOUT, or POLL_SKIPPED when ``failed`` (no wait at all).

    Each poll's decision comes from one block-wide maximum: the tag and the clock are per-thread
    readings, folded into every lane of the block's data, and the maximum spans every thread
    (every warp holds its own part of BLOCK in peer's launch shapes; the PTX ends the maximum
    in a full-warp ``redux.sync.max``, after ``st.shared`` / ``bar.sync`` / ``ld.shared`` across
    warps). So all warps leave the loop at the same iteration and agree on the status, as the
    barriers of the reduction inside the loop and of the code after it require.

    ``ACQUIRE``: read through ``sync.poll_read`` (on AMD acquire atomics): EP's LL dispatch,
    whose polled loads Triton's AMD backend does not keep volatile; TP's keep it."""
    v = _read(src, m, 0, ACQUIRE)
    got = _read(tag_ptr, check_tag, tag, ACQUIRE)
    t0 = _clock(POLL)
    now = t0
    status = tl.where(failed != 0, POLL_SKIPPED, 0)
    while status == 0:
        tag_seen = tl.where(got == 0, SEEN_WAITING, tl.where(got != tag, SEEN_WRONG, 0))
        seen = tl.maximum(tl.where(_pending(v, m, SENTINEL, epoch, LL), SEEN_WAITING, 0),
                          tag_seen)
        ticks = tl.minimum(tl.maximum(now - t0, 0) >> TICK_SHIFT, TICKS_MASK).to(tl.int32)
        both = tl.max((seen << SEEN_SHIFT) | ticks, axis=0)
        verdict = both >> SEEN_SHIFT
        if verdict == 0:
            status = POLL_DONE
        elif verdict == SEEN_WRONG:
            status = STATUS_MISMATCH
        elif (both & TICKS_MASK) > limit:
            status = STATUS_TIMEOUT
        else:
            v = _read(src, m, 0, ACQUIRE)
            got = _read(tag_ptr, check_tag, tag, ACQUIRE)
            now = _clock(POLL)
    return v, status


@triton.jit
def receive(local, cap, offs, m, tags, tag, check_tag, failed, limit, err, op, own, rank,
            SENTINEL: tl.constexpr, FT: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
            POLL: tl.constexpr):
    """The fp32 rank-order sum of the W sources' words at ``offs`` (lanes ``m``) of this rank's
    half ``local``, each peer's words re-armed with SENTINEL (and, if ``check_tag``: the
    block's first chunk or row, its tag ``tags[p]`` checked against ``tag`` and reset to 0).
    Returns (sum, failed): a wait that fails (a mismatched tag, or a timeout) writes the error
    word (``op``, data phase, the source's bit) and this block waits for nothing after it, so
    no rank waits for data that a mismatched call may never send. The sum is then meaningless
    and the host raises instead of returning it.

    This rank's own term is ``own`` (its operand's words, SENTINEL already replaced as the push
    replaces it), not its slot: the push skips that slot, so nothing is polled or re-armed
    there (its tag word is still reset). The same values in the same order as through the
    slot: the same bits, a third less local traffic
    (bench/results/ab/2026-11-30-lamport-own-term/)."""
    acc = tl.zeros([BLOCK], tl.float32)
    for p in tl.static_range(W):
        src = local + p * cap + offs
        if p == rank:                   # block-uniform; nothing was pushed to this slot
            acc += own.to(FT, bitcast=True).to(tl.float32)
        else:
            acc, failed = _take(acc, src, m, tags + p, tag, check_tag, failed, limit, err,
                                op, p, SENTINEL, FT, BLOCK, POLL)
        tl.store(tags + p, 0, mask=check_tag)                       # idle again
    return acc, failed


@triton.jit
def _take(acc, src, m, tag_ptr, tag, check_tag, failed, limit, err, op, p: tl.constexpr,
          SENTINEL: tl.constexpr, FT: tl.constexpr, BLOCK: tl.constexpr, POLL: tl.constexpr):
    """``acc`` plus source p's words at ``src`` (``_poll``); a failed wait reported; the words
    re-armed with SENTINEL."""
    v, status = _poll(src, m, tag_ptr, tag, check_tag, failed, limit, SENTINEL, POLL)
    if status > 0:  # STATUS_TIMEOUT or STATUS_MISMATCH; block-uniform
        report_error(err, status, op, PHASE_DATA, tl.full([], 1 << p, tl.int64))
        failed = 1
    acc += v.to(FT, bitcast=True).to(tl.float32)
    tl.store(src, tl.full([BLOCK], SENTINEL, v.dtype), mask=m)  # idle again
    return acc, failed


@triton.jit
def own_words(x, offs, m, SENTINEL: tl.constexpr):
    """This rank's operand words at ``offs`` as the push sends them (SENTINEL -> +0.0)."""
    v = tl.load(x + offs, mask=m)
    return tl.where(v == SENTINEL, 0, v)

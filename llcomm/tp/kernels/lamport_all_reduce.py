"""Lamport all-reduce kernel (sum): barrier-free one-shot, and the rounds it shares with the
Lamport reduce-scatter (``reduce_scatter.py``).

Each rank pushes its words into its slot of every peer's Lamport buffer, with a word equal to
SENTINEL sent as +0.0; the data is its own flag, so a receiver polls its slots until no word is
SENTINEL, sums in global rank order in fp32 (its own term read from its operand), and re-arms
the slots for a later round. The poll, tag and timeout helpers are shared with the fused join
(``llcomm/runtime/kernels/lamport.py``).
"""
import triton
import triton.language as tl

from ...runtime.kernels.lamport import NO_SPECIALIZE as LAMPORT_NO_SPECIALIZE
from ...runtime.kernels.lamport import (STAGE_ALL, STAGE_PUSH, STAGE_REDUCE, own_words, push_tag,
                                        receive, receive_context)
from ...runtime.kernels.sync import op_start, poison_chunks, ptr_from_table
from ...runtime import protocol as P

OP_LAMPORT = tl.constexpr(P.OP_LAMPORT)


@triton.jit(do_not_specialize=LAMPORT_NO_SPECIALIZE)
def lamport_kernel(x, out, n, lam_tab, tag_tab, ctrl, err, rank, tag, timeout_us,
                   cap,                     # elements per Lamport slot
                   SENTINEL: tl.constexpr,    # bit pattern of "not yet written" in the int view
                   FLOAT: tl.constexpr,       # the float dtype the int view holds
                   WORLD: tl.constexpr,       # ranks
                   WORLD_POW2: tl.constexpr,  # WORLD rounded up to a power of two
                   NUM_BLOCKS: tl.constexpr,  # the grid
                   BLOCK: tl.constexpr,       # elements per block and step
                   STAGES: tl.constexpr,      # PUSH | REDUCE; only ALL_STAGES polls
                   LAG: tl.constexpr = 0,     # > 0: pipelined (lamport_rounds)
                   PDL: tl.constexpr = 0):    # launched with PDL (sync.after_previous_kernel)
    """Barrier-free one-shot: the data is its own flag, a tag word says whose call wrote it.

    Every Lamport slot holds SENTINEL bits while idle (-0.0 for 16-bit floats), every tag word
    0. Each block stores its tag (``protocol.lamport_tag`` of OP_LAMPORT, n and the dtype) for
    every rank, then its operand (with SENTINEL replaced by +0.0 bits, which changes no sum
    since accumulation starts at +0.0) into slot ``rank`` of half ``seq % 2`` on every peer;
    then it polls its own half until every peer's tag is written and no element is SENTINEL,
    checks the tags against its own, sums in rank order (its own term from x), and writes
    SENTINEL and 0 back so the half is idle again. A tag that differs is reported as a
    mismatch, never summed (``runtime/kernels/lamport.py`` has the protocol). A fast peer's
    next op writes the other half; the op after that cannot start before this rank's next
    push, which comes after this kernel finished resetting. ``x`` and ``out`` are given as
    integer views (int16 or int32) of the float data.
    """
    lamport_rounds(x, out, n, lam_tab, tag_tab, ctrl, err, rank, tag, timeout_us, cap,
                   SENTINEL, FLOAT, WORLD, WORLD_POW2, NUM_BLOCKS, BLOCK, STAGES, LAG, 0,
                   OP_LAMPORT, PDL)


@triton.jit
def lamport_rounds(x, out, n, lam_tab, tag_tab, ctrl, err, rank, tag, timeout_us, cap,
                   SENTINEL: tl.constexpr, FLOAT: tl.constexpr, WORLD: tl.constexpr,
                   WORLD_POW2: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCK: tl.constexpr,
                   STAGES: tl.constexpr, LAG: tl.constexpr,
                   SCATTER: tl.constexpr,  # reduce_scatter: part q of x goes to rank q only
                   OP: tl.constexpr,       # the op its error words name
                   PDL: tl.constexpr):
    """One Lamport op of a block: push, then receive, chunk by chunk (``lamport_kernel`` has
    the protocol). Without SCATTER, x and out hold n elements; with it, x holds WORLD parts of n
    elements, part q is pushed to rank q only, and this rank sums part ``rank`` of every
    source into ``out`` (n elements).

    LAG > 0 (messages of several chunks per block): a block receives its chunk i-LAG right
    after pushing chunk i, so its local passes (poll, sum, re-arm) run while its later chunks
    and the other blocks' are still crossing, instead of after the whole push. No flag or fence
    is added: each word is still its own flag. Same words, same order per element: the same
    bits.

    A block whose wait failed (its sums are meaningless), or that started after this rank had
    failed (its slots may hold a failed round's words), poisons its part of ``out`` once its
    chunks are done (``poison_chunks``): outside the loops, only on failure.
    """
    b, timeout_us, seq, broken = op_start(ctrl, err, timeout_us, PDL)
    IT = x.dtype.element_ty
    half = seq % 2
    lanes = tl.arange(0, BLOCK)
    STEP: tl.constexpr = NUM_BLOCKS * BLOCK
    first = b * BLOCK
    if LAG > 0:         # several chunks per block: receive chunk i-LAG right after pushing i
        POLL_P: tl.constexpr = STAGE_ALL == STAGES
        if STAGE_PUSH & STAGES:
            push_tag(tag_tab, half, b, rank, tag, NUM_BLOCKS, WORLD, WORLD_POW2)
        local, tags, limit = receive_context(lam_tab, tag_tab, rank, half, b, timeout_us, cap,
                                             IT, NUM_BLOCKS, WORLD, POLL_P)
        failed = tl.zeros([], tl.int32)
        for start in range(first, tl.maximum(n, first + 1) + LAG * STEP, STEP):
            if STAGE_PUSH & STAGES:
                if start < n:
                    _push_chunk(x, lam_tab, start + lanes, n, half, rank, cap, SENTINEL, WORLD,
                                SCATTER)
            if STAGE_REDUCE & STAGES:
                back = start - LAG * STEP
                if back >= first:
                    failed = _receive_chunk(x, out, local, cap, back + lanes, n, tags, tag,
                                            back == first, failed, limit, err, rank, SENTINEL,
                                            FLOAT, WORLD, BLOCK, POLL_P, SCATTER, OP)
    else:
        if STAGE_PUSH & STAGES:
            push_tag(tag_tab, half, b, rank, tag, NUM_BLOCKS, WORLD, WORLD_POW2)
            for start in range(first, n, STEP):
                _push_chunk(x, lam_tab, start + lanes, n, half, rank, cap, SENTINEL, WORLD,
                            SCATTER)
        if STAGE_REDUCE & STAGES:
            POLL: tl.constexpr = STAGE_ALL == STAGES
            local, tags, limit = receive_context(lam_tab, tag_tab, rank, half, b, timeout_us,
                                                 cap, IT, NUM_BLOCKS, WORLD, POLL)
            # The first chunk's waits take the tags too: a block without data still runs that
            # chunk (all lanes masked) to take its tags, and the tags cost no poll of their own.
            failed = tl.zeros([], tl.int32)
            for start in range(first, tl.maximum(n, first + 1), STEP):
                failed = _receive_chunk(x, out, local, cap, start + lanes, n, tags, tag,
                                        start == first, failed, limit, err, rank, SENTINEL, FLOAT,
                                        WORLD, BLOCK, POLL, SCATTER, OP)
    if STAGE_REDUCE & STAGES:
        if (failed != 0) | broken:
            poison_chunks(out, n, b, NUM_BLOCKS, BLOCK)
        tl.store(ctrl + b, seq + 1)


@triton.jit
def _push_chunk(x, lam_tab, offs, n, half, rank, cap, SENTINEL: tl.constexpr, WORLD: tl.constexpr,
                SCATTER: tl.constexpr):
    """Lamport push of this rank's words at ``offs`` into slot ``rank`` of half ``half`` of
    every other rank (the own term is read from x by the receive), SENTINEL sent as +0.0.
    SCATTER: rank p gets part p of x, not all of it."""
    IT = x.dtype.element_ty
    m = offs < n
    if not SCATTER:
        v = tl.load(x + offs, mask=m)
        v = tl.where(v == SENTINEL, 0, v)
    for p in tl.static_range(WORLD):
        if SCATTER:
            mp = m & (offs * 0 + rank != p)    # the own part is read by the receive
            v = tl.load(x + p * n + offs, mask=mp)
            v = tl.where(v == SENTINEL, 0, v)
        dst = tl.multiple_of(ptr_from_table(lam_tab, p, IT), 16) + (half * WORLD + rank) * cap
        if p != rank:       # the own term is read from x (receive)
            tl.store(dst + offs, v, mask=m)


@triton.jit
def _receive_chunk(x, out, local, cap, offs, n, tags, tag, check_tag, failed, limit, err, rank,
                   SENTINEL: tl.constexpr, FLOAT: tl.constexpr, WORLD: tl.constexpr,
                   BLOCK: tl.constexpr, POLL: tl.constexpr, SCATTER: tl.constexpr,
                   OP: tl.constexpr):
    """Wait for, sum and re-arm the words at ``offs`` of every peer (``receive``), the own term
    from x; store the sum to ``out``; returns ``failed``. SCATTER: the own term is part
    ``rank``."""
    IT = x.dtype.element_ty
    m = offs < n
    own = own_words(x + rank * n * SCATTER, offs, m, SENTINEL)
    acc, failed = receive(local, cap, offs, m, tags, tag, check_tag, failed, limit, err,
                          OP, own.to(IT), rank, SENTINEL, FLOAT, WORLD, BLOCK, POLL)
    tl.store(out + offs, acc.to(FLOAT).to(IT, bitcast=True), mask=m)
    return failed

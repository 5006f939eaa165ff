"""All-reduce kernels (sum): push one-shot, two-shot, and the barrier-free Lamport one-shot.

Every kernel runs on a fixed grid of ``NB`` blocks (the communicator's constant), so block ``b``
of every kernel owns counter ``ctrl[b]`` = number of ops this communicator has run. That counter
lives on the GPU, which is what lets a captured CUDA graph replay any number of times and mix
with eager calls: the round (staging parity, flag epoch) is read on the device, never frozen into
the launch. Element ``i`` is handled by block ``(i // BLOCK) % NB`` on every rank, so block ``b``
only ever waits for block ``b`` of its peers.

Why two staging halves suffice (``parity = seq % 2``): every op makes each rank wait for every
peer. So when rank r starts op k, it has finished op k-1, which needed every peer to have
*started* op k-1, i.e. finished op k-2 (kernels on one stream run in order). Op k writes the half
that op k-2 used, which nobody reads any more. Write-after-write and read-after-write are both
covered without an exit barrier.

Accumulation is fp32 in global rank order (rank 0 first) in every algorithm, rounded once, so all
ranks and all algorithms produce the same bits for the same inputs, with one exception: Lamport
sends an input word equal to its SENTINEL as +0.0. For 16-bit floats the sentinel is -0.0 and
the sum starts at +0.0, so nothing changes; for float32 it is the subnormal -2**-134 (0x80008000),
which Lamport drops and the others add (Triton keeps fp32 subnormals in adds).
"""
import triton
import triton.language as tl

# PUSH, REDUCE, ALL_STAGES: lamport_kernel's stage bits, for the host and the tests
from ._lamport import ALL_STAGES, PUSH, REDUCE  # noqa: F401
from ._lamport import NO_SPECIALIZE as LAMPORT_NO_SPECIALIZE
from ._lamport import own_words, push_tag, receive, receive_context
from ._sync import (EPOCH_SHIFT, RANK_VARYING, op_start, ptr_from_table, push_to_slot,
                    signal_peers, wait_peers)
from .. import protocol as P

PHASE_ENTRY = tl.constexpr(P.PHASE_ENTRY)
PHASE_EXIT = tl.constexpr(P.PHASE_EXIT)
OP_ONE_SHOT = tl.constexpr(P.OP_ONE_SHOT)
OP_TWO_SHOT = tl.constexpr(P.OP_TWO_SHOT)
OP_LAMPORT = tl.constexpr(P.OP_LAMPORT)


@triton.jit(do_not_specialize=RANK_VARYING)
def one_shot_kernel(x, out, n, stage_tab, flag_tab, flags, ctrl, err, rank, tag, timeout_us,
                    cap,                    # elements per staging slot
                    W: tl.constexpr, WP: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = 0):
    """Each rank pushes its operand into slot ``rank`` of every rank's staging, one barrier,
    then sums its local slots in rank order. Remote traffic: (W-1) * n stores per rank."""
    b, timeout_us, seq = op_start(ctrl, err, timeout_us, PDL)
    DT = x.dtype.element_ty
    parity = seq % 2
    word = ((seq + 1) << EPOCH_SHIFT) | tag
    lanes = tl.arange(0, BLOCK)
    push_to_slot(x, stage_tab, n, b, parity, rank, rank, cap, W, NB, BLOCK)
    if b * BLOCK < n:
        tl.debug_barrier()
        signal_peers(flag_tab, b, word, rank, W, WP)
        if wait_peers(flags, b, word, timeout_us, err, OP_ONE_SHOT, PHASE_ENTRY, W, WP):
            local = tl.multiple_of(ptr_from_table(stage_tab, rank, DT), 16) + parity * W * cap
            for start in range(b * BLOCK, n, NB * BLOCK):
                offs = start + lanes
                m = offs < n
                acc = tl.zeros([BLOCK], tl.float32)
                for p in tl.static_range(W):
                    src = tl.where(p == rank, x + offs, local + p * cap + offs)
                    acc += tl.load(src, mask=m).to(tl.float32)
                tl.store(out + offs, acc.to(DT), mask=m)
    tl.store(ctrl + b, seq + 1)


@triton.jit(do_not_specialize=RANK_VARYING)
def two_shot_kernel(x, out, n, shard, stage_tab, gather_tab, flag_tab, flags, ctrl, err,
                    rank, tag, timeout_us,
                    cap,                    # elements per staging slot
                    W: tl.constexpr, WP: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = 0):
    """Reduce-scatter then all-gather, both by push. Rank s owns elements
    ``[s * shard, (s + 1) * shard)``. Phase 1: push shard s of x to rank s (slot ``rank``);
    barrier; sum own shard in rank order. Phase 2: push the reduced shard to every rank's gather
    region of every other rank (and to ``out``); second barrier; copy the other ranks' shards
    from the gather region to ``out``. Remote traffic: 2 (W-1)/W * n."""
    b, timeout_us, seq = op_start(ctrl, err, timeout_us, PDL)
    DT = x.dtype.element_ty
    parity = seq % 2
    word = ((seq + 1) << EPOCH_SHIFT) | tag
    lanes = tl.arange(0, BLOCK)
    for start in range(b * BLOCK, shard, NB * BLOCK):
        rel = start + lanes
        for s in tl.static_range(W):
            offs = s * shard + rel
            m = (rel < shard) & (offs < n)
            if s != rank:  # this rank's own shard is read from x below
                v = tl.load(x + offs, mask=m)
                dst = tl.multiple_of(ptr_from_table(stage_tab, s, DT), 16) + (parity * W + rank) * cap
                tl.store(dst + rel, v, mask=m)
    if b * BLOCK < shard:
        tl.debug_barrier()
        signal_peers(flag_tab, b, word, rank, W, WP)
        ok = wait_peers(flags, b, word, timeout_us, err, OP_TWO_SHOT, PHASE_ENTRY, W, WP)
        if ok:
            local = tl.multiple_of(ptr_from_table(stage_tab, rank, DT), 16) + parity * W * cap
            for start in range(b * BLOCK, shard, NB * BLOCK):
                rel = start + lanes
                offs = rank * shard + rel
                m = (rel < shard) & (offs < n)
                acc = tl.zeros([BLOCK], tl.float32)
                for p in tl.static_range(W):
                    src = tl.where(p == rank, x + offs, local + p * cap + rel)
                    acc += tl.load(src, mask=m).to(tl.float32)
                red = acc.to(DT)
                tl.store(out + offs, red, mask=m)
                for p in tl.static_range(W):
                    if p != rank:
                        dst = tl.multiple_of(ptr_from_table(gather_tab, p, DT), 16) + parity * cap
                        tl.store(dst + offs, red, mask=m)
            tl.debug_barrier()
            signal_peers(flag_tab, NB + b, word, rank, W, WP)
            ok = wait_peers(flags, NB + b, word, timeout_us, err, OP_TWO_SHOT, PHASE_EXIT, W, WP)
            if ok:
                gathered = tl.multiple_of(ptr_from_table(gather_tab, rank, DT), 16) + parity * cap
                for start in range(b * BLOCK, shard, NB * BLOCK):
                    rel = start + lanes
                    for s in tl.static_range(W):
                        offs = s * shard + rel
                        m = (rel < shard) & (offs < n) & (s != rank)
                        tl.store(out + offs, tl.load(gathered + offs, mask=m), mask=m)
    tl.store(ctrl + b, seq + 1)


@triton.jit(do_not_specialize=LAMPORT_NO_SPECIALIZE)
def lamport_kernel(x, out, n, lam_tab, tag_tab, ctrl, err, rank, tag, timeout_us,
                   cap,                     # elements per Lamport slot
                   SENTINEL: tl.constexpr,  # bit pattern of "not yet written" in the int view
                   FT: tl.constexpr,        # the float dtype the int view holds
                   W: tl.constexpr, WP: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
                   STAGES: tl.constexpr,    # PUSH | REDUCE; only ALL_STAGES polls
                   OWN_LOCAL: tl.constexpr = 0,     # own term from x, not its slot (receive)
                   LAG: tl.constexpr = 0,           # > 0: pipelined (below)
                   SCATTER: tl.constexpr = 0,       # reduce_scatter (below)
                   OP: tl.constexpr = OP_LAMPORT,  # the op its error words name
                   PDL: tl.constexpr = 0):  # launched with PDL (_sync.after_previous_kernel)
    """Barrier-free one-shot: the data is its own flag, a tag word says whose call wrote it.

    Every Lamport slot holds SENTINEL bits while idle (-0.0 for 16-bit floats), every tag word
    0. Each block stores its tag (``protocol.lamport_tag`` of OP, n and the dtype) for every
    rank, then its operand (with SENTINEL replaced by +0.0 bits, which changes no sum since
    accumulation starts at +0.0) into slot ``rank`` of half ``seq % 2`` on every rank; then it
    polls its own half until every source's tag is written and no element is SENTINEL, checks
    the tags against its own, sums in rank order, and writes SENTINEL and 0 back so the half is
    idle again. A tag that differs is reported as a mismatch, never summed (``_lamport.py`` has
    the protocol). A fast peer's next op writes the other half; the op after that cannot start
    before this rank's next push, which comes after this kernel finished resetting.
    ``x`` and ``out`` are given as integer views (int16 or int32) of the float data.

    LAG > 0 (messages of several chunks per block): a block receives its chunk i-LAG right
    after pushing chunk i, so its local passes (poll, sum, re-arm) run while its later chunks
    and the other blocks' are still crossing, instead of after the whole push. No flag or fence
    is added: each word is still its own flag. Same words, same order per element: the same
    bits.

    SCATTER (reduce_scatter): x holds W parts of n elements; part q goes to rank q only, and
    this rank sums part ``rank`` of every source into ``out`` (n elements).
    """
    b, timeout_us, seq = op_start(ctrl, err, timeout_us, PDL)
    IT = x.dtype.element_ty
    half = seq % 2
    lanes = tl.arange(0, BLOCK)
    STEP: tl.constexpr = NB * BLOCK
    first = b * BLOCK
    if LAG > 0:         # several chunks per block: receive chunk i-LAG right after pushing i
        POLL_P: tl.constexpr = STAGES == 3  # ALL_STAGES
        if STAGES & 1:
            push_tag(tag_tab, half, b, rank, tag, NB, W, WP)
        local, tags, limit = receive_context(lam_tab, tag_tab, rank, half, b, timeout_us, cap,
                                             IT, NB, W, POLL_P)
        failed = tl.zeros([], tl.int32)
        for start in range(first, tl.maximum(n, first + 1) + LAG * STEP, STEP):
            if STAGES & 1:
                if start < n:
                    _push_chunk(x, lam_tab, start + lanes, n, half, rank, cap, SENTINEL, W,
                                OWN_LOCAL, SCATTER)
            if STAGES & 2:
                back = start - LAG * STEP
                if back >= first:
                    failed = _receive_chunk(x, out, local, cap, back + lanes, n, tags, tag,
                                            back == first, failed, limit, err, rank, SENTINEL,
                                            FT, W, BLOCK, POLL_P, OWN_LOCAL, SCATTER, OP)
    else:
        if STAGES & 1:      # PUSH (literal bits: the interpreter runs them too)
            push_tag(tag_tab, half, b, rank, tag, NB, W, WP)
            for start in range(first, n, STEP):
                _push_chunk(x, lam_tab, start + lanes, n, half, rank, cap, SENTINEL, W,
                            OWN_LOCAL, SCATTER)
        if STAGES & 2:      # REDUCE
            POLL: tl.constexpr = STAGES == 3    # ALL_STAGES
            local, tags, limit = receive_context(lam_tab, tag_tab, rank, half, b, timeout_us,
                                                 cap, IT, NB, W, POLL)
            # The first chunk's waits take the tags too: a block without data still runs that
            # chunk (all lanes masked) to take its tags, and the tags cost no poll of their own.
            failed = tl.zeros([], tl.int32)
            for start in range(first, tl.maximum(n, first + 1), STEP):
                failed = _receive_chunk(x, out, local, cap, start + lanes, n, tags, tag,
                                        start == first, failed, limit, err, rank, SENTINEL, FT,
                                        W, BLOCK, POLL, OWN_LOCAL, SCATTER, OP)
    if STAGES & 2:
        tl.store(ctrl + b, seq + 1)


@triton.jit
def _push_chunk(x, lam_tab, offs, n, half, rank, cap, SENTINEL: tl.constexpr, W: tl.constexpr,
                OWN_LOCAL: tl.constexpr, SCATTER: tl.constexpr):
    """Lamport push of this rank's words at ``offs`` into slot ``rank`` of half ``half`` of
    every rank (its own slot skipped under OWN_LOCAL), SENTINEL sent as +0.0. SCATTER: rank p
    gets part p of x, not all of it."""
    IT = x.dtype.element_ty
    m = offs < n
    if not SCATTER:
        v = tl.load(x + offs, mask=m)
        v = tl.where(v == SENTINEL, 0, v)
    for p in tl.static_range(W):
        if SCATTER:
            mp = m
            if OWN_LOCAL:
                mp = m & (offs * 0 + rank != p)    # the own part is read by the receive
            v = tl.load(x + p * n + offs, mask=mp)
            v = tl.where(v == SENTINEL, 0, v)
        dst = tl.multiple_of(ptr_from_table(lam_tab, p, IT), 16) + (half * W + rank) * cap
        if OWN_LOCAL:
            if p != rank:       # the own term is read from x (receive)
                tl.store(dst + offs, v, mask=m)
        else:
            tl.store(dst + offs, v, mask=m)


@triton.jit
def _receive_chunk(x, out, local, cap, offs, n, tags, tag, check_tag, failed, limit, err, rank,
                   SENTINEL: tl.constexpr, FT: tl.constexpr, W: tl.constexpr,
                   BLOCK: tl.constexpr, POLL: tl.constexpr, OWN_LOCAL: tl.constexpr,
                   SCATTER: tl.constexpr, OP: tl.constexpr):
    """Wait for, sum and re-arm the words at ``offs`` of every source (``_lamport.receive``),
    store the sum to ``out``; returns ``failed``. SCATTER: the own term is part ``rank``."""
    IT = x.dtype.element_ty
    m = offs < n
    own = offs * 0      # (unused unless OWN_LOCAL)
    if OWN_LOCAL:
        own = own_words(x + rank * n * SCATTER, offs, m, SENTINEL)
    acc, failed = receive(local, cap, offs, m, tags, tag, check_tag, failed, limit, err,
                          OP, own.to(IT), rank, SENTINEL, FT, W, BLOCK, POLL, OWN_LOCAL)
    tl.store(out + offs, acc.to(FT).to(IT, bitcast=True), mask=m)
    return failed

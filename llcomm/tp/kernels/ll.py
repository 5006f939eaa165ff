"""LL broadcast and all-gather: every data word travels with its op's epoch, no barrier.

The flagged movement kernels (``movement.py``) push, then release a flag (a system-scope fence
that waits for the stores to land), then wait for the peers' flags. Here each 4-byte data word
is stored as one 8-byte word ``(epoch << 32) | data`` (``epoch`` = the block's op counter + 1,
low 32 bits), so a reader knows a word has arrived when its high half is this op's epoch: the
data is its own flag, no fence, no sentinel to reset (an older op's words hold an older epoch),
and any bit pattern passes through, NaN payloads included. It costs twice the bytes, which is
why it is for small messages.

Layout (``ll_tab[r]``): ``words [2 halves][WORLD sources][cap]`` int64, half ``seq % 2``. Tags:
the Lamport tag words (``runtime/kernels/lamport.py``: ``tags[half][block][source]``, idle 0),
written and consumed exactly as the Lamport all-reduce does, by every rank for every rank
whether it sends data or not; so a rank that calls a different op, size, dtype or broadcast root in
the same round (LL, Lamport or fused Lamport) is reported as a mismatch on every rank, and every
rank waits for every other rank's tag in every op. That wait is what makes the two halves enough: a
rank writes half h again two ops later, after it received every peer's tag of the op in between,
which each peer pushed only after its kernel for this op had read its words.

``STAGES`` (PUSH | REDUCE from ``runtime/kernels/lamport.py``) runs only the push or only the
receive half; the receive half alone reads each source once (the CPU tests run virtual ranks in
turn that way).
"""
import triton
import triton.language as tl

from ...runtime.kernels.lamport import (NO_SPECIALIZE, PHASE_DATA, STAGE_ALL, STAGE_PUSH,
                                        STAGE_REDUCE, _poll, push_tag, receive_context)
from ...runtime.kernels.sync import op_start, poison, ptr_from_table, report_error


@triton.jit
def _push_words(x, offs, m, ll_tab, half, rank, word_hi, skip, cap, WORLD: tl.constexpr):
    """This rank's words at ``offs`` into slot ``rank`` of half ``half`` of every rank but
    ``skip``, each as ``word_hi | data``."""
    v = tl.load(x + offs, mask=m)
    w = word_hi | v.to(tl.uint32, bitcast=True).to(tl.int64)    # zero-extended data word
    for p in tl.static_range(WORLD):
        if p != skip:
            dst = (tl.multiple_of(ptr_from_table(ll_tab, p, tl.int64), 16)
                   + (half * WORLD + rank) * cap)
            tl.store(dst + offs, w, mask=m)


@triton.jit(do_not_specialize=NO_SPECIALIZE + ["src", "part"])
def ll_gather_kernel(x, out, n, part, src, ll_tab, tag_tab, ctrl, err, rank, tag, timeout_us,
                     cap,                   # words per LL slot
                     op: tl.constexpr,          # protocol op code (errors)
                     BCAST: tl.constexpr,       # 1: broadcast from ``src`` into x; 0: all-gather
                     WORLD: tl.constexpr,       # ranks
                     WORLD_POW2: tl.constexpr,  # WORLD rounded up to a power of two
                     NUM_BLOCKS: tl.constexpr,  # the grid
                     BLOCK: tl.constexpr,       # elements per block and step
                     STAGES: tl.constexpr, PDL: tl.constexpr = 0):
    """All-gather (``BCAST`` 0): x is ``[n // part, part]`` int32 words and word ``i`` of rank p
    lands at ``out[(i // part) * WORLD * part + p * part + i % part]``. Broadcast (``BCAST`` 1):
    ``src``'s ``n`` words of x land in x on every rank. See the module doc for the protocol.
    A block whose wait failed, or that started after this rank had failed, fills what it
    would have stored with POISON_BITS (``_poison_words``; broadcast: not on ``src``)."""
    b, timeout_us, seq, broken = op_start(ctrl, err, timeout_us, PDL)
    half = seq % 2
    epoch = (seq + 1).to(tl.int32)              # low 32 bits
    lanes = tl.arange(0, BLOCK)
    if STAGE_PUSH & STAGES:
        push_tag(tag_tab, half, b, rank, tag, NUM_BLOCKS, WORLD, WORLD_POW2)
        sends = rank >= 0                           # all-gather: every rank
        if BCAST:
            sends = rank == src
        if sends:
            word_hi = epoch.to(tl.int64) << 32
            for start in range(b * BLOCK, n, NUM_BLOCKS * BLOCK):
                offs = start + lanes
                _push_words(x, offs, offs < n, ll_tab, half, rank, word_hi, rank, cap, WORLD)
    if STAGE_REDUCE & STAGES:     # receive
        POLL: tl.constexpr = STAGE_ALL == STAGES
        local, tags, limit = receive_context(ll_tab, tag_tab, rank, half, b, timeout_us, cap,
                                             tl.int64, NUM_BLOCKS, WORLD, POLL)
        failed = tl.zeros([], tl.int32)
        # The first chunk's waits take every source's tag; a block without data still runs it
        # (all lanes masked) so each tag is consumed by the op that wrote it.
        for start in range(b * BLOCK, tl.maximum(n, b * BLOCK + 1), NUM_BLOCKS * BLOCK):
            offs = start + lanes
            m = offs < n
            first = start == b * BLOCK
            row = offs // part
            col = offs - row * part
            r_lanes = offs * 0 + rank          # lane-shaped, so masks stay [BLOCK] booleans
            for p in tl.static_range(WORLD):
                if BCAST:
                    wants = (r_lanes != src) & (r_lanes * 0 + p == src)
                else:
                    wants = r_lanes != p
                v, status = _poll(local + p * cap + offs, m & wants, tags + p, tag, first,
                                  failed, limit, 0, POLL, epoch, 1)
                if status > 0:  # STATUS_TIMEOUT or STATUS_MISMATCH; block-uniform
                    report_error(err, status, op, PHASE_DATA, tl.full([], 1 << p, tl.int64))
                    failed = 1
                data = v.to(tl.int32)                       # the low 32 bits
                fine = m & ((offs * 0 + failed) == 0)       # nothing is stored after a failure
                if BCAST:
                    tl.store(x + offs, data, mask=fine & wants)
                else:
                    if p == rank:
                        data = tl.load(x + offs, mask=m)
                    dst = out + row * (WORLD * part) + p * part + col
                    tl.store(dst, data, mask=fine)
                tl.store(tags + p, 0, mask=first)           # idle again
        if (failed != 0) | broken:
            _poison_words(x, out, n, part, src, rank, b, WORLD, NUM_BLOCKS, BLOCK, BCAST)
        tl.store(ctrl + b, seq + 1)


@triton.jit
def _poison_words(x, out, n, part, src, rank, b, WORLD: tl.constexpr, NUM_BLOCKS: tl.constexpr,
                  BLOCK: tl.constexpr, BCAST: tl.constexpr):
    """Block b's words of the receive's output poisoned (only on failure): broadcast, its
    chunks of x on every rank but ``src``; all-gather, its chunks of every rank's part."""
    lanes = tl.arange(0, BLOCK)
    for start in range(b * BLOCK, n, NUM_BLOCKS * BLOCK):
        offs = start + lanes
        m = offs < n
        if BCAST:
            poison(x, offs, m & ((offs * 0 + rank) != src))
        else:
            row = offs // part
            col = offs - row * part
            for p in tl.static_range(WORLD):
                poison(out, row * (WORLD * part) + p * part + col, m)

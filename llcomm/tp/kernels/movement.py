"""Broadcast and all-gather (contiguous and strided 2-D) kernels (reduce-scatter is in
``reduce_scatter.py``).

Same scheme as ``all_reduce.py`` (fixed grid of NB blocks, per-block op counter on the device,
staging half ``seq % 2``, one barrier): data is pushed with remote stores into the staging of the
ranks that need it, then each rank reads only its own staging. The movement kernels copy raw
words (int32 or uint8 views), so they are byte-exact by construction. A block whose wait
failed, or that started after this rank had failed, fills what it would have copied with
POISON_BITS (every byte 0xFF) instead.
"""
import triton
import triton.language as tl

from ...runtime.kernels.sync import (EPOCH_SHIFT, RANK_VARYING, op_start, poison,
                                     poison_chunks, ptr_from_table, push_to_slot, signal_peers,
                                     wait_peers)
from ...runtime import protocol as P

PHASE_ENTRY = tl.constexpr(P.PHASE_ENTRY)
OP_BROADCAST = tl.constexpr(P.OP_BROADCAST)
OP_ALL_GATHER = tl.constexpr(P.OP_ALL_GATHER)


@triton.jit(do_not_specialize=RANK_VARYING)
def broadcast_kernel(x, n, src, stage_tab, flag_tab, flags, ctrl, err, rank, tag, timeout_us,
                     cap,                   # words per staging slot
                     W: tl.constexpr, WP: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = 0):
    """``src`` pushes x into slot 0 of every other rank's staging; one barrier (``src`` also
    waits, so it never runs two ops ahead); the others copy slot 0 into x."""
    b, timeout_us, seq, broken = op_start(ctrl, err, timeout_us, PDL)
    DT = x.dtype.element_ty
    half = seq % 2
    word = ((seq + 1) << EPOCH_SHIFT) | tag
    lanes = tl.arange(0, BLOCK)
    if rank == src:
        push_to_slot(x, stage_tab, n, b, half, src, 0, cap, W, NB, BLOCK)
    if b * BLOCK < n:
        tl.debug_barrier()
        signal_peers(flag_tab, b, word, rank, W, WP)
        ok = wait_peers(flags, b, word, timeout_us, err, OP_BROADCAST, PHASE_ENTRY, W, WP)
        if ok & (rank != src):
            local = tl.multiple_of(ptr_from_table(stage_tab, rank, DT), 16) + half * W * cap
            for start in range(b * BLOCK, n, NB * BLOCK):
                offs = start + lanes
                m = offs < n
                tl.store(x + offs, tl.load(local + offs, mask=m), mask=m)
        if ((ok == 0) | broken) & (rank != src):   # src's x is its own operand: left alone
            poison_chunks(x, n, b, NB, BLOCK)
    tl.store(ctrl + b, seq + 1)


@triton.jit(do_not_specialize=RANK_VARYING)
def all_gather_kernel(x, out, n, part, stage_tab, flag_tab, flags, ctrl, err, rank, tag,
                      timeout_us,
                      cap,                  # words per staging slot
                      W: tl.constexpr, WP: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr = 0):
    """Every rank pushes its ``n`` words into slot ``rank`` of every rank's staging; one
    barrier; each rank copies slot p to ``out``. x is ``[n // part, part]`` and word ``i`` of
    rank p lands at ``(i // part) * W * part + p * part + i % part`` (``part == n`` gives the
    contiguous rank-major all-gather; ``part < n`` the token-major 2-D form)."""
    b, timeout_us, seq, broken = op_start(ctrl, err, timeout_us, PDL)
    DT = x.dtype.element_ty
    half = seq % 2
    word = ((seq + 1) << EPOCH_SHIFT) | tag
    lanes = tl.arange(0, BLOCK)
    push_to_slot(x, stage_tab, n, b, half, rank, rank, cap, W, NB, BLOCK)
    if b * BLOCK < n:
        tl.debug_barrier()
        signal_peers(flag_tab, b, word, rank, W, WP)
        ok = wait_peers(flags, b, word, timeout_us, err, OP_ALL_GATHER, PHASE_ENTRY, W, WP)
        if ok:
            local = tl.multiple_of(ptr_from_table(stage_tab, rank, DT), 16) + half * W * cap
            for start in range(b * BLOCK, n, NB * BLOCK):
                offs = start + lanes
                m = offs < n
                row = offs // part
                col = offs - row * part
                for p in tl.static_range(W):
                    v = tl.load(tl.where(p == rank, x + offs, local + p * cap + offs), mask=m)
                    tl.store(out + row * (W * part) + p * part + col, v, mask=m)
        if (ok == 0) | broken:
            for start in range(b * BLOCK, n, NB * BLOCK):
                offs = start + lanes
                row = offs // part
                col = offs - row * part
                for p in tl.static_range(W):
                    poison(out, row * (W * part) + p * part + col, offs < n)
    tl.store(ctrl + b, seq + 1)

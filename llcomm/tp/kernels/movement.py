"""Broadcast and all-gather (contiguous and strided 2-D) kernels, flagged (reduce-scatter is in
``reduce_scatter.py``, the LL forms of these two in ``ll.py``).

Both follow the flag kernels' round (``flag_round.py``), stage by stage:

- ``broadcast_kernel``: ``src`` pushes x into slot 0 of every peer's staging; one barrier
  (``src`` waits too); the others copy slot 0 into x.
- ``all_gather_kernel``: every rank pushes x into slot ``rank`` of every peer's staging; one
  barrier; each rank copies slot p (its own x for p = rank) to part p of ``out``.

Data is pushed with remote stores into the staging of the ranks that need it, then each rank
reads only its own staging. The movement kernels copy raw words (int32 or uint8 views), so they
are byte-exact by construction. A block whose wait failed, or that started after this rank had
failed, fills what it would have copied with POISON_BITS (every byte 0xFF) instead.
"""
import triton
import triton.language as tl

from ...runtime.kernels.sync import RANK_VARYING, poison, poison_chunks, push_to_slot
from ...runtime import protocol as P
from .flag_round import barrier, half_of, round_end, round_start

PHASE_ENTRY = tl.constexpr(P.PHASE_ENTRY)
OP_BROADCAST = tl.constexpr(P.OP_BROADCAST)
OP_ALL_GATHER = tl.constexpr(P.OP_ALL_GATHER)


@triton.jit(do_not_specialize=RANK_VARYING)
def broadcast_kernel(x, n, src, stage_tab, flag_tab, flags, ctrl, err, rank, tag, timeout_us,
                     cap,                   # words per staging slot
                     WORLD: tl.constexpr,       # ranks
                     WORLD_POW2: tl.constexpr,  # WORLD rounded up to a power of two
                     NUM_BLOCKS: tl.constexpr,  # the grid
                     BLOCK: tl.constexpr,       # elements per block and step
                     PDL: tl.constexpr = 0):
    """``src`` pushes x into slot 0 of every other rank's staging; one barrier (``src`` also
    waits, so it never runs two ops ahead); the others copy slot 0 into x."""
    b, timeout_us, seq, broken, half, word = round_start(ctrl, err, tag, timeout_us, PDL)
    DT = x.dtype.element_ty
    lanes = tl.arange(0, BLOCK)
    if rank == src:
        push_to_slot(x, stage_tab, n, b, half, src, 0, cap, WORLD, NUM_BLOCKS, BLOCK)
    if b * BLOCK < n:
        ok = barrier(flag_tab, flags, b, word, rank, timeout_us, err, OP_BROADCAST, PHASE_ENTRY,
                     WORLD, WORLD_POW2)
        if ok & (rank != src):
            local = half_of(stage_tab, rank, half, cap, WORLD, DT)
            for start in range(b * BLOCK, n, NUM_BLOCKS * BLOCK):
                offs = start + lanes
                m = offs < n
                tl.store(x + offs, tl.load(local + offs, mask=m), mask=m)
        if ((ok == 0) | broken) & (rank != src):   # src's x is its own operand: left alone
            poison_chunks(x, n, b, NUM_BLOCKS, BLOCK)
    round_end(ctrl, b, seq)


@triton.jit(do_not_specialize=RANK_VARYING)
def all_gather_kernel(x, out, n, part, stage_tab, flag_tab, flags, ctrl, err, rank, tag,
                      timeout_us,
                      cap,                  # words per staging slot
                      WORLD: tl.constexpr,       # ranks
                      WORLD_POW2: tl.constexpr,  # WORLD rounded up to a power of two
                      NUM_BLOCKS: tl.constexpr,  # the grid
                      BLOCK: tl.constexpr,       # elements per block and step
                      PDL: tl.constexpr = 0):
    """Every rank pushes its ``n`` words into slot ``rank`` of every rank's staging; one
    barrier; each rank copies slot p to ``out``. x is ``[n // part, part]`` and word ``i`` of
    rank p lands at ``(i // part) * WORLD * part + p * part + i % part`` (``part == n`` gives the
    contiguous rank-major all-gather; ``part < n`` the token-major 2-D form)."""
    b, timeout_us, seq, broken, half, word = round_start(ctrl, err, tag, timeout_us, PDL)
    DT = x.dtype.element_ty
    lanes = tl.arange(0, BLOCK)
    push_to_slot(x, stage_tab, n, b, half, rank, rank, cap, WORLD, NUM_BLOCKS, BLOCK)
    if b * BLOCK < n:
        ok = barrier(flag_tab, flags, b, word, rank, timeout_us, err, OP_ALL_GATHER,
                     PHASE_ENTRY, WORLD, WORLD_POW2)
        if ok:
            local = half_of(stage_tab, rank, half, cap, WORLD, DT)
            for start in range(b * BLOCK, n, NUM_BLOCKS * BLOCK):
                offs = start + lanes
                m = offs < n
                row = offs // part
                col = offs - row * part
                for p in tl.static_range(WORLD):
                    v = tl.load(tl.where(p == rank, x + offs, local + p * cap + offs), mask=m)
                    tl.store(out + row * (WORLD * part) + p * part + col, v, mask=m)
        if (ok == 0) | broken:
            for start in range(b * BLOCK, n, NUM_BLOCKS * BLOCK):
                offs = start + lanes
                row = offs // part
                col = offs - row * part
                for p in tl.static_range(WORLD):
                    poison(out, row * (WORLD * part) + p * part + col, offs < n)
    round_end(ctrl, b, seq)

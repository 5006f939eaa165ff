"""Reduce-scatter kernels (sum): x is ``[WORLD * m]`` on every rank, and rank s gets the sum over
ranks of part s, ``x[s * m:(s + 1) * m]``, accumulated in fp32 in rank order.

Two protocols, as for all-reduce:

- ``lamport_reduce_scatter_kernel``: barrier-free, the data is its own flag. The Lamport
  all-reduce's rounds (``lamport_all_reduce.lamport_rounds``) with SCATTER: part q of x is
  pushed to rank q only, under its own op code in the tag. Outputs up to a Lamport slot.
- ``reduce_scatter_kernel``: the flag kernels' round (``flag_round.py``): push part s into
  slot ``rank`` of rank s's staging; one barrier; sum the peers' slots and this rank's own
  part of x in rank order into ``out``.
"""
import triton
import triton.language as tl

from ...runtime.kernels.lamport import NO_SPECIALIZE as LAMPORT_NO_SPECIALIZE
from ...runtime.kernels.sync import RANK_VARYING, poison_chunks
from ...runtime import protocol as P
from .flag_round import barrier, half_of, round_end, round_start, slot_of
from .lamport_all_reduce import lamport_rounds

PHASE_ENTRY = tl.constexpr(P.PHASE_ENTRY)
OP_REDUCE_SCATTER = tl.constexpr(P.OP_REDUCE_SCATTER)
OP_LAMPORT_REDUCE_SCATTER = tl.constexpr(P.OP_LAMPORT_REDUCE_SCATTER)


@triton.jit(do_not_specialize=LAMPORT_NO_SPECIALIZE)
def lamport_reduce_scatter_kernel(x, out, n, lam_tab, tag_tab, ctrl, err, rank, tag,
                                  timeout_us,
                                  cap,                     # elements per Lamport slot
                                  SENTINEL: tl.constexpr,    # "not yet written" in the int view
                                  FLOAT: tl.constexpr,       # the float dtype the int view holds
                                  WORLD: tl.constexpr,       # ranks
                                  WORLD_POW2: tl.constexpr,  # WORLD rounded up to a power of two
                                  NUM_BLOCKS: tl.constexpr,  # the grid
                                  BLOCK: tl.constexpr,
                                  STAGES: tl.constexpr,      # PUSH | REDUCE; ALL_STAGES polls
                                  LAG: tl.constexpr = 0,     # > 0: pipelined (lamport_rounds)
                                  PDL: tl.constexpr = 0):    # launched with PDL
    """x holds WORLD parts of n elements (integer views, as
    ``lamport_all_reduce.lamport_kernel``); part q goes into slot ``rank`` of rank q's Lamport
    half ``seq % 2`` (this rank's own part is read from x), and this rank sums part ``rank`` of
    every source into ``out`` (n elements). The tag is ``protocol.lamport_tag`` of
    OP_LAMPORT_REDUCE_SCATTER: a rank that runs the Lamport all-reduce in the same round is a
    mismatch, never summed."""
    lamport_rounds(x, out, n, lam_tab, tag_tab, ctrl, err, rank, tag, timeout_us, cap,
                   SENTINEL, FLOAT, WORLD, WORLD_POW2, NUM_BLOCKS, BLOCK, STAGES, LAG, 1,
                   OP_LAMPORT_REDUCE_SCATTER, PDL)


@triton.jit(do_not_specialize=RANK_VARYING)
def reduce_scatter_kernel(x, out, m_out, stage_tab, flag_tab, flags, ctrl, err, rank, tag,
                          timeout_us,
                          cap,              # elements per staging slot
                          WORLD: tl.constexpr,       # ranks
                          WORLD_POW2: tl.constexpr,  # WORLD rounded up to a power of two
                          NUM_BLOCKS: tl.constexpr,  # the grid
                          BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    """x is ``[WORLD * m_out]``; rank s gets the sum over ranks of ``x[s * m_out:(s + 1) * m_out]``.
    Each rank pushes part s to rank s (slot ``rank``); one barrier; fp32 sum in rank order.
    A failed wait, or a rank that had failed before: the block's part of ``out`` is poisoned."""
    b, timeout_us, seq, broken, half, word = round_start(ctrl, err, tag, timeout_us, PDL)
    DT = x.dtype.element_ty
    lanes = tl.arange(0, BLOCK)
    for start in range(b * BLOCK, m_out, NUM_BLOCKS * BLOCK):
        offs = start + lanes
        m = offs < m_out
        for s in tl.static_range(WORLD):
            if s != rank:  # this rank's own part is read from x below
                v = tl.load(x + s * m_out + offs, mask=m)
                tl.store(slot_of(stage_tab, s, half, rank, cap, WORLD, DT) + offs, v, mask=m)
    if b * BLOCK < m_out:
        ok = barrier(flag_tab, flags, b, word, rank, timeout_us, err, OP_REDUCE_SCATTER,
                     PHASE_ENTRY, WORLD, WORLD_POW2)
        if ok:
            local = half_of(stage_tab, rank, half, cap, WORLD, DT)
            for start in range(b * BLOCK, m_out, NUM_BLOCKS * BLOCK):
                offs = start + lanes
                m = offs < m_out
                acc = tl.zeros([BLOCK], tl.float32)
                for p in tl.static_range(WORLD):
                    src = tl.where(p == rank, x + rank * m_out + offs, local + p * cap + offs)
                    acc += tl.load(src, mask=m).to(tl.float32)
                tl.store(out + offs, acc.to(DT), mask=m)
        if (ok == 0) | broken:
            poison_chunks(out, m_out, b, NUM_BLOCKS, BLOCK)
    round_end(ctrl, b, seq)

"""Flag all-reduce kernels (sum): push one-shot and two-shot (the barrier-free Lamport one-shot is
in ``lamport_all_reduce.py``).

Both follow the flag kernels' round (``flag_round.py``: start, push, barrier, read, poison on
failure, finish), stage by stage:

- ``one_shot_kernel``: push the block's part of x into slot ``rank`` of every peer's staging;
  one barrier; sum the peers' slots and this rank's own x in rank order into ``out``.
- ``two_shot_kernel``: push shard s of x to rank s; barrier; sum this rank's shard in rank
  order, store it to ``out`` and push it into every peer's gather region; second barrier;
  copy the other shards from the gather region to ``out``.

Every kernel runs on a fixed grid of ``NUM_BLOCKS`` blocks (the communicator's constant), so
block ``b`` of every kernel owns counter ``ctrl[b]`` = number of ops this communicator has run.
That counter lives on the GPU, which is what lets a captured CUDA graph replay any number of
times and mix with eager calls: the round (staging half, flag epoch) is read on the device,
never frozen into the launch. Element ``i`` is handled by block ``(i // BLOCK) % NUM_BLOCKS``
on every rank, so block ``b`` only ever waits for block ``b`` of its peers.

Why two staging halves suffice (``half = seq % 2``): every op makes each rank wait for every
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

from ...runtime.kernels.sync import RANK_VARYING, poison, poison_chunks, push_to_slot
from ...runtime import protocol as P
from .flag_round import barrier, half_of, round_end, round_start, slot_of

PHASE_ENTRY = tl.constexpr(P.PHASE_ENTRY)
PHASE_EXIT = tl.constexpr(P.PHASE_EXIT)
OP_ONE_SHOT = tl.constexpr(P.OP_ONE_SHOT)
OP_TWO_SHOT = tl.constexpr(P.OP_TWO_SHOT)


@triton.jit(do_not_specialize=RANK_VARYING)
def one_shot_kernel(x, out, n, stage_tab, flag_tab, flags, ctrl, err, rank, tag, timeout_us,
                    cap,                    # elements per staging slot
                    WORLD: tl.constexpr,       # ranks
                    WORLD_POW2: tl.constexpr,  # WORLD rounded up to a power of two
                    NUM_BLOCKS: tl.constexpr,  # the grid
                    BLOCK: tl.constexpr,       # elements per block and step
                    PDL: tl.constexpr = 0):
    """Each rank pushes its operand into slot ``rank`` of every rank's staging, one barrier,
    then sums its local slots in rank order. Remote traffic: (WORLD-1) * n stores per rank.
    A failed wait, or a rank that had failed before: the block's part of ``out`` is poisoned."""
    b, timeout_us, seq, broken, half, word = round_start(ctrl, err, tag, timeout_us, PDL)
    DT = x.dtype.element_ty
    lanes = tl.arange(0, BLOCK)
    push_to_slot(x, stage_tab, n, b, half, rank, rank, cap, WORLD, NUM_BLOCKS, BLOCK)
    if b * BLOCK < n:
        ok = barrier(flag_tab, flags, b, word, rank, timeout_us, err, OP_ONE_SHOT, PHASE_ENTRY,
                     WORLD, WORLD_POW2)
        if ok:
            local = half_of(stage_tab, rank, half, cap, WORLD, DT)
            for start in range(b * BLOCK, n, NUM_BLOCKS * BLOCK):
                offs = start + lanes
                m = offs < n
                acc = tl.zeros([BLOCK], tl.float32)
                for p in tl.static_range(WORLD):
                    src = tl.where(p == rank, x + offs, local + p * cap + offs)
                    acc += tl.load(src, mask=m).to(tl.float32)
                tl.store(out + offs, acc.to(DT), mask=m)
        if (ok == 0) | broken:
            poison_chunks(out, n, b, NUM_BLOCKS, BLOCK)
    round_end(ctrl, b, seq)


@triton.jit(do_not_specialize=RANK_VARYING)
def two_shot_kernel(x, out, n, shard, stage_tab, gather_tab, flag_tab, flags, ctrl, err,
                    rank, tag, timeout_us,
                    cap,                    # elements per staging slot
                    WORLD: tl.constexpr,       # ranks
                    WORLD_POW2: tl.constexpr,  # WORLD rounded up to a power of two
                    NUM_BLOCKS: tl.constexpr,  # the grid
                    BLOCK: tl.constexpr,       # elements per block and step
                    PDL: tl.constexpr = 0):
    """Reduce-scatter then all-gather, both by push. Rank s owns elements
    ``[s * shard, (s + 1) * shard)``. Phase 1: push shard s of x to rank s (slot ``rank``);
    barrier; sum own shard in rank order. Phase 2: push the reduced shard to every rank's gather
    region of every other rank (and to ``out``); second barrier; copy the other ranks' shards
    from the gather region to ``out``. Remote traffic: 2 (WORLD-1)/WORLD * n. A failed wait
    (either), or a rank that had failed before: the block's elements of every shard of ``out``
    are poisoned."""
    b, timeout_us, seq, broken, half, word = round_start(ctrl, err, tag, timeout_us, PDL)
    DT = x.dtype.element_ty
    lanes = tl.arange(0, BLOCK)
    for start in range(b * BLOCK, shard, NUM_BLOCKS * BLOCK):
        rel = start + lanes
        for s in tl.static_range(WORLD):
            offs = s * shard + rel
            m = (rel < shard) & (offs < n)
            if s != rank:  # this rank's own shard is read from x below
                v = tl.load(x + offs, mask=m)
                tl.store(slot_of(stage_tab, s, half, rank, cap, WORLD, DT) + rel, v, mask=m)
    if b * BLOCK < shard:
        ok = barrier(flag_tab, flags, b, word, rank, timeout_us, err, OP_TWO_SHOT, PHASE_ENTRY,
                     WORLD, WORLD_POW2)
        if ok:
            local = half_of(stage_tab, rank, half, cap, WORLD, DT)
            for start in range(b * BLOCK, shard, NUM_BLOCKS * BLOCK):
                rel = start + lanes
                offs = rank * shard + rel
                m = (rel < shard) & (offs < n)
                acc = tl.zeros([BLOCK], tl.float32)
                for p in tl.static_range(WORLD):
                    src = tl.where(p == rank, x + offs, local + p * cap + rel)
                    acc += tl.load(src, mask=m).to(tl.float32)
                red = acc.to(DT)
                tl.store(out + offs, red, mask=m)
                for p in tl.static_range(WORLD):
                    if p != rank:
                        # the gather region: one slot per half
                        tl.store(half_of(gather_tab, p, half, cap, 1, DT) + offs, red, mask=m)
            ok = barrier(flag_tab, flags, NUM_BLOCKS + b, word, rank, timeout_us, err, OP_TWO_SHOT,
                         PHASE_EXIT, WORLD, WORLD_POW2)
            if ok:
                gathered = half_of(gather_tab, rank, half, cap, 1, DT)
                for start in range(b * BLOCK, shard, NUM_BLOCKS * BLOCK):
                    rel = start + lanes
                    for s in tl.static_range(WORLD):
                        offs = s * shard + rel
                        m = (rel < shard) & (offs < n) & (s != rank)
                        tl.store(out + offs, tl.load(gathered + offs, mask=m), mask=m)
        if (ok == 0) | broken:
            for start in range(b * BLOCK, shard, NUM_BLOCKS * BLOCK):
                rel = start + lanes
                for s in tl.static_range(WORLD):
                    offs = s * shard + rel
                    poison(out, offs, (rel < shard) & (offs < n))
    round_end(ctrl, b, seq)

"""One round of a flag kernel, the skeleton every flag kernel of the TP joins follows.

A flag kernel (``all_reduce.py``, ``movement.py``, ``reduce_scatter.py``, the one-shot fused
norm in ``fused_norm.py``) runs on a fixed grid of ``NUM_BLOCKS`` blocks, and block ``b`` of
every kernel owns the op counter ``ctrl[b]``:

1. start (``round_start``): wait for the kernel ahead under PDL, read ``seq = ctrl[b]``; the
   round writes staging half ``seq % 2`` and signals the flag word ``(seq + 1) << EPOCH_SHIFT
   | tag``;
2. push: remote stores of the block's part into its slot of each peer's staging
   (``slot_of``);
3. barrier (``barrier``): publish the word to every peer, wait for every peer's;
4. read: the peers' slots in this rank's own staging (``half_of``), in rank order;
5. on a failed wait, or a rank that had failed before the round: poison what the block would
   have written;
6. finish (``round_end``): ``ctrl[b] = seq + 1``.

Why two staging halves suffice is in ``all_reduce.py``. The helpers compute exactly what each
kernel wrote inline before they shared them, so the compiled code is the same
(``tools/ptx.py --same-as``).
"""
import triton
import triton.language as tl

from ...runtime.kernels.sync import (EPOCH_SHIFT, op_start, ptr_from_table, signal_peers,
                                     wait_peers)


@triton.jit
def round_start(ctrl, err, tag, timeout_us, PDL: tl.constexpr):
    """The round's start for this block: (b, timeout_us, seq, broken, half, word).
    ``timeout_us`` comes back short and ``broken`` set where this rank had failed
    (``sync.op_start``); ``half`` is the staging half, ``word`` the flag word of the round."""
    b, timeout_us, seq, broken = op_start(ctrl, err, timeout_us, PDL)
    return b, timeout_us, seq, broken, seq % 2, ((seq + 1) << EPOCH_SHIFT) | tag


@triton.jit
def barrier(flag_tab, flags, slot, word, rank, timeout_us, err, OP: tl.constexpr,
            PHASE: tl.constexpr, WORLD: tl.constexpr, WORLD_POW2: tl.constexpr):
    """After the block's pushes: publish ``word`` in flag ``slot`` of every rank, then wait for
    every rank's (bounded). Returns 1, or 0 after reporting a timeout or mismatch as ``OP`` in
    ``PHASE``."""
    tl.debug_barrier()      # every thread's push before the release
    signal_peers(flag_tab, slot, word, rank, WORLD, WORLD_POW2)
    return wait_peers(flags, slot, word, timeout_us, err, OP, PHASE, WORLD, WORLD_POW2)


@triton.jit
def half_of(stage_tab, owner, half, cap, WORLD: tl.constexpr, DT: tl.constexpr):
    """Half ``half`` of rank ``owner``'s staging (``WORLD`` slots of ``cap`` elements of
    ``DT``), 16-byte aligned: slot p is ``+ p * cap``."""
    return tl.multiple_of(ptr_from_table(stage_tab, owner, DT), 16) + half * WORLD * cap


@triton.jit
def slot_of(stage_tab, owner, half, slot, cap, WORLD: tl.constexpr, DT: tl.constexpr):
    """Slot ``slot`` of half ``half`` of rank ``owner``'s staging, 16-byte aligned: where this
    rank pushes (``slot`` is the rank whose data it holds)."""
    return tl.multiple_of(ptr_from_table(stage_tab, owner, DT), 16) + (half * WORLD + slot) * cap


@triton.jit
def round_end(ctrl, b, seq):
    """The block's round is over: its op counter advances (the next round's half and epoch)."""
    tl.store(ctrl + b, seq + 1)

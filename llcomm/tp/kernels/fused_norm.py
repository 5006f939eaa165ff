"""Fused all-reduce + residual add + RMSNorm: the join after a row-parallel projection.

For every token row, in one kernel::

    s = round(sum over ranks of x, fp32, rank 0 first)   # what all_reduce would return
    h = round(s + residual)                               # residual_out (RESIDUAL=0: h = s)
    y = round(h * rsqrt(mean(h * h) + eps) * weight)      # out; h, mean, weight in fp32

``round`` is the conversion to the dtype of ``x``. ``h`` is rounded before it is normalised,
as TensorRT-LLM's / FlashInfer's allreduce fusion and vLLM's fused_add_rms_norm do, so ``out``
is the norm of exactly the residual stream that the next layer reads back.

Variants, constexprs of both kernels (the host picks them per op; the defaults are
``all_reduce_residual_rmsnorm``): ``RESIDUAL=0`` adds no residual (``all_reduce_rmsnorm``,
the first layer's join: ``residual`` is not read). ``OUT`` says what ``out`` receives:
``PLAIN`` y itself; ``FP8_STATIC`` the float8_e4m3fn codes of ``float(y) * (1 / scale)``,
``scale`` the one fp32 at ``qscale``; ``FP8_GROUP`` the codes of ``float(y) / scale`` per
128-channel group, scale = amax / 448 (``ROUND``: up to a power of two) stored to
``qscale [tokens, hidden // 128]``. Both FP8 outputs quantise the *rounded* y, so they are
byte for byte ``llcomm/runtime/fp8_format.py`` applied to the PLAIN output (e4m3: round to nearest
even, saturated to +-448; ``llcomm/runtime/kernels/e4m3.py``). ``OP`` is the op code the tags
and error words carry, one per variant and algorithm, so ranks that call different variants in
one round report a mismatch.

Block ``b`` owns rows ``b, b + NUM_BLOCKS, b + 2 NUM_BLOCKS, ...`` whole, on every rank, so it
can finish a row's sum of squares without talking to another block. Both kernels reuse the
all-reduce protocols and the communicator's device-side op counters (``ctrl[b]``) of
``all_reduce.py``; the argument why two alternating halves suffice is the one given there, and they
interleave freely with every other op of the communicator:

- ``lamport_norm_kernel``: barrier-free; the pushed data is its own flag (SENTINEL = idle) and
  a tag word per (block, source) names the call (``runtime/kernels/lamport.py``). Push tag and
  rows -> poll own slots until every tag is written and no SENTINEL is left, compare the tags ->
  sum -> re-arm the slots with SENTINEL and the tags with 0.
- ``one_shot_norm_kernel``: for rows past the Lamport region; push into staging, one flag
  barrier per block (block b waits for block b of every peer, which pushed the same rows), sum.

``x`` arrives as an integer view (int16 / int32) of the float data so the Lamport kernel can
compare bit patterns; ``FLOAT`` names the float type. ``STAGES`` runs only the push or only the
reduce half, without waiting (the Lamport reduce half reads each source once and reports what
it finds missing or mismatched): the CPU tests use it to run virtual ranks in turn under
``TRITON_INTERPRET=1``. The library always launches ``ALL_STAGES``.
"""
import triton
import triton.language as tl

from ...runtime.kernels.lamport import NO_SPECIALIZE as LAMPORT_NO_SPECIALIZE
from ...runtime.kernels.lamport import (STAGE_ALL, STAGE_PUSH, STAGE_REDUCE, limit_ticks,
                                        own_words, push_tag, receive, tag_slots)
from ...runtime.kernels.e4m3 import FP8_BLOCK, div_by, e4m3_clamped, fp8_scales
from ...runtime.kernels.sync import RANK_VARYING, op_start, poison, ptr_from_table
from ...runtime import protocol as P
from .flag_round import barrier, half_of, round_end, round_start, slot_of

PHASE_ENTRY = tl.constexpr(P.PHASE_ENTRY)
#: What ``out`` receives (the OUT constexpr; python ints for the host).
PLAIN, FP8_STATIC, FP8_GROUP = 0, 1, 2
_PLAIN = tl.constexpr(PLAIN)
_FP8_STATIC = tl.constexpr(FP8_STATIC)
_FP8_GROUP = tl.constexpr(FP8_GROUP)


@triton.jit
def _add_norm_row(acc, residual, weight, out, res_out, qscale, row, cols, m, live, hidden, eps,
                  FLOAT: tl.constexpr, RESIDUAL: tl.constexpr, OUT: tl.constexpr,
                  ROUND: tl.constexpr):
    """Finish one row from its fp32 rank-order sum ``acc`` (0 in masked lanes); ``live``: the
    row's columns in ``m`` (hidden, or 0 for a row past the last)."""
    if RESIDUAL:
        s = acc.to(FLOAT).to(tl.float32)  # rounded as all_reduce returns it
        r = tl.load(residual + row + cols, mask=m, other=0.0).to(tl.float32)
        h = (s + r).to(FLOAT)
    else:
        h = acc.to(FLOAT)
    tl.store(res_out + row + cols, h, mask=m)
    hf = h.to(tl.float32)          # masked lanes are 0 and add nothing to the sum of squares
    # The sum of squares in fp64: a square is exact there and so, nearly always, is the sum, so
    # inv does not depend on the order of the sum. An fp32 sum's order follows the compiled
    # layout, which differs between the output variants (the FP8 ones reshape y into groups),
    # and their y would differ from PLAIN's by one step in rare elements.
    h64 = hf.to(tl.float64)
    inv = tl.rsqrt(tl.sum(h64 * h64, axis=0).to(tl.float32) / hidden + eps)
    w = tl.load(weight + cols, mask=m, other=0.0).to(tl.float32)
    if OUT == _PLAIN:
        tl.store(out + row + cols, (hf * inv * w).to(FLOAT), mask=m)
    else:               # quantise y as the PLAIN variant returns it: rounded to FLOAT
        _store_fp8((hf * inv * w).to(FLOAT).to(tl.float32), out, qscale, row, cols, m, live, OUT,
                   ROUND)


@triton.jit
def _store_fp8(y, out, qscale, row, cols, m, live, OUT: tl.constexpr, ROUND: tl.constexpr):
    """``out`` (e4m3 bytes) of the row ``y`` (fp32, the rounded norm; 0 in masked lanes):
    FP8_STATIC: ``y * (1 / scale)`` (the reciprocal rounded once); FP8_GROUP: ``y / scale``
    (IEEE division, ``div_by``) per 128-channel group, the scales stored to ``qscale`` at
    ``row // 128`` (the row's first group). Clamped to +-448, rounded to nearest even."""
    if OUT == _FP8_STATIC:
        inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.load(qscale))
        q = e4m3_clamped(y * inv)
    else:
        BLOCK: tl.constexpr = y.shape[0]
        G: tl.constexpr = BLOCK // FP8_BLOCK
        y2 = tl.reshape(y, (G, FP8_BLOCK))
        sc = fp8_scales(y2, ROUND)      # masked lanes are 0: no group's amax grows
        q = tl.reshape(e4m3_clamped(div_by(y2, sc)), (BLOCK,))
        g = tl.arange(0, G)
        tl.store(qscale + row // FP8_BLOCK + g, sc, mask=g * FP8_BLOCK < live)
    tl.store(out + row + cols, q.to(tl.uint8), mask=m)


@triton.jit
def _poison_rows(out, res_out, qscale, b, tokens, hidden, NUM_BLOCKS: tl.constexpr,
                 BLOCK: tl.constexpr, OUT: tl.constexpr):
    """Block b's rows of every output poisoned (only on failure): ``out`` (FP8: the e4m3 NaN
    byte 0xFF), ``residual_out`` and, FP8_GROUP, the rows' scales (NaN)."""
    cols = tl.arange(0, BLOCK)
    m = cols < hidden
    for t in range(b, tokens, NUM_BLOCKS):
        poison(out, t * hidden + cols, m)
        poison(res_out, t * hidden + cols, m)
        if OUT == _FP8_GROUP:
            g = tl.arange(0, BLOCK // FP8_BLOCK)
            poison(qscale, t * hidden // FP8_BLOCK + g, g * FP8_BLOCK < hidden)


@triton.jit(do_not_specialize=LAMPORT_NO_SPECIALIZE)
def lamport_norm_kernel(x, residual, weight, out, res_out,
                        qscale,                  # FP8_STATIC: the scale; FP8_GROUP: scales out
                        tokens, hidden, eps, lam_tab, tag_tab, ctrl, err, rank, tag, timeout_us,
                        cap,                     # elements per Lamport slot
                        SENTINEL: tl.constexpr,    # bit pattern of "not yet written" (int view)
                        FLOAT: tl.constexpr,       # the float dtype the int view holds
                        WORLD: tl.constexpr,       # ranks
                        WORLD_POW2: tl.constexpr,  # WORLD rounded up to a power of two
                        NUM_BLOCKS: tl.constexpr,  # the grid
                        BLOCK: tl.constexpr,       # pow2 >= hidden: one row per iteration
                        STAGES: tl.constexpr,      # PUSH | REDUCE; only ALL_STAGES polls
                        PDL: tl.constexpr = 0,     # launched with PDL (sync.after_previous_kernel)
                        OP: tl.constexpr = P.OP_FUSED_LAMPORT,  # op code of tags and errors
                        RESIDUAL: tl.constexpr = 1, OUT: tl.constexpr = PLAIN,
                        ROUND: tl.constexpr = 0):  # the variant (module doc)
    """Lamport one-shot all-reduce of ``x [tokens, hidden]`` fused with add + RMSNorm.

    Slot and tag layout as ``lamport_all_reduce.lamport_kernel`` (element i of rank r's operand at
    ``(half * WORLD + r) * cap + i`` of every rank's Lamport region, tags ``[half][block][r]``), so
    both kernels share halves. ``tag`` is ``protocol.lamport_tag`` of ``OP`` (this variant's
    code) and the shape (tokens and hidden, as the one-shot variant's flag): it differs from
    every plain all_reduce's and every other variant's, so ranks that call two different ones in
    one round report a mismatch.

    A block whose wait failed, or that started after this rank had failed, poisons its rows
    of every output once they are done (``_poison_rows``).
    """
    b, timeout_us, seq, broken = op_start(ctrl, err, timeout_us, PDL)
    IT = x.dtype.element_ty
    half = seq % 2
    cols = tl.arange(0, BLOCK)
    m = cols < hidden
    if STAGE_PUSH & STAGES:
        push_tag(tag_tab, half, b, rank, tag, NUM_BLOCKS, WORLD, WORLD_POW2)
        for t in range(b, tokens, NUM_BLOCKS):
            v = tl.load(x + t * hidden + cols, mask=m)
            v = tl.where(v == SENTINEL, 0, v)  # -0.0 -> +0.0: same sum, never looks idle
            for p in tl.static_range(WORLD):
                dst = (tl.multiple_of(ptr_from_table(lam_tab, p, IT), 16)
                       + (half * WORLD + rank) * cap)
                if p != rank:       # the own term is read from x (receive)
                    tl.store(dst + t * hidden + cols, v, mask=m)
    if STAGE_REDUCE & STAGES:
        POLL: tl.constexpr = STAGE_ALL == STAGES
        local = tl.multiple_of(ptr_from_table(lam_tab, rank, IT), 16) + half * WORLD * cap
        tags = tag_slots(tag_tab, rank, half, b, NUM_BLOCKS, WORLD)
        limit = limit_ticks(timeout_us, POLL)
        # The first row's waits take the tags too: a block without rows still runs that row,
        # all lanes masked (no load, no store), to take its tags.
        failed = tl.zeros([], tl.int32)
        for t in range(b, tl.maximum(tokens, b + 1), NUM_BLOCKS):
            mt = cols < tl.where(t < tokens, hidden, 0)     # a row past the last: no columns
            own = own_words(x, t * hidden + cols, mt, SENTINEL)
            acc, failed = receive(local, cap, t * hidden + cols, mt, tags, tag, t == b, failed,
                                  limit, err, OP, own.to(IT), rank, SENTINEL, FLOAT,
                                  WORLD, BLOCK, POLL)
            _add_norm_row(acc, residual, weight, out, res_out, qscale, t * hidden, cols, mt,
                          tl.where(t < tokens, hidden, 0), hidden, eps, FLOAT, RESIDUAL, OUT, ROUND)
        if (failed != 0) | broken:
            _poison_rows(out, res_out, qscale, b, tokens, hidden, NUM_BLOCKS, BLOCK, OUT)
        tl.store(ctrl + b, seq + 1)


@triton.jit(do_not_specialize=RANK_VARYING)
def one_shot_norm_kernel(x, residual, weight, out, res_out,
                         qscale,                 # FP8_STATIC: the scale; FP8_GROUP: scales out
                         tokens, hidden, eps, stage_tab, flag_tab, flags, ctrl, err, rank, tag,
                         timeout_us,
                         cap,                    # elements per staging slot
                         FLOAT: tl.constexpr,       # the float dtype the int view of x holds
                         WORLD: tl.constexpr,       # ranks
                         WORLD_POW2: tl.constexpr,  # WORLD rounded up to a power of two
                         NUM_BLOCKS: tl.constexpr,  # the grid
                         BLOCK: tl.constexpr,       # pow2 >= hidden: one row per iteration
                         STAGES: tl.constexpr,      # PUSH | REDUCE; only ALL_STAGES signals, waits
                         PDL: tl.constexpr = 0,     # launched with PDL (sync.after_previous_kernel)
                         OP: tl.constexpr = P.OP_FUSED_ONE_SHOT,  # op code of flags and errors
                         RESIDUAL: tl.constexpr = 1, OUT: tl.constexpr = PLAIN,
                         ROUND: tl.constexpr = 0):  # the variant (module doc)
    """Push one-shot all-reduce of ``x [tokens, hidden]`` fused with add + RMSNorm.

    Staging as ``all_reduce.one_shot_kernel``: rank r's rows go to slot r of half
    ``seq % 2`` of every other rank; this rank's own term is read from ``x``. A failed wait,
    or a rank that had failed before: the block's rows are poisoned (``_poison_rows``).
    """
    b, timeout_us, seq, broken, half, word = round_start(ctrl, err, tag, timeout_us, PDL)
    IT = x.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    m = cols < hidden
    if STAGE_PUSH & STAGES:
        for t in range(b, tokens, NUM_BLOCKS):
            v = tl.load(x + t * hidden + cols, mask=m)
            for p in tl.static_range(WORLD):
                if p != rank:
                    dst = slot_of(stage_tab, p, half, rank, cap, WORLD, IT)
                    tl.store(dst + t * hidden + cols, v, mask=m)
    ok = 1
    if STAGE_ALL == STAGES:
        if b < tokens:  # a block without rows has nothing to wait for
            ok = barrier(flag_tab, flags, b, word, rank, timeout_us, err, OP, PHASE_ENTRY,
                         WORLD, WORLD_POW2).to(tl.int32)
    if STAGE_REDUCE & STAGES:
        if ok:
            local = half_of(stage_tab, rank, half, cap, WORLD, IT)
            for t in range(b, tokens, NUM_BLOCKS):
                acc = tl.zeros([BLOCK], tl.float32)
                for p in tl.static_range(WORLD):
                    src = tl.where(p == rank, x + t * hidden + cols,
                                   local + p * cap + t * hidden + cols)
                    acc += tl.load(src, mask=m, other=0).to(FLOAT, bitcast=True).to(tl.float32)
                _add_norm_row(acc, residual, weight, out, res_out, qscale, t * hidden, cols, m,
                              hidden, hidden, eps, FLOAT, RESIDUAL, OUT, ROUND)
        if (ok == 0) | broken:
            _poison_rows(out, res_out, qscale, b, tokens, hidden, NUM_BLOCKS, BLOCK, OUT)
        round_end(ctrl, b, seq)

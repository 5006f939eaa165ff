"""Fused all-reduce + residual add + RMSNorm: the join after a row-parallel projection.

For every token row, in one kernel::

    s = round(sum over ranks of x, fp32, rank 0 first)   # what all_reduce would return
    h = round(s + residual)                               # residual_out
    y = round(h * rsqrt(mean(h * h) + eps) * weight)      # out; h, mean, weight in fp32

``round`` is the conversion to the dtype of ``x``. ``h`` is rounded before it is normalised,
as TensorRT-LLM's / FlashInfer's allreduce fusion and vLLM's fused_add_rms_norm do, so ``out``
is the norm of exactly the residual stream that the next layer reads back.

Block ``b`` owns rows ``b, b + NB, b + 2 NB, ...`` whole, on every rank, so it can finish a row's
sum of squares without talking to another block. Both kernels reuse the all-reduce protocols and
the communicator's device-side op counters (``ctrl[b]``) of ``all_reduce.py``; the argument why
two alternating halves suffice is the one given there, and they interleave freely with every
other op of the communicator:

- ``lamport_norm_kernel``: barrier-free; the pushed data is its own flag (SENTINEL = idle) and
  a tag word per (block, source) names the call (``_lamport.py``). Push tag and rows -> poll own
  slots until every tag is written and no SENTINEL is left, compare the tags -> sum -> re-arm the
  slots with SENTINEL and the tags with 0.
- ``one_shot_norm_kernel``: for rows past the Lamport region; push into staging, one flag
  barrier per block (block b waits for block b of every peer, which pushed the same rows), sum.

``x`` arrives as an integer view (int16 / int32) of the float data so the Lamport kernel can
compare bit patterns; ``FT`` names the float type. ``STAGES`` runs only the push or only the
reduce half, without waiting (the Lamport reduce half reads each source once and reports what
it finds missing or mismatched): the CPU tests use it to run virtual ranks in turn under
``TRITON_INTERPRET=1``. The library always launches ``ALL_STAGES``.
"""
import triton
import triton.language as tl

# PUSH, REDUCE, ALL_STAGES: the stage bits, for the host and the tests as before
from ...runtime.kernels.lamport import ALL_STAGES, PUSH, REDUCE  # noqa: F401
from ...runtime.kernels.lamport import NO_SPECIALIZE as LAMPORT_NO_SPECIALIZE
from ...runtime.kernels.lamport import limit_ticks, own_words, push_tag, receive, tag_slots
from ...runtime.kernels.sync import (EPOCH_SHIFT, RANK_VARYING, op_start, ptr_from_table, signal_peers,
                    wait_peers)
from ...runtime import protocol as P

PHASE_ENTRY = tl.constexpr(P.PHASE_ENTRY)
OP_FUSED_LAMPORT = tl.constexpr(P.OP_FUSED_LAMPORT)
OP_FUSED_ONE_SHOT = tl.constexpr(P.OP_FUSED_ONE_SHOT)


@triton.jit
def _add_norm_row(acc, residual, weight, out, res_out, row, cols, m, hidden, eps,
                  FT: tl.constexpr):
    """Finish one row from its fp32 rank-order sum ``acc`` (0 in masked lanes)."""
    s = acc.to(FT).to(tl.float32)  # rounded as all_reduce returns it
    r = tl.load(residual + row + cols, mask=m, other=0.0).to(tl.float32)
    h = (s + r).to(FT)
    tl.store(res_out + row + cols, h, mask=m)
    hf = h.to(tl.float32)          # masked lanes are 0 and add nothing to the sum of squares
    inv = tl.rsqrt(tl.sum(hf * hf, axis=0) / hidden + eps)
    w = tl.load(weight + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out + row + cols, (hf * inv * w).to(FT), mask=m)


@triton.jit(do_not_specialize=LAMPORT_NO_SPECIALIZE)
def lamport_norm_kernel(x, residual, weight, out, res_out, tokens, hidden, eps, lam_tab,
                        tag_tab, ctrl, err, rank, tag, timeout_us,
                        cap,                     # elements per Lamport slot
                        SENTINEL: tl.constexpr,  # bit pattern of "not yet written" (int view)
                        FT: tl.constexpr,        # the float dtype the int view holds
                        W: tl.constexpr, WP: tl.constexpr, NB: tl.constexpr,
                        BLOCK: tl.constexpr,     # pow2 >= hidden: one row per iteration
                        STAGES: tl.constexpr,    # PUSH | REDUCE; only ALL_STAGES polls
                        PDL: tl.constexpr = 0):  # launched with PDL (_sync.after_previous_kernel)
    """Lamport one-shot all-reduce of ``x [tokens, hidden]`` fused with add + RMSNorm.

    Slot and tag layout as ``lamport.lamport_kernel`` (element i of rank r's operand at
    ``(half * W + r) * cap + i`` of every rank's Lamport region, tags ``[half][block][r]``), so
    both kernels share halves. ``tag`` is ``protocol.lamport_tag`` of OP_FUSED_LAMPORT and the
    shape (tokens and hidden, as the one-shot variant's flag): it differs from every plain
    all_reduce's, so ranks that call the two kernels in one round report a mismatch.
    """
    b, timeout_us, seq = op_start(ctrl, err, timeout_us, PDL)
    IT = x.dtype.element_ty
    half = seq % 2
    cols = tl.arange(0, BLOCK)
    m = cols < hidden
    if STAGES & 1:      # PUSH (literal bits: the interpreter runs them too)
        push_tag(tag_tab, half, b, rank, tag, NB, W, WP)
        for t in range(b, tokens, NB):
            v = tl.load(x + t * hidden + cols, mask=m)
            v = tl.where(v == SENTINEL, 0, v)  # -0.0 -> +0.0: same sum, never looks idle
            for p in tl.static_range(W):
                dst = tl.multiple_of(ptr_from_table(lam_tab, p, IT), 16) + (half * W + rank) * cap
                if p != rank:       # the own term is read from x (receive)
                    tl.store(dst + t * hidden + cols, v, mask=m)
    if STAGES & 2:      # REDUCE
        POLL: tl.constexpr = STAGES == 3    # ALL_STAGES
        local = tl.multiple_of(ptr_from_table(lam_tab, rank, IT), 16) + half * W * cap
        tags = tag_slots(tag_tab, rank, half, b, NB, W)
        limit = limit_ticks(timeout_us, POLL)
        # The first row's waits take the tags too: a block without rows still runs that row,
        # all lanes masked (no load, no store), to take its tags.
        failed = tl.zeros([], tl.int32)
        for t in range(b, tl.maximum(tokens, b + 1), NB):
            mt = cols < tl.where(t < tokens, hidden, 0)     # a row past the last: no columns
            own = own_words(x, t * hidden + cols, mt, SENTINEL)
            acc, failed = receive(local, cap, t * hidden + cols, mt, tags, tag, t == b, failed,
                                  limit, err, OP_FUSED_LAMPORT, own.to(IT), rank, SENTINEL, FT,
                                  W, BLOCK, POLL)
            _add_norm_row(acc, residual, weight, out, res_out, t * hidden, cols, mt, hidden, eps,
                          FT)
        tl.store(ctrl + b, seq + 1)


@triton.jit(do_not_specialize=RANK_VARYING)
def one_shot_norm_kernel(x, residual, weight, out, res_out, tokens, hidden, eps, stage_tab,
                         flag_tab, flags, ctrl, err, rank, tag, timeout_us,
                         cap,                    # elements per staging slot
                         FT: tl.constexpr,       # the float dtype the int view of x holds
                         W: tl.constexpr, WP: tl.constexpr, NB: tl.constexpr,
                         BLOCK: tl.constexpr,    # pow2 >= hidden: one row per iteration
                         STAGES: tl.constexpr,   # PUSH | REDUCE; only ALL_STAGES signals, waits
                         PDL: tl.constexpr = 0):  # launched with PDL (_sync.after_previous_kernel)
    """Push one-shot all-reduce of ``x [tokens, hidden]`` fused with add + RMSNorm.

    Staging as ``all_reduce.one_shot_kernel``: rank r's rows go to slot r of half
    ``seq % 2`` of every other rank; this rank's own term is read from ``x``.
    """
    b, timeout_us, seq = op_start(ctrl, err, timeout_us, PDL)
    IT = x.dtype.element_ty
    parity = seq % 2
    word = ((seq + 1) << EPOCH_SHIFT) | tag
    cols = tl.arange(0, BLOCK)
    m = cols < hidden
    if STAGES & 1:
        for t in range(b, tokens, NB):
            v = tl.load(x + t * hidden + cols, mask=m)
            for p in tl.static_range(W):
                if p != rank:
                    dst = tl.multiple_of(ptr_from_table(stage_tab, p, IT), 16) + (parity * W + rank) * cap
                    tl.store(dst + t * hidden + cols, v, mask=m)
    ok = 1
    if STAGES == 3:
        if b < tokens:  # a block without rows has nothing to wait for
            tl.debug_barrier()
            signal_peers(flag_tab, b, word, rank, W, WP)
            ok = wait_peers(flags, b, word, timeout_us, err, OP_FUSED_ONE_SHOT, PHASE_ENTRY,
                            W, WP).to(tl.int32)
    if STAGES & 2:
        if ok:
            local = tl.multiple_of(ptr_from_table(stage_tab, rank, IT), 16) + parity * W * cap
            for t in range(b, tokens, NB):
                acc = tl.zeros([BLOCK], tl.float32)
                for p in tl.static_range(W):
                    src = tl.where(p == rank, x + t * hidden + cols, local + p * cap + t * hidden + cols)
                    acc += tl.load(src, mask=m, other=0).to(FT, bitcast=True).to(tl.float32)
                _add_norm_row(acc, residual, weight, out, res_out, t * hidden, cols, m, hidden,
                              eps, FT)
        tl.store(ctrl + b, seq + 1)

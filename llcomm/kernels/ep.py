"""EP low-latency MoE dispatch and combine kernels (DeepEP low-latency shapes, deterministic).

Two kernels, each one launch on a fixed grid of ``NB`` blocks, each fusing push, bounded wait and
the local work that follows:

``dispatch_kernel``
    1. counts: block b counts, for experts ``e = b, b + NB, ...``, the tokens of this rank that
       route to e and pushes the count to e's rank (region ``recv_count[src][local e]``).
    2. tokens: block b takes tokens ``t = b, b + NB, ...``; one 16-byte-vector row push of x[t]
       per destination *rank* that holds one of its experts (not one per expert), into slot
       ``(src, t)``, plus one metadata word per top-k entry for every rank:
       ``(local expert << 16) | prefix``, prefix = number of earlier tokens of this rank that
       route to the same expert (computed here, on the source, by comparing top-k rows).
    3. signal ``flag[dispatch][b][src]`` on every rank, then wait for every (block, rank) flag.
    4. expand: block b takes the pairs ``(s, t)`` it owns (``_first_token``: token t of source
       s belongs to block ``(t + s * NB // W) % NB``); the row of
       ``(expert e, s, t)`` is ``sum(count[s'][e] for s' < s) + prefix``, so rows are source
       rank major, then source token order, packed from 0, whatever the arrival order, and no
       atomics are involved. Each row is copied from the receive slot into ``recv_x``.

    FP8 (``FP8`` = 1, or 2 with power-of-two scales): stage 2 quantises each token row on the
    sender (``_quantize_row``, the arithmetic of ``llcomm/ep_fp8.py``) and pushes ``H`` bytes of
    e4m3 plus ``H // 128`` fp32 scales: half the NVLink bytes of bf16. Stage 4 copies bytes and
    scales. The fp32 -> e4m3 rounding is done on the bits (``_e4m3_bits``), not with Triton's
    cast, so the kernel is exact under ``TRITON_INTERPRET=1`` too (the interpreter's fp8 cast
    does not round to nearest even) and byte-equal to torch's ``.to(torch.float8_e4m3fn)``.

``combine_kernel``
    A. weights: block b pushes ``topk_weights[t]`` of the tokens it owns (the rule of
       ``_first_token``, with s = this rank) to every rank; signal; wait for block b of every
       rank (block b of a receiver only reduces the pairs (s, t) that block b of s owns).
    B. reduce: for each pair (s, t) of its tokens with a local expert, the expert outputs of
       the pair's local top-k entries are weighted and summed **in k order in fp32**
       (``acc = acc + w_k * y_k``, no FMA contraction), rounded once to the buffer dtype, and
       pushed into slot ``(this rank, t)`` of rank s; signal; wait for block b of every rank.
    C. sum: for each token t of its own, block b sums the partials of the ranks t was routed
       to, **in rank order in fp32** starting from +0.0, and rounds once into ``out[t]``.

Weights with the dispatch (``CARRY`` / ``CARRIED`` = 1, ``dispatch(topk_weights=...)``): the
dispatch also pushes stage A's weights, into the weights region of the *handle slot's* set
(byte ``w_off``; set k serves handle slot k), and its signal releases them with the rows; the
combine then skips stage A and its wait (the dispatch's wait already covered the weights) and
reads them at ``w_off``. Slot k is written again by dispatch k + 2, which a rank starts only
after its combine k, which waited for every rank's partials of k, each pushed after that rank
read its weights: the same argument as the sets'. Without the weights wait the combine's first
wait is the partials wait; the partials region is safe by the argument below (combine k - 1's
exit wait).

Why two buffer sets suffice (set = op counter % 2, on the device, separately for dispatch and
combine): every op waits for every rank. When rank r starts dispatch k it has finished dispatch
k-1, which needed every peer to have signalled k-1, i.e. to have finished dispatch k-2 (kernels
on one stream run in order). Dispatch k writes the set dispatch k-2 used, which nobody reads
any more; no flag slot is rewritten before its waiter saw it. Combine: same argument per phase
(weights of k are written after the writer finished k-1, which needed every rank's partials of
k-1, sent after those ranks finished reading weights of k-2 ...). Combine reads nothing of the
dispatch regions: what it needs of a dispatch (``row_of``, ``ntok``) is in the handle slot,
which is local memory.

Timeline of one dispatch between ranks A and B (block b of each)::

    A: push rows/meta/counts -> B ... bar.sync; atom.release.sys B.flag[D][b][A] = word
    B: poll all B.flag[D][*][*] == word (volatile), one acquire pass ... bar.sync; expand

``STAGES`` (constexpr bit mask) picks the stages a launch runs; signals and waits are stages of
their own. The library launches either everything (``DISPATCH_ALL`` / ``COMBINE_ALL``) or, for
``return_recv_hook=True``, the two halves in two launches::

    dispatch   send half  D_SEND | D_SIGNAL                 push rows, counts, meta; signal
               recv half  D_WAIT | D_RECV                   wait; expand; advance the counter
    combine    send half  C_WEIGHTS | C_SYNC_W | C_REDUCE | C_SIGNAL_P
                                                            weights, signal, wait for them,
                                                            reduce and push partials, signal
               recv half  C_WAIT_P | C_SUM                  wait for partials; sum; advance

Rank masks (``MASKS`` = 1, ``EPBuffer(enable_masks=True)``): ``err[ERR_MASK]`` is a bit mask of
ranks treated as absent. Every wait skips their flags; a wait that runs out adds the late ranks
to the mask instead of writing the error word. The blocks of a dispatch agree on one mask per
call (``_agree_mask``; rows depend on every earlier source's counts), combine blocks use their
own waits' view. Data stages skip masked sources: no counts, rows or ``ntok`` from them in the
expand, no partials for their tokens, their partials left out of the sum. Pushes and signals
still go to every rank. With ``MASKS`` = 0 the mask is a constant 0 and the code is as before.

The counter (set parity and epoch) advances only in the recv half, so both halves of one call
agree on it; the host refuses a second send half before the first one's hook ran, so the
two-set argument above still holds. The CPU tests run the data stages alone (``D_SEND``, then
``D_RECV``; ``C_WEIGHTS``, ``C_REDUCE``, ``C_SUM``) for every virtual rank in turn under
``TRITON_INTERPRET=1``, since the waits read the GPU clock.
"""
import triton
import triton.language as tl

from ._sync import (EPOCH_SHIFT, RANK_VARYING, after_previous_kernel, global_time_lanes,
                    global_time_ns, report_error, sm_cycles, wait_bound_us)
from .. import ep_layout as EL
from .. import protocol as P

STATUS_TIMEOUT = tl.constexpr(P.STATUS_TIMEOUT)
#: Token counts differ between ranks too (see _sync.RANK_VARYING).
EP_RANK_VARYING = RANK_VARYING + ["n_tok"]
#: A wait's verdicts and clock readings are reduced over this many lanes: at least every thread
#: of a block (32 warps at most), so the maximum goes through shared memory and the whole block
#: agrees; the wait's loop holds block-wide reductions, whose barriers must not be split. Also
#: the most flags a wait polls (one or more lanes per flag): ep_layout.MAX_WAIT_FLAGS.
BLOCK_WIDE = tl.constexpr(EL.MAX_WAIT_FLAGS)
WAIT_SKIPPED = tl.constexpr(-2)         # _wait_flags status: not waited (an earlier wait failed)
# _wait_flags: what a lane saw in one poll, packed above the elapsed ns for one block maximum
SEEN_WAITING = tl.constexpr(1)          # a flag does not hold the word yet
SEEN_WRONG = tl.constexpr(2)            # a flag holds another op's word (mismatch)
SEEN_SHIFT = tl.constexpr(60)
ELAPSED_MASK = tl.constexpr((1 << 60) - 1)
STATUS_MISMATCH = tl.constexpr(P.STATUS_MISMATCH)
PHASE_ENTRY = tl.constexpr(P.PHASE_ENTRY)
PHASE_EXIT = tl.constexpr(P.PHASE_EXIT)
PHASE_DATA = tl.constexpr(P.PHASE_DATA)
OP_DISPATCH = tl.constexpr(P.OP_DISPATCH)
OP_COMBINE = tl.constexpr(P.OP_COMBINE)
# Rank masks (EPBuffer(enable_masks=True)): words of the buffer's private ``err`` tensor.
ERR_MASK = tl.constexpr(3)              # bit s: rank s is masked (set by the waits, cleared by
#                                         the host's clean_mask)
ERR_VERDICT = tl.constexpr(4)           # dispatch: (epoch << 32) | the mask its blocks agreed on
VERDICT_SHIFT = tl.constexpr(32)
VERDICT_EPOCH = tl.constexpr(0x7FFFFFFF)    # epoch bits kept: consecutive calls differ
VERDICT_RANKS = tl.constexpr(0xFFFFFFFF)    # rank bits (masks need num_ranks <= 32)
# Profiling (PROFILE = 1, LLCOMM_EP_PROFILE=1; tools/ep_timeline.py reads them): block b keeps
# PROF_WORDS words of ``err`` from ERR_PROF + b * PROF_WORDS on: SM cycle stamps at the stage
# boundaries (slot i = after stage i, slot 0 = kernel start), and global-timer readings at start
# and end (slots PROF_GT0, PROF_GT1) to convert cycles to ns.
ERR_PROF = tl.constexpr(EL.ERR_PROF)
PROF_WORDS = tl.constexpr(EL.PROF_WORDS)
PROF_GT0 = tl.constexpr(EL.PROF_WORDS - 2)
PROF_GT1 = tl.constexpr(EL.PROF_WORDS - 1)
PROF_LAST = tl.constexpr(EL.PROF_WORDS - 3)     # the kernel's end

# Stage bits (python ints for the host, constexpr for the kernels).
D_SEND, D_RECV, D_SIGNAL, D_WAIT = 1, 2, 4, 8
DISPATCH_ALL = D_SEND | D_RECV | D_SIGNAL | D_WAIT
DISPATCH_SEND_HALF = D_SEND | D_SIGNAL
DISPATCH_RECV_HALF = D_WAIT | D_RECV
C_WEIGHTS, C_REDUCE, C_SUM, C_SYNC_W, C_SIGNAL_P, C_WAIT_P = 1, 2, 4, 8, 16, 32
COMBINE_ALL = C_WEIGHTS | C_REDUCE | C_SUM | C_SYNC_W | C_SIGNAL_P | C_WAIT_P
COMBINE_SEND_HALF = C_WEIGHTS | C_SYNC_W | C_REDUCE | C_SIGNAL_P
COMBINE_RECV_HALF = C_WAIT_P | C_SUM
# Flag phases of a set and the metadata word, from the layout.
SIG_DISPATCH = tl.constexpr(EL.PHASE_DISPATCH)
SIG_WEIGHTS = tl.constexpr(EL.PHASE_COMBINE_WEIGHTS)
SIG_PARTIALS = tl.constexpr(EL.PHASE_COMBINE_PARTIALS)
SIG_ROWS = tl.constexpr(EL.PHASE_DISPATCH_ROWS)
META_SHIFT = tl.constexpr(EL.META_SHIFT)
META_MASK = tl.constexpr((1 << EL.META_SHIFT) - 1)
LOW32 = tl.constexpr(0xFFFFFFFF)        # LL words (_ll): the epoch above, the data below
FP8_BLOCK = tl.constexpr(EL.FP8_BLOCK)
FP8_MAX = tl.constexpr(448.0)           # largest finite float8_e4m3fn (llcomm/ep_fp8.py)
# fp32 bit fields, and e4m3's exponent bias relative to fp32's (127 - 7)
F32_MANT_BITS = tl.constexpr(23)
F32_MANT_MASK = tl.constexpr(0x7FFFFF)
F32_IMPLICIT = tl.constexpr(1 << 23)
E4M3_REBIAS = tl.constexpr(120)
E4M3_REBIAS_BITS = tl.constexpr(120 << 3)   # the rebias, at e4m3's exponent position
E4M3_DROP = tl.constexpr(20)                # fp32 mantissa bits e4m3 drops (23 - 3)
E4M3_HALF = tl.constexpr((1 << 19) - 1)     # round-half-even bias below the kept bits
E4M3_SUB_SHIFT = tl.constexpr(141)          # 150 - 9: fp32 bias + mantissa bits - 2**-9


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _at(tab, r, byte_off, DTYPE: tl.constexpr):
    """Pointer ``byte_off`` bytes into rank r's EP region, as DTYPE. Every region offset is a
    multiple of 256 and every base is 256-aligned, so the 16-byte claim holds."""
    base = tl.load(tab + r)
    return tl.multiple_of((base + byte_off).to(tl.pointer_type(DTYPE)), 16)


@triton.jit
def _signal(tab, word_idx, word, W: tl.constexpr, WP: tl.constexpr):
    """Store ``word`` at int64 index ``word_idx`` of every rank's EP region (release, system
    scope). Caller issues ``tl.debug_barrier()`` first so the whole block's stores precede it."""
    ps = tl.arange(0, WP)
    live = ps < W
    bases = tl.load(tab + ps, mask=live, other=0)
    ptrs = bases.to(tl.pointer_type(tl.int64)) + word_idx
    tl.atomic_xchg(ptrs, tl.full([WP], 0, tl.int64) + word, mask=live, sem="release", scope="sys")


@triton.jit
def _signal_some(tab, word_idx, word, ranks, W: tl.constexpr, WP: tl.constexpr):
    """``_signal``, to the ranks in the bit mask ``ranks`` only."""
    ps = tl.arange(0, WP)
    live = (ps < W) & (((ranks >> ps) & 1) != 0)
    bases = tl.load(tab + ps, mask=live, other=0)
    ptrs = bases.to(tl.pointer_type(tl.int64)) + word_idx
    tl.atomic_xchg(ptrs, tl.full([WP], 0, tl.int64) + word, mask=live, sem="release", scope="sys")


@triton.jit
def _wait_flags(flags, word, timeout_us, err, op, phase, go,
                N: tl.constexpr, NP: tl.constexpr, W: tl.constexpr,
                skip, MASKS: tl.constexpr, LANES: tl.constexpr):
    """Spin until the ``N`` int64 flags at ``flags`` (laid out ``[N // W][W]``, source rank
    fastest) all equal ``word``; bounded by ``timeout_us``. Polls with volatile loads, then one
    acquire pass over the flags orders the reads that follow. Returns 1, or 0 after writing the
    error word (its mask names the source ranks that were late or disagreed).

    ``go == 0`` (an earlier wait of this op failed) skips the wait and returns 0. Every thread
    reaches the closing barrier either way; callers keep their barriers outside ``if ok`` all
    the same. Each poll's verdict (all arrived / a mismatch / still waiting) and the clock are
    reduced together over BLOCK_WIDE lanes, through shared memory, so the whole block agrees
    and leaves the loop (whose reductions hold barriers) at the same iteration.

    Rank masks (issue 5): flags of the source ranks in the bit mask ``skip`` are not waited for
    (they count as arrived and are never a mismatch). With ``MASKS`` a timeout writes no error
    word: the wait returns ``(1, late)``, ``late`` the bit mask of the ranks that had not
    arrived, for the caller to mask. Otherwise it returns ``(ok, 0)``."""
    # LANES lanes, each polling flag ``lane % NP``. LANES = BLOCK_WIDE: every lane's view goes
    # straight into the block-wide maximum. LANES = NP: fewer words per poll, replicated across
    # warps (each warp has its own view), reduced first, then the block-wide maximum with the
    # clock's BLOCK_WIDE lanes. NP is the default: on 2xH200 its dispatch was about 2 us
    # faster (docs/performance.md, session 4; LLCOMM_EP_WAIT_LANES picks).
    tl.static_assert((NP <= LANES) & (LANES <= BLOCK_WIDE))
    lane = tl.arange(0, LANES)
    i = lane % NP
    live = i < N
    ptrs = flags + i
    src = (i % W).to(tl.int64)
    epoch = word >> EPOCH_SHIFT
    limit_ns = timeout_us.to(tl.int64) * 1000   # i32 microseconds: see launch.py
    t0 = global_time_ns(BLOCK_WIDE)
    status = tl.where((tl.full([], 0, tl.int32) + go) != 0, 0, WAIT_SKIPPED)
    bad = tl.zeros([LANES], tl.int64)
    skipped = ((skip >> src) & 1) != 0         # masks: ranks not waited for
    while status == 0:
        got = tl.load(ptrs, mask=live, other=0, volatile=True)
        waiting = live & (got != word) & (skipped == 0)
        wrong = waiting & ((got >> EPOCH_SHIFT) >= epoch)
        # what each lane saw, above its elapsed ns: the block's maximum is SEEN_WRONG if any
        # lane saw another op's word, SEEN_WAITING if any lane still waits, else 0 (all
        # arrived), with the largest elapsed time below: one verdict for every warp
        seen = tl.where(wrong, SEEN_WRONG, tl.where(waiting, SEEN_WAITING, 0)).to(tl.int64)
        elapsed = tl.maximum(global_time_lanes(BLOCK_WIDE) - t0, 0)
        if LANES == BLOCK_WIDE:
            both = tl.max((seen << SEEN_SHIFT) | elapsed, axis=0)
        else:
            both = tl.max((tl.max(seen, axis=0) << SEEN_SHIFT) | elapsed, axis=0)
        verdict = both >> SEEN_SHIFT
        if verdict == SEEN_WRONG:
            status = STATUS_MISMATCH
            bad = wrong.to(tl.int64)
        elif verdict == 0:
            status = -1
        elif (both & ELAPSED_MASK) > limit_ns:
            status = STATUS_TIMEOUT
            bad = waiting.to(tl.int64)
    # the source ranks that were late or disagreed, by any lane of any warp (shared memory:
    # uniform); only on failure, so success costs no extra round
    bad_ranks = tl.full([], 0, tl.int64)
    if status > 0:
        bad_ranks = tl.reduce(tl.zeros([BLOCK_WIDE], tl.int64)
                              + tl.reduce(bad << src, 0, _bit_or), 0, _bit_or)
    # masks: a timeout masks the late ranks instead of failing the call (begin)
    late = tl.full([], 0, tl.int64)
    if MASKS:
        if status == STATUS_TIMEOUT:
            late = bad_ranks
            status = -1
            skipped = skipped | (((late >> src) & 1) != 0)
    # masks (end)
    ok = status == -1
    if ok:      # one acquire per flag (its first lane)
        tl.atomic_add(ptrs, tl.zeros([LANES], tl.int64),
                      mask=live & (lane < NP) & (skipped == 0), sem="acquire", scope="sys")
    elif status != WAIT_SKIPPED:
        report_error(err, status, op, phase, bad_ranks)
    tl.debug_barrier()
    return ok, late


@triton.jit
def _agree_mask(err, epoch, m):
    """Masks, dispatch: the mask every block of this call uses. The first block to get here
    (after its wait) installs ``m`` with the call's epoch in ``err[ERR_VERDICT]``; every other
    block adopts it. Blocks must agree: the row of a token depends on the counts of every
    source before it, so one block skipping a source another one keeps would misplace rows."""
    key = (epoch & VERDICT_EPOCH) << VERDICT_SHIFT
    cur = tl.atomic_add(err + ERR_VERDICT, tl.full([], 0, tl.int64), sem="relaxed", scope="gpu")
    while (cur >> VERDICT_SHIFT) != (key >> VERDICT_SHIFT):
        old = tl.atomic_cas(err + ERR_VERDICT, cur, key | m, sem="relaxed", scope="gpu")
        cur = tl.where(old == cur, key | m, old)
    return cur & VERDICT_RANKS


@triton.jit
def _stamp(err, i: tl.constexpr, PROFILE: tl.constexpr, KIND: tl.constexpr, NB: tl.constexpr):
    """Profiling: this block's SM cycle count into its slot i (the global timer as well at the
    first and last slot); dispatch (KIND 0) and combine (KIND 1) have NB blocks of slots each.
    Nothing at all without PROFILE."""
    if PROFILE:
        base = err + ERR_PROF + (KIND * NB + tl.program_id(0)) * PROF_WORDS
        if i == 0:
            tl.store(base + PROF_GT0, global_time_ns())
        tl.store(base + i, sm_cycles())
        if i == PROF_LAST:
            tl.store(base + PROF_GT1, global_time_ns())


@triton.jit
def _masked(msk, s):
    """Rank s is in the bit mask ``msk`` (masks; 0 otherwise)."""
    return ((msk >> s) & 1) != 0


@triton.jit
def _first_token(b, s, NB: tl.constexpr, W: tl.constexpr):
    """The first token of source rank s that block b owns after the dispatch's wait (expand,
    and every stage of combine): token t of source s belongs to block ``(t + s * (NB // W)) %
    NB``, so at small token counts the sources' tokens land on different blocks instead of all
    on block 0 (one token per rank: two chains of dependent loads in parallel, not in a row).
    Every stage of combine uses this one rule: block b of a receiver waits only for block b of
    the senders (module doc)."""
    return (b + NB - (s * (NB // W)) % NB) % NB


@triton.jit
def _routed(tile, ids):
    """``[TT, N]``: token row t of ``tile`` (``[TT, KP]``, invalid entries -2) names expert
    ``ids[n]``. A token that lists an expert twice still counts once (it gets one row; combine
    applies both weights); ids of -1 (no expert) match nothing."""
    return tl.max((tile[:, :, None] == ids[None, None, :]).to(tl.int32), axis=1)


@triton.jit
def _rank_bits(row, K: tl.constexpr, E: tl.constexpr, L: tl.constexpr):
    """Bit d set when one of the K expert ids at ``row`` lives on rank d (scalar loads: every
    thread computes the same mask, no reduction across threads)."""
    bits = tl.full([], 0, tl.int64)
    for k in tl.static_range(K):
        e = tl.load(row + k)
        bits = bits | tl.where((e >= 0) & (e < E), tl.full([], 1, tl.int64) << (e // L), 0)
    return bits


@triton.jit
def _e4m3_bits(q):
    """float8_e4m3fn bits (int32, low byte) of fp32 ``q`` with ``|q| <= 448``, rounded to nearest
    even: normal results by adding the rounding bias to the fp32 bits (a carry bumps the
    exponent), subnormal ones (``|q| < 2**-6``) by shifting the significand to units of 2**-9."""
    u = q.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    e = a >> F32_MANT_BITS
    normal = ((a + E4M3_HALF + ((a >> E4M3_DROP) & 1)) >> E4M3_DROP) - E4M3_REBIAS_BITS
    sig = (a & F32_MANT_MASK) | tl.where(e > 0, F32_IMPLICIT, 0)
    # in units of 2**-9 the value is sig * 2**(e - 141); shifts past 25 give 0 anyway
    sh = tl.minimum(E4M3_SUB_SHIFT - e, 25)
    one = tl.full(sh.shape, 1, tl.int32)
    sub = (sig + (one << (sh - 1)) - 1 + ((sig >> sh) & 1)) >> sh
    return tl.where(e > E4M3_REBIAS, normal, sub) | sign


@triton.jit
def _quantize_row(v, HP: tl.constexpr, ROUND: tl.constexpr):
    """fp32 row ``[HP]`` (zeros past H) -> (e4m3 bits as uint8 ``[HP]``, fp32 scales
    ``[HP // 128]``): per 128 channels amax / 448 (1 where amax is 0), optionally rounded up to
    a power of two, then x / scale clamped to +-448 and rounded. IEEE divisions (div_rn)."""
    v2 = tl.reshape(v, (HP // FP8_BLOCK, FP8_BLOCK))
    amax = tl.max(tl.abs(v2), axis=1)
    sc = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, FP8_MAX))
    if ROUND:
        bits = sc.to(tl.int32, bitcast=True)
        ex = (bits >> F32_MANT_BITS) + ((bits & F32_MANT_MASK) != 0).to(tl.int32)
        sc = (ex << F32_MANT_BITS).to(tl.float32, bitcast=True)
    q = tl.math.div_rn(v2, sc[:, None])
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    return tl.reshape(_e4m3_bits(q), (HP,)).to(tl.uint8), sc


@triton.jit
def _ll(epoch, v):
    """LL word: ``epoch`` (the op's, low 32 bits) above the low 32 bits of ``v``. A reader knows
    the word has arrived when its high half is this op's epoch: the data is its own flag."""
    return (epoch.to(tl.int64) << 32) | v.to(tl.int32).to(tl.uint32, bitcast=True).to(tl.int64)


@triton.jit
def _gated(m, ok):
    """Mask ``m``, all false unless the scalar ``ok`` is nonzero (broadcast explicitly: the
    interpreter's bool-and of a tensor with a scalar is not a valid mask)."""
    return m & ((m.to(tl.int32) * 0 + ok) != 0)


@triton.jit
def _poll_ll(ptrs, live, epoch, t0_ns, limit_ns, POLL: tl.constexpr):
    """The LL words at ``ptrs`` (any shape) until every ``live`` one holds ``epoch`` in its high
    half, bounded by ``limit_ns`` from ``t0_ns``. Returns (words, status, waiting): status -1
    when all arrived, else STATUS_TIMEOUT with ``waiting`` marking the words still missing.
    The verdict is block-uniform: each poll's "still waiting" is folded with BLOCK_WIDE clock
    lanes into one maximum through shared memory (as in _wait_flags), so every warp leaves the
    loop together. Without POLL (the CPU interpreter, which has no clock) one read, which must
    find every word."""
    if POLL:
        w = live.to(tl.int64) * 0
        waiting = live
        status = tl.full([], 0, tl.int32)
        while status == 0:
            w = tl.load(ptrs, mask=live, other=0, volatile=True)
            waiting = live & (((w >> 32) & LOW32) != epoch)
            elapsed = tl.maximum(global_time_lanes(BLOCK_WIDE) - t0_ns, 0)
            both = tl.max((tl.max(waiting.to(tl.int64), axis=None) << SEEN_SHIFT) | elapsed,
                          axis=0)
            if (both >> SEEN_SHIFT) == 0:
                status = -1
            elif (both & ELAPSED_MASK) > limit_ns:
                status = STATUS_TIMEOUT
    else:
        w = tl.load(ptrs, mask=live, other=0)
        waiting = live & (((w >> 32) & LOW32) != epoch)
        status = tl.where(tl.max(waiting.to(tl.int32), axis=None) > 0, STATUS_TIMEOUT, -1)
    return w, status, waiting


@triton.jit
def _push_rows(x, topk, n_tok, tab, rank, set_off, t_first, T: tl.constexpr, H: tl.constexpr,
               HP: tl.constexpr, K: tl.constexpr, E: tl.constexpr, L: tl.constexpr,
               W: tl.constexpr, NB: tl.constexpr, OFF_X: tl.constexpr,
               FP8: tl.constexpr, NS: tl.constexpr, OFF_SC: tl.constexpr,
               DESTS: tl.constexpr, STAGED: tl.constexpr = 0):
    """This block's token rows (``t_first``, then every NB-th) once per destination rank
    (which ranks: a bit mask from scalar loads), into the source's slot ``rank * T + t``
    there; FP8 quantises here, once. DESTS: 0 every rank the token goes to; 1 (OWN_X) not this
    one (its own rows expand from x); 2 this one only (a row block's first pass); 3 this one,
    every token, routed there or not (an FP8 row block's first pass). STAGED (FP8): the
    quantised rows are read back from this rank's slots (a DESTS 3 pass of this block
    stored them) instead of quantising x again."""
    DT = x.dtype.element_ty
    hs = tl.arange(0, HP)
    hm = hs < H
    for t in range(t_first, n_tok, NB):
        bits = _rank_bits(topk + t * K, K, E, L)
        if DESTS == 1:
            bits = bits & ~(tl.full([], 1, tl.int64) << rank)
        if DESTS == 2:
            bits = bits & (tl.full([], 1, tl.int64) << rank)
        if DESTS == 3:
            bits = tl.full([], 1, tl.int64) << rank
        slot = rank * T + t
        if FP8:
            ns = tl.arange(0, HP // FP8_BLOCK)
            if STAGED:
                qb = tl.load(_at(tab, rank, set_off + OFF_X, tl.uint8) + slot * H + hs, mask=hm)
                sc = tl.load(_at(tab, rank, set_off + OFF_SC, tl.float32) + slot * NS + ns,
                             mask=ns < NS)
            else:
                # quantised once here, on the sender: e4m3 bytes and scales cross NVLink
                v = tl.load(x + t * H + hs, mask=hm, other=0.0).to(tl.float32)
                qb, sc = _quantize_row(v, HP, FP8 == 2)
            for d in tl.static_range(W):
                if (bits >> d) & 1:
                    qp = _at(tab, d, set_off + OFF_X, tl.uint8) + slot * H
                    tl.store(qp + hs, qb, mask=hm)
                    sp = _at(tab, d, set_off + OFF_SC, tl.float32) + slot * NS
                    tl.store(sp + ns, sc, mask=ns < NS)
        else:
            v = tl.load(x + t * H + hs, mask=hm)
            for d in tl.static_range(W):
                if (bits >> d) & 1:
                    xp = _at(tab, d, set_off + OFF_X, DT) + slot * H
                    tl.store(xp + hs, v, mask=hm)


@triton.jit
def _scan_tiles(topk, n_tok, tab, rank, set_off, ids, T: tl.constexpr, K: tl.constexpr,
                KP: tl.constexpr, E: tl.constexpr, L: tl.constexpr, W: tl.constexpr,
                EB: tl.constexpr, TT: tl.constexpr, MAX_TOPK: tl.constexpr,
                OFF_META: tl.constexpr, META: tl.constexpr):
    """The top-k scan of ``_send``, TT tokens per tile: for this block's experts ``ids``, the
    tokens routed to each (returned: counts ``[EB]``, and the out-of-range entries seen), and
    (META) each entry's metadata word stored into the rank that holds its expert."""
    ks = tl.arange(0, KP)
    kmask = ks < K
    cnt = tl.zeros([EB], tl.int32)                  # tokens so far routed to each own expert
    nbad = tl.full([], 0, tl.int32)
    for t0 in range(0, n_tok, TT):
        ts = t0 + tl.arange(0, TT)
        m2 = (ts < n_tok)[:, None] & kmask[None, :]
        tile = tl.load(topk + ts[:, None] * K + ks[None, :], mask=m2, other=-1)
        nbad += tl.sum(tl.sum((m2 & ((tile < -1) | (tile >= E))).to(tl.int32), axis=1), axis=0)
        tile = tl.where((tile >= 0) & (tile < E), tile, -2).to(tl.int32)
        routed = _routed(tile, ids)                                     # [TT, EB]
        if META:
            pre = cnt[None, :] + tl.cumsum(routed, axis=0) - routed     # exclusive, + carry
            # each entry naming an own expert (at most one of them): its metadata word, stored
            # into the one rank that holds the expert
            hit = tile[:, :, None] == ids[None, None, :]                # [TT, KP, EB]
            word = ((ids - (ids // L) * L) << META_SHIFT)[None, :] | pre    # [TT, EB]
            meta = tl.sum(tl.where(hit, word[:, None, :], 0), axis=2)   # [TT, KP]
            mine = tl.max(hit.to(tl.int32), axis=2) > 0
            dv = tile // L
            for d in tl.static_range(W):
                mp = (_at(tab, d, set_off + OFF_META, tl.int32)
                      + (rank * T + ts[:, None]) * MAX_TOPK)
                tl.store(mp + ks[None, :], meta, mask=m2 & mine & (dv == d))
        cnt += tl.sum(routed, axis=0)
    return cnt, nbad


@triton.jit
def _push_counts(topk, n_tok, tab, err, rank, set_off, epoch, T: tl.constexpr, K: tl.constexpr,
                 KP: tl.constexpr, E: tl.constexpr, L: tl.constexpr, W: tl.constexpr,
                 NB: tl.constexpr, EB: tl.constexpr, TT: tl.constexpr, TS: tl.constexpr,
                 MAX_TOPK: tl.constexpr, OFF_META: tl.constexpr, OFF_CNT: tl.constexpr,
                 META: tl.constexpr):
    """Dispatch stage 1: block b counts the tokens routed to each of its experts ``b + NB * i``
    and pushes the counts as LL words (epoch | count) into slot (rank, local expert) of the
    expert's rank; with META the same scan stores each entry's metadata word (``_send``).
    Out-of-range ids count as -1 and are reported by block 0, which saw every token."""
    b = tl.program_id(0)
    es = b + NB * tl.arange(0, EB)
    emask = es < E
    ids = tl.where(emask, es, -1)                   # -1 matches no entry
    # one tile of TS tokens when that covers them all (decode at small batch: the compare and
    # the cumulative sum of a 128-token tile cost 0.7 us more at 1 token, session 9)
    if n_tok <= TS:
        cnt, nbad = _scan_tiles(topk, n_tok, tab, rank, set_off, ids, T, K, KP, E, L, W, EB,
                                TS, MAX_TOPK, OFF_META, META)
    else:
        cnt, nbad = _scan_tiles(topk, n_tok, tab, rank, set_off, ids, T, K, KP, E, L, W, EB,
                                TT, MAX_TOPK, OFF_META, META)
    dst = es // L
    cbase = tl.load(tab + dst, mask=emask, other=0)
    cptr = (cbase + set_off + OFF_CNT).to(tl.pointer_type(tl.int64)) + rank * L + (es - dst * L)
    tl.store(cptr, _ll(epoch, cnt), mask=emask)     # LL: read before any flag covers them
    if b == 0:
        if nbad > 0:
            tl.store(tl.load(err + 2).to(tl.pointer_type(tl.int64)), nbad.to(tl.int64))


@triton.jit
def _push_ntok(n_tok, tab, rank, set_off, W: tl.constexpr, WP: tl.constexpr,
               OFF_NTOK: tl.constexpr):
    """This rank's token count into slot ``rank`` of every rank's ntok region."""
    ps = tl.arange(0, WP)
    nbase = tl.load(tab + ps, mask=ps < W, other=0)
    nptr = (nbase + set_off + OFF_NTOK).to(tl.pointer_type(tl.int32)) + rank
    tl.store(nptr, tl.full([WP], 0, tl.int32) + n_tok, mask=ps < W)


@triton.jit
def _send(x, topk, n_tok, tab, err, rank, set_off, epoch,
          T: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, K: tl.constexpr,
          KP: tl.constexpr, E: tl.constexpr, L: tl.constexpr, W: tl.constexpr,
          WP: tl.constexpr, NB: tl.constexpr, EB: tl.constexpr, TT: tl.constexpr,
          TS: tl.constexpr, JP: tl.constexpr, MAX_TOPK: tl.constexpr, OFF_X: tl.constexpr,
          OFF_META: tl.constexpr, OFF_CNT: tl.constexpr, OFF_NTOK: tl.constexpr,
          FP8: tl.constexpr, NS: tl.constexpr, OFF_SC: tl.constexpr, ROWS_FIRST: tl.constexpr,
          OWN_X: tl.constexpr, PROFILE: tl.constexpr):
    """Dispatch stages 1 and 2: counts, token rows and metadata pushed to their ranks.

    ROWS_FIRST: the rows go out before the scan (their destinations need only the token's own
    top-k), so they cross NVLink while the block scans; the release before the signal then
    waits for less. Otherwise they go out last, after the counts and the metadata.

    Block b owns experts ``b + NB * i`` (counts, and the metadata of every top-k entry that
    names one of them) and tokens ``b + NB * j`` (rows, and the -1 metadata of their entries
    for every other rank). One scan over this rank's top-k rows, a tile of TT tokens at a time,
    marks which tokens route to each own expert; an exclusive running sum of those marks is the
    prefix (earlier tokens routed to the same expert) that fixes each entry's row on the
    receiver, and its total is the count. The compare tile is ``[TT, KP, EB]``: the work does
    not grow with the tokens a block owns (a ``[TT, KP, JP * KP]`` token-owner form took 167 us
    at 512 tokens when the buffer held 512, session 5).
    """
    b = tl.program_id(0)
    if ROWS_FIRST:
        _push_rows(x, topk, n_tok, tab, rank, set_off, b, T, H, HP, K, E, L, W, NB, OFF_X, FP8,
                   NS, OFF_SC, OWN_X)
        _stamp(err, 1, PROFILE, 0, NB)  # rows pushed (issued; they land during the scan)
    _push_counts(topk, n_tok, tab, err, rank, set_off, epoch, T, K, KP, E, L, W, NB, EB, TT, TS,
                 MAX_TOPK, OFF_META, OFF_CNT, 1)
    if not ROWS_FIRST:
        _stamp(err, 1, PROFILE, 0, NB)  # top-k scan done
    if b == 0:
        _push_ntok(n_tok, tab, rank, set_off, W, WP, OFF_NTOK)

    # 2. -1 metadata of this block's tokens' entries for every rank that does not hold their
    #    expert (invalid entries: every rank); the expert's own rank got its word in the scan
    ks = tl.arange(0, KP)
    kmask = ks < K
    mt = b + NB * tl.arange(0, JP)
    live2 = (mt < n_tok)[:, None] & kmask[None, :]
    own = tl.load(topk + mt[:, None] * K + ks[None, :], mask=live2, other=-1)
    dv2 = tl.where((own >= 0) & (own < E), own // L, -1)
    for d in tl.static_range(W):
        mp = _at(tab, d, set_off + OFF_META, tl.int32) + (rank * T + mt[:, None]) * MAX_TOPK
        tl.store(mp + ks[None, :], tl.full([JP, KP], -1, tl.int32), mask=live2 & (dv2 != d))
    if not ROWS_FIRST:
        _push_rows(x, topk, n_tok, tab, rank, set_off, b, T, H, HP, K, E, L, W, NB, OFF_X, FP8,
                   NS, OFF_SC, OWN_X)


@triton.jit
def _token_meta(topk, t, E: tl.constexpr, L: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                TP: tl.constexpr):
    """Blockwise dispatch: the metadata words of token t's top-k entries, computed by the block
    that sends t. Entry k naming expert e gets ``(e's local index << META_SHIFT) | prefix``,
    prefix = the earlier tokens of this rank routed to e (a token counts once, as in
    ``_routed``), from a ``[TP, KP, KP]`` compare per tile of earlier tokens; invalid entries get
    -1. Returns the words and each entry's rank (-1 for none)."""
    ks = tl.arange(0, KP)
    kmask = ks < K
    ids = tl.load(topk + t * K + ks, mask=kmask, other=-1)
    valid = kmask & (ids >= 0) & (ids < E)
    ids = tl.where(valid, ids, -1).to(tl.int32)     # -1 matches no tile entry (those are -2)
    pre = tl.zeros([KP], tl.int32)
    for t0 in range(0, t, TP):
        ts = t0 + tl.arange(0, TP)
        m2 = (ts < t)[:, None] & kmask[None, :]
        tile = tl.load(topk + ts[:, None] * K + ks[None, :], mask=m2, other=-1)
        tile = tl.where((tile >= 0) & (tile < E), tile, -2).to(tl.int32)
        pre += tl.sum(_routed(tile, ids), axis=0)
    meta = tl.where(valid, ((ids - (ids // L) * L) << META_SHIFT) | pre, -1)
    return meta, tl.where(valid, ids // L, -1)


@triton.jit
def _send_blockwise(x, topk, n_tok, tab, err, rank, set_off, epoch,
                    T: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, K: tl.constexpr,
                    KP: tl.constexpr, E: tl.constexpr, L: tl.constexpr, W: tl.constexpr,
                    WP: tl.constexpr, NB: tl.constexpr, EB: tl.constexpr, TT: tl.constexpr,
                    TS: tl.constexpr, TP: tl.constexpr, MAX_TOPK: tl.constexpr,
                    OFF_X: tl.constexpr, OFF_META: tl.constexpr, OFF_CNT: tl.constexpr,
                    OFF_NTOK: tl.constexpr, FP8: tl.constexpr, NS: tl.constexpr,
                    OFF_SC: tl.constexpr, ROWS_FIRST: tl.constexpr, OWN_X: tl.constexpr,
                    PROFILE: tl.constexpr, ROWS: tl.constexpr):
    """Blockwise dispatch (BLOCKWISE), stages 1 and 2. Block b sends everything block b of a
    receiver needs for the pairs it expands (``_first_token``: tokens ``_first_token(b, rank)
    + NB * j``): their rows, their metadata words (prefixes computed here per token,
    ``_token_meta``, to every rank, -1 where the rank holds none of the entry's expert; to this
    rank too, where its own expand reads them back) and this rank's token count, all released
    by block b's signal, so the receiver's block b waits for one flag per source, not for
    every block. The counts (``_push_counts``, expert-owner blocks) travel as LL words.
    ROWS_FIRST: rows, metadata, counts; otherwise counts, metadata, rows. ROWS = 0: no rows
    (row blocks push them, ``_row_block``)."""
    b = tl.program_id(0)
    first = _first_token(b, rank, NB, W)
    if ROWS_FIRST and ROWS:
        _push_rows(x, topk, n_tok, tab, rank, set_off, first, T, H, HP, K, E, L, W, NB, OFF_X,
                   FP8, NS, OFF_SC, OWN_X)
        _stamp(err, 1, PROFILE, 0, NB)  # rows pushed (issued)
    else:
        # every small remote store ahead of the rows: a block's stores behind its rows wait
        # for them to cross (session 10: metadata behind the rows took 7.6 us at 128 tokens)
        _push_counts(topk, n_tok, tab, err, rank, set_off, epoch, T, K, KP, E, L, W, NB, EB, TT,
                     TS, MAX_TOPK, OFF_META, OFF_CNT, 0)
        _stamp(err, 1, PROFILE, 0, NB)  # counts pushed
    ks = tl.arange(0, KP)
    kmask = ks < K
    for t in range(first, n_tok, NB):
        meta, dv = _token_meta(topk, t, E, L, K, KP, TP)
        for d in tl.static_range(W):
            mp = _at(tab, d, set_off + OFF_META, tl.int32) + (rank * T + t) * MAX_TOPK
            tl.store(mp + ks, tl.where(dv == d, meta, -1), mask=kmask)
    _push_ntok(n_tok, tab, rank, set_off, W, WP, OFF_NTOK)
    if ROWS_FIRST and ROWS:
        _push_counts(topk, n_tok, tab, err, rank, set_off, epoch, T, K, KP, E, L, W, NB, EB, TT,
                     TS, MAX_TOPK, OFF_META, OFF_CNT, 0)
    elif ROWS:
        _push_rows(x, topk, n_tok, tab, rank, set_off, first, T, H, HP, K, E, L, W, NB, OFF_X,
                   FP8, NS, OFF_SC, OWN_X)


@triton.jit
def _counts(ptrs, live, ok, s, err, epoch, t0_ns, limit_ns, LLCNT: tl.constexpr,
            POLL: tl.constexpr):
    """The counts of source s at ``ptrs`` (int32, 0 where not ``live``), and ok (0 after a
    failed poll, reported). LLCNT: LL words polled until they hold this op's epoch (no flag
    covers them); otherwise plain loads after the wait that covered them."""
    if LLCNT:
        c, st, _ = _poll_ll(ptrs, _gated(live, ok), epoch, t0_ns, limit_ns, POLL)
        if st != -1:
            report_error(err, st, OP_DISPATCH, PHASE_DATA, tl.full([], 1, tl.int64) << s)
            ok = ok * 0
    else:
        c = tl.load(ptrs, mask=live, other=0)
    return c.to(tl.int32), ok                   # the count: the LL word's low half


@triton.jit
def _expand_source(s, n_s, ok, x, recv_x, recv_scales, row_of, src_info, tab, err, rank,
                   set_off, msk, epoch, t0_ns, limit_ns, T: tl.constexpr, H: tl.constexpr,
                   HP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, L: tl.constexpr,
                   W: tl.constexpr, NB: tl.constexpr, MAX_TOPK: tl.constexpr,
                   OFF_X: tl.constexpr, OFF_META: tl.constexpr, OFF_CNT: tl.constexpr,
                   FP8: tl.constexpr, NS: tl.constexpr, NSP: tl.constexpr,
                   OFF_SC: tl.constexpr, FROM_X: tl.constexpr, LLCNT: tl.constexpr,
                   POLL: tl.constexpr):
    """Dispatch stage D_RECV for source s: each pair (s, t) this block owns (``_first_token``)
    into the per-expert layout. Sources in the bit mask ``msk`` count as having sent nothing.
    FROM_X: s is this rank and the row comes from x (FP8: quantised again, the bytes the peers
    got), not from its receive slot. LLCNT (blockwise): the counts of the earlier sources are
    polled as LL words (no flag covers them); otherwise the dispatch's wait covered them. The
    metadata must be visible already (a wait, or this block wrote it). Returns ok (0 after a
    failed poll, already reported)."""
    b = tl.program_id(0)
    DT = recv_x.dtype.element_ty
    hs = tl.arange(0, HP)
    hm = hs < H
    cntp = _at(tab, rank, set_off + OFF_CNT, tl.int64)
    metap = _at(tab, rank, set_off + OFF_META, tl.int32)
    xp = _at(tab, rank, set_off + OFF_X, DT)
    scp = _at(tab, rank, set_off + OFF_SC, tl.float32)
    ns = tl.arange(0, NSP)
    nsm = ns < NS
    ks = tl.arange(0, KP)
    kmask = ks < K
    earlier = ks[None, :] < ks[:, None]         # [k, i]: entry i comes before entry k
    for t in range(_first_token(b, s, NB, W), n_s * ok, NB):
        slot = s * T + t
        # the row first: its address needs no metadata, so its load overlaps the metadata's
        # (a token reaches a rank only when one of its experts is there: the row is used)
        if FROM_X:
            if FP8:
                v, sv = _quantize_row(tl.load(x + t * H + hs, mask=hm, other=0.0).to(tl.float32),
                                      HP, FP8 == 2)
            else:
                v = tl.load(x + t * H + hs, mask=hm)
        else:
            v = tl.load(xp + slot * H + hs, mask=hm)
            if FP8:
                sv = tl.load(scp + slot * NS + ns, mask=nsm)
        # the pair's top-k entries as one vector: every load of a pair is issued at once
        # (a chain of scalar loads per entry cost ~0.3 us each, the slope of the dispatch)
        m = tl.load(metap + slot * MAX_TOPK + ks, mask=kmask, other=-1)
        valid = m >= 0
        first = valid & (tl.max(((m[:, None] == m[None, :]) & earlier).to(tl.int32),
                                axis=1) == 0)
        le = tl.maximum(m, 0) >> META_SHIFT
        row = m & META_MASK
        for s2 in range(s):
            if not _masked(msk, s2):
                c, ok = _counts(cntp + s2 * L + le, valid, ok, s2, err, epoch, t0_ns, limit_ns,
                                LLCNT, POLL)
                row += c
        flat = le * (W * T) + row
        if ok != 0:
            tl.store(row_of + slot * K + ks, tl.where(valid, flat, -1), mask=kmask)
            tl.store(src_info + flat, tl.full([KP], 0, tl.int32) + slot, mask=first)
            for k in tl.static_range(K):
                pick = ks == k
                if tl.sum((pick & first).to(tl.int32), axis=0) > 0:
                    flat_k = tl.sum(tl.where(pick, flat, 0), axis=0).to(tl.int64)
                    tl.store(recv_x + flat_k * H + hs, v, mask=hm)
                    if FP8:
                        tl.store(recv_scales + flat_k * NS + ns, sv, mask=nsm)
    return ok


@triton.jit
def _expand(x, recv_x, recv_scales, row_of, src_info, recv_count, ntok_out, tab, err, rank,
            set_off, msk, epoch, t0_ns, limit_ns, T: tl.constexpr, H: tl.constexpr,
            HP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, L: tl.constexpr, LB: tl.constexpr,
            W: tl.constexpr, WP: tl.constexpr, NB: tl.constexpr, MAX_TOPK: tl.constexpr,
            OFF_X: tl.constexpr, OFF_META: tl.constexpr, OFF_CNT: tl.constexpr,
            OFF_NTOK: tl.constexpr, FP8: tl.constexpr, NS: tl.constexpr, NSP: tl.constexpr,
            OFF_SC: tl.constexpr, OWN_DONE: tl.constexpr, LLCNT: tl.constexpr,
            POLL: tl.constexpr):
    """Dispatch stage D_RECV: this rank's receive slots into the per-expert layout (FP8: recv_x
    is the uint8 view of the e4m3 output, and the scales are copied alongside), every source
    but this rank when its own pairs were expanded before the wait (OWN_DONE). Sources in the
    bit mask ``msk`` (masked ranks) count as having sent nothing: no rows, no counts. LLCNT:
    the counts are polled as LL words (_expand_source). Returns ok (0 after a failed poll)."""
    b = tl.program_id(0)
    cntp = _at(tab, rank, set_off + OFF_CNT, tl.int64)
    ntp = _at(tab, rank, set_off + OFF_NTOK, tl.int32)
    ps = tl.arange(0, WP)
    # tokens each source sent, loaded once (masked sources: none)
    nts = tl.where(_masked(msk, ps), 0, tl.load(ntp + ps, mask=ps < W, other=0))
    ok = tl.full([], 1, tl.int32)
    if b == NB - 1:     # the last block: at small token counts it owns no pair
        for l0 in range(0, L, LB):
            ls = l0 + tl.arange(0, LB)
            lm = ls < L
            tot = tl.zeros([LB], tl.int32)
            for s in range(W):
                if not _masked(msk, s):
                    c, ok = _counts(cntp + s * L + ls, lm, ok, s, err, epoch, t0_ns, limit_ns,
                                    LLCNT, POLL)
                    tot += c
            tl.store(recv_count + ls, tot, mask=lm)
        tl.store(ntok_out + ps, nts, mask=ps < W)
    for s in range(W):
        if (OWN_DONE == 0) | (s != rank):
            n_s = tl.sum(tl.where(ps == s, nts, 0), axis=0)
            ok = _expand_source(s, n_s, ok, x, recv_x, recv_scales, row_of, src_info, tab, err,
                                rank, set_off, msk, epoch, t0_ns, limit_ns, T, H, HP, K, KP, L,
                                W, NB, MAX_TOPK, OFF_X, OFF_META, OFF_CNT, FP8, NS, NSP, OFF_SC,
                                0, LLCNT, POLL)
    return ok


@triton.jit
def _row_block(x, topk, n_tok, tab, ctrl, err, rank, tag, T: tl.constexpr, H: tl.constexpr,
               HP: tl.constexpr, K: tl.constexpr, E: tl.constexpr, L: tl.constexpr,
               W: tl.constexpr, WP: tl.constexpr, NB: tl.constexpr, NR: tl.constexpr,
               SET_BYTES: tl.constexpr, OFF_SIG: tl.constexpr, OFF_X: tl.constexpr,
               FP8: tl.constexpr, NS: tl.constexpr, OFF_SC: tl.constexpr,
               STAGES: tl.constexpr, OWN_X: tl.constexpr, PROFILE: tl.constexpr):
    """Split dispatch (NR row blocks, the grid's last NR): row block r pushes the token rows of
    work blocks ``w = r, r + NR, ...`` (each w's tokens, ``_first_token(w, rank, NB - NR)``)
    and releases them with flag ``[rows][w][rank]`` on every rank. A block's stores queue
    behind its remote rows (session 10), so the work blocks (counts, metadata, expand) leave
    the rows to these. Unless OWN_X, this rank's own rows go first, into its own slots, with
    the own flag released before any remote row is issued: the own expand waits for that flag
    only. Its counter lives in ``ctrl[NB - NR + r]``."""
    NBW: tl.constexpr = NB - NR
    pid = tl.program_id(0)
    r = pid - NBW
    seq = tl.load(ctrl + pid)
    set_off = (seq % 2) * SET_BYTES
    word = ((seq + 1) << EPOCH_SHIFT) | tag
    rows0 = (set_off + OFF_SIG) // 8 + SIG_ROWS * NB * W + rank    # + w * W: flag [rows][w][rank]
    me = tl.full([], 1, tl.int64) << rank
    peers = ((tl.full([], 1, tl.int64) << W) - 1) & ~me
    if STAGES & 1:
        if not OWN_X:   # FP8: every token's row, quantised once (the peers' pass reads it back)
            for w in range(r, NBW, NR):
                _push_rows(x, topk, n_tok, tab, rank, set_off, _first_token(w, rank, NBW, W), T,
                           H, HP, K, E, L, W, NBW, OFF_X, FP8, NS, OFF_SC, 3 if FP8 else 2)
    if STAGES & 4:
        tl.debug_barrier()
        for w in range(r, NBW, NR):     # the own flags (first, before the rows go out)
            _signal_some(tab, rows0 + w * W, word, me, W, WP)
    _stamp(err, 1, PROFILE, 0, NB)
    if STAGES & 1:
        tl.debug_barrier()      # the first pass's rows, read back by other threads (FP8)
        for w in range(r, NBW, NR):
            _push_rows(x, topk, n_tok, tab, rank, set_off, _first_token(w, rank, NBW, W), T, H,
                       HP, K, E, L, W, NBW, OFF_X, FP8, NS, OFF_SC, 1,
                       (FP8 != 0) & (OWN_X == 0))
    _stamp(err, 2, PROFILE, 0, NB)
    if STAGES & 4:
        tl.debug_barrier()
        for w in range(r, NBW, NR):
            _signal_some(tab, rows0 + w * W, word, peers, W, WP)
    _stamp(err, 3, PROFILE, 0, NB)
    _stamp(err, 4, PROFILE, 0, NB)      # no wait: the timeline's stage 4 is empty
    if STAGES & 2:
        tl.store(ctrl + pid, seq + 1)


@triton.jit(do_not_specialize=EP_RANK_VARYING)
def dispatch_kernel(
        x,              # [n_tok, H] this rank's tokens (buffer dtype)
        topk,           # [n_tok, K] int64 global expert ids, -1 = none
        n_tok,          # tokens of this rank (<= T)
        recv_x,         # [L, W * T, H] output (FP8: its uint8 view)
        recv_scales,    # [L, W * T, NS] fp32 output (FP8 only; any pointer otherwise)
        row_of,         # [W, T, K] int32 handle: flat row e * W * T + row of (s, t, k), or -1
        src_info,       # [L, W * T] int32 handle: s * T + t of each row
        recv_count,     # [L] int32 output
        ntok_out,       # [W] int32 handle: tokens each source sent
        tab,            # [W] int64: every rank's EP region base address
        ctrl,           # [NB] int64: dispatch counter of each block
        err,            # [3] int64: device error word, host error address, host input-error address
        rank, tag, timeout_us,
        wts,            # [n_tok, K] fp32 top-k weights (CARRY only; any pointer otherwise)
        w_off,          # CARRY: byte offset of the handle slot's weights region, every rank
        T: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,     # max tokens, hidden, pow2(hidden)
        K: tl.constexpr, KP: tl.constexpr,                      # top-k and pow2(top-k)
        E: tl.constexpr, L: tl.constexpr, LB: tl.constexpr,     # experts, local experts, chunk
        W: tl.constexpr, WP: tl.constexpr, NB: tl.constexpr,    # ranks, pow2(W), grid
        EB: tl.constexpr,               # pow2(ceil(E / NB)): experts counted per block
        TT: tl.constexpr,               # tokens per top-k tile in the count / prefix scan
        TS: tl.constexpr,               # the scan's one tile when n_tok <= TS (small batches)
        JP: tl.constexpr,               # pow2(ceil(T / NB)): tokens per block at most
        FP: tl.constexpr,               # pow2(NB * W): flags polled by the dispatch wait
        MAX_TOPK: tl.constexpr,         # metadata slot stride (ep_layout.MAX_TOPK)
        SET_BYTES: tl.constexpr, OFF_SIG: tl.constexpr, OFF_X: tl.constexpr,   # layout, bytes
        OFF_META: tl.constexpr, OFF_CNT: tl.constexpr, OFF_NTOK: tl.constexpr,
        FP8: tl.constexpr,              # 0: buffer dtype; 1: e4m3 + scales; 2: pow2 scales
        NS: tl.constexpr, NSP: tl.constexpr,    # scales per row (H // 128, or 1), pow2(NS)
        OFF_SC: tl.constexpr,           # layout: FP8 scales, bytes
        STAGES: tl.constexpr,           # D_SEND | D_SIGNAL | D_WAIT | D_RECV bits
        MASKS: tl.constexpr,            # 1: rank masks (err[ERR_MASK]); module doc
        LANES: tl.constexpr,            # lanes of each wait's poll (_wait_flags)
        ROWS_FIRST: tl.constexpr,       # 1: rows pushed before the top-k scan (_send)
        OWN_X: tl.constexpr = 0,        # blockwise: own rows not sent to self but read from x
        BLOCKWISE: tl.constexpr = 0,    # 1: block b waits for block b of each source only
        TP: tl.constexpr = 128,         # BLOCKWISE: earlier tokens per prefix tile (_token_meta)
        OWN_PRESIGNAL: tl.constexpr = 1,    # BLOCKWISE: own pairs before the signal, not after
        NR: tl.constexpr = 0,           # BLOCKWISE: the grid's last NR blocks push the rows
        PROFILE: tl.constexpr = 0,      # 1: stage stamps into err (ERR_PROF; _stamp)
        CARRY: tl.constexpr = 0,        # 1: the top-k weights travel too (module doc)
        PDL: tl.constexpr = 0):  # launched with PDL (_sync.after_previous_kernel)
    after_previous_kernel(PDL)
    b = tl.program_id(0)
    NBW: tl.constexpr = NB - NR         # work blocks: all of them unless row blocks split off
    tl.static_assert((NR == 0) | ((BLOCKWISE != 0) & (MASKS == 0)))
    if (NR > 0) and (b >= NBW):
        _stamp(err, 0, PROFILE, 0, NB)
        _row_block(x, topk, n_tok, tab, ctrl, err, rank, tag, T, H, HP, K, E, L, W, WP, NB, NR,
                   SET_BYTES, OFF_SIG, OFF_X, FP8, NS, OFF_SC, STAGES, OWN_X, PROFILE)
        _stamp(err, PROF_LAST, PROFILE, 0, NB)
    else:
        _stamp(err, 0, PROFILE, 0, NB)
        timeout_us = wait_bound_us(timeout_us, err)     # short once this rank has failed
        seq = tl.load(ctrl + b)
        set_off = (seq % 2) * SET_BYTES
        word = ((seq + 1) << EPOCH_SHIFT) | tag
        epoch = (seq + 1) & LOW32               # of the LL count words
        POLL: tl.constexpr = (STAGES & 8) != 0     # D_WAIT: on the GPU, waits read the clock
        # blockwise without masks: own pairs before the wait (with masks the wait decides first
        # which sources count, and own rows land after the counts of the earlier ones)
        OWN_FIRST: tl.constexpr = (BLOCKWISE != 0) & (MASKS == 0)
        tl.static_assert((OWN_X == 0) | OWN_FIRST)    # own rows from x: only when expanded first
        limit_ns = timeout_us.to(tl.int64) * 1000
        t0_ns = tl.full([], 0, tl.int64)
        if POLL:
            t0_ns = global_time_ns(BLOCK_WIDE)
        msk = tl.full([], 0, tl.int64)     # ranks treated as absent (masks only)
        if MASKS:
            msk = tl.load(err + ERR_MASK, volatile=True)
        ok = tl.full([], 1, tl.int32)
        flags = _at(tab, rank, set_off + OFF_SIG, tl.int64) + SIG_DISPATCH * NB * W
        rflags = _at(tab, rank, set_off + OFF_SIG, tl.int64) + (SIG_ROWS * NB + b) * W
        # the flags a wait polls: every (block, source), or (blockwise) block b's of each source
        NF: tl.constexpr = W if BLOCKWISE else NB * W
        NFP: tl.constexpr = WP if BLOCKWISE else FP
        WL: tl.constexpr = (WP if LANES < BLOCK_WIDE else BLOCK_WIDE) if BLOCKWISE else LANES
        if BLOCKWISE:
            flags += b * W
        peers = ((tl.full([], 1, tl.int64) << W) - 1) & ~(tl.full([], 1, tl.int64) << rank)
        if STAGES & 1:
            if CARRY:       # released with the rows by this dispatch's signal
                _push_weights(wts, n_tok, tab, rank, w_off, T, K, KP, W, NBW, MAX_TOPK, 0)
            if BLOCKWISE:
                _send_blockwise(x, topk, n_tok, tab, err, rank, set_off, epoch, T, H, HP, K, KP, E,
                                L, W, WP, NBW, EB, TT, TS, TP, MAX_TOPK, OFF_X, OFF_META, OFF_CNT,
                                OFF_NTOK, FP8, NS, OFF_SC, ROWS_FIRST, OWN_X, PROFILE, NR == 0)
            else:
                _send(x, topk, n_tok, tab, err, rank, set_off, epoch, T, H, HP, K, KP, E, L, W, WP,
                      NB, EB, TT, TS, JP, MAX_TOPK, OFF_X, OFF_META, OFF_CNT, OFF_NTOK, FP8, NS,
                      OFF_SC, ROWS_FIRST, OWN_X, PROFILE)
        # phase 0 ends with stamp 2, phase 1 (the signal) with stamp 3; blockwise, the own pairs
        # go into one of them (OWN_PRESIGNAL: 0, while the rows cross NVLink; else 1, after the
        # signal): this block wrote their metadata (and their rows, unless they come from x), the
        # counts are LL words
        for phase in tl.static_range(2):
            if phase == 1:
                if STAGES & 4:      # D_SIGNAL
                    tl.debug_barrier()
                    _signal(tab, (set_off + OFF_SIG) // 8 + (SIG_DISPATCH * NB + b) * W + rank,
                            word, W, WP)
            if (STAGES & 2) and OWN_FIRST and (phase == 1 - OWN_PRESIGNAL):
                tl.debug_barrier()          # rows and metadata stored by the block's other threads
                if (NR > 0) and (OWN_X == 0) and POLL:  # own rows from a row block: its own flag
                    okr, _ = _wait_flags(rflags, word, timeout_us, err, OP_DISPATCH,
                                         PHASE_ENTRY, 1, W, WP, W, peers, 0, WL)
                    ok = ok & okr.to(tl.int32)
                ok = _expand_source(rank, n_tok, ok, x, recv_x, recv_scales, row_of, src_info,
                                    tab, err, rank, set_off, msk, epoch, t0_ns, limit_ns, T, H,
                                    HP, K, KP, L, W, NBW, MAX_TOPK, OFF_X, OFF_META, OFF_CNT, FP8,
                                    NS, NSP, OFF_SC, OWN_X, 1, POLL)
            _stamp(err, 2 + phase, PROFILE, 0, NB)
        if STAGES & 8:      # D_WAIT
            okw, late = _wait_flags(flags, word, timeout_us, err, OP_DISPATCH, PHASE_ENTRY, 1, NF,
                                    NFP, W, msk, MASKS, WL)
            if NR > 0:      # and the rows, from the row blocks
                okr, _ = _wait_flags(rflags, word, timeout_us, err, OP_DISPATCH, PHASE_ENTRY, okw,
                                     W, WP, W, msk, 0, WL)
                okw = okw & okr
            if MASKS:
                agreed = _agree_mask(err, seq + 1, msk | late)
                # a rank late here but seen by the deciding block has arrived: wait for it again
                # (uniform condition; an error if it does not come)
                need = (late & ~agreed) != 0
                ok2, _ = _wait_flags(flags, word, timeout_us, err, OP_DISPATCH, PHASE_ENTRY, need,
                                     NF, NFP, W, agreed, 0, WL)
                okw = okw & (ok2 | (need == 0))
                if agreed != msk:
                    tl.atomic_or(err + ERR_MASK, agreed, sem="relaxed", scope="gpu")
                msk = agreed
            ok = ok & okw.to(tl.int32)
            _stamp(err, 4, PROFILE, 0, NB)
        if STAGES & 2:      # D_RECV
            if ok != 0:
                _expand(x, recv_x, recv_scales, row_of, src_info, recv_count, ntok_out, tab, err,
                        rank, set_off, msk, epoch, t0_ns, limit_ns, T, H, HP, K, KP, L, LB, W, WP,
                        NBW, MAX_TOPK, OFF_X, OFF_META, OFF_CNT, OFF_NTOK, FP8, NS, NSP, OFF_SC,
                        OWN_FIRST, BLOCKWISE, POLL)
            tl.store(ctrl + b, seq + 1)
        _stamp(err, PROF_LAST, PROFILE, 0, NB)


@triton.jit
def _push_weights(wts, n_tok, tab, rank, set_off, T: tl.constexpr, K: tl.constexpr,
                  KP: tl.constexpr, W: tl.constexpr, NB: tl.constexpr, MAX_TOPK: tl.constexpr,
                  OFF_CW: tl.constexpr):
    """Combine stage A (or the dispatch with CARRY): this rank's top-k weights into slot
    (rank, t) of the weights region at byte ``set_off + OFF_CW`` of every rank."""
    b = tl.program_id(0)
    ks = tl.arange(0, KP)
    kmask = ks < K
    for t in range(_first_token(b, rank, NB, W), n_tok, NB):
        w = tl.load(wts + t * K + ks, mask=kmask, other=0.0)
        for d in tl.static_range(W):
            wp = _at(tab, d, set_off + OFF_CW, tl.float32) + (rank * T + t) * MAX_TOPK
            tl.store(wp + ks, w, mask=kmask)


@triton.jit
def _reduce_pair(eo, rows, wp, pp, H: tl.constexpr, HP: tl.constexpr, K: tl.constexpr):
    """One received pair: its local experts' outputs (rows ``rows[k]`` of ``eo``, -1 for none)
    weighted by ``wp[k]`` and summed in k order in fp32, rounded once, stored at ``pp``. The
    rows and weights are 2 K scalar loads with known addresses, issued together: no block-wide
    reduction (a barrier each) to pick entries out of a vector, no load whose address waits for
    another. A pair with no local expert stores nothing."""
    hs = tl.arange(0, HP)
    hm = hs < H
    any_row = tl.full([], -1, tl.int32)
    for k in tl.static_range(K):
        any_row = tl.maximum(any_row, tl.load(rows + k))
    if any_row >= 0:
        acc = tl.zeros([HP], tl.float32)
        for k in tl.static_range(K):
            r_k = tl.load(rows + k)
            w_k = tl.load(wp + k)
            # no branch around the load: every entry's row is requested at once
            y = tl.load(eo + tl.maximum(r_k, 0).to(tl.int64) * H + hs,
                        mask=hm & ((hs * 0 + r_k) >= 0), other=0.0).to(tl.float32)
            acc = tl.where(r_k >= 0, acc + w_k * y, acc)
        tl.store(pp + hs, acc.to(pp.dtype.element_ty), mask=hm)


@triton.jit
def _reduce_partials(eo, row_of, ntok_in, tab, rank, set_off, w_at, msk, T: tl.constexpr,
                     H: tl.constexpr, HP: tl.constexpr, K: tl.constexpr, W: tl.constexpr,
                     WP: tl.constexpr, NB: tl.constexpr, MAX_TOPK: tl.constexpr,
                     OFF_CX: tl.constexpr):
    """Combine stage B: per received pair (s, t), its local experts' outputs weighted and summed
    in k order in fp32, rounded once, pushed into slot (rank, t) of rank s. The weights are read
    from this rank's region at byte ``w_at``. Sources in the bit mask ``msk`` (masked ranks) are
    skipped: their weights may not have come.

    Order (session 6): rank 0 went own-first and took 11.3 us here at 128 tokens, rank 1 (peer
    first) 9.3 us (tools/ep_timeline.py).

    (Reducing this rank's own pairs before the weights wait, with the weights from the caller's
    ``wts``, was measured in session 5: no faster, 19.4-19.5 -> 20.1 us at 128 tokens.)"""
    b = tl.program_id(0)
    eo_dt = eo.dtype.element_ty
    wl = _at(tab, rank, w_at, tl.float32)
    ps = tl.arange(0, WP)
    nts = tl.where(_masked(msk, ps), 0, tl.load(ntok_in + ps, mask=ps < W, other=0))
    for i in range(W):
        # peers first, this rank's own pairs last: their partials cross NVLink while the own
        # pairs are reduced (the release before the signal waits for them to land)
        s = (rank + 1 + i) % W
        n_s = tl.sum(tl.where(ps == s, nts, 0), axis=0)
        cx = _at(tab, s, set_off + OFF_CX, eo_dt)
        for t in range(_first_token(b, s, NB, W), n_s, NB):
            _reduce_pair(eo, row_of + (s * T + t) * K, wl + (s * T + t) * MAX_TOPK,
                         cx + (rank * T + t) * H, H, HP, K)


@triton.jit
def _sum_partials(topk, n_tok, out, tab, rank, set_off, msk, T: tl.constexpr, H: tl.constexpr,
                  HP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, E: tl.constexpr,
                  L: tl.constexpr, W: tl.constexpr, NB: tl.constexpr, OFF_CX: tl.constexpr):
    """Combine stage C: each own token's partials, from the ranks it went to, in rank order.
    Partials of ranks in the bit mask ``msk`` (masked ranks) are skipped (count as zero); a
    token routed to masked ranks only gets zeros."""
    b = tl.program_id(0)
    DT = out.dtype.element_ty
    hs = tl.arange(0, HP)
    hm = hs < H
    cl = _at(tab, rank, set_off + OFF_CX, DT)
    for t in range(_first_token(b, rank, NB, W), n_tok, NB):
        bits = _rank_bits(topk + t * K, K, E, L)
        acc = tl.zeros([HP], tl.float32)
        for d in tl.static_range(W):
            wd = (bits >> d) & 1 & ~(msk >> d)
            went = wd != 0
            p = tl.load(cl + (d * T + t) * H + hs, mask=hm & ((hs * 0 + wd) != 0),
                        other=0.0).to(tl.float32)
            acc = tl.where(went, acc + p, acc)
        tl.store(out + t * H + hs, acc.to(DT), mask=hm)


@triton.jit(do_not_specialize=EP_RANK_VARYING)
def combine_kernel(
        eo,             # [L, W * T, H] expert outputs (buffer dtype)
        topk,           # [n_tok, K] int64, as given to the dispatch
        wts,            # [n_tok, K] fp32 top-k weights (not CARRIED; any pointer otherwise)
        n_tok,          # tokens of this rank (the dispatch's)
        out,            # [n_tok, H] output
        row_of,         # [W, T, K] int32 from the dispatch's handle
        ntok_in,        # [W] int32 from the dispatch's handle
        tab,            # [W] int64: every rank's EP region base address
        ctrl,           # [NB] int64: combine counter of each block
        err,            # [3] int64: see dispatch_kernel
        rank, tag, timeout_us,
        w_off,          # CARRIED: byte offset of the handle slot's weights region (this rank)
        T: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, K: tl.constexpr,
        KP: tl.constexpr, E: tl.constexpr, L: tl.constexpr,
        W: tl.constexpr, WP: tl.constexpr, NB: tl.constexpr, MAX_TOPK: tl.constexpr,
        SET_BYTES: tl.constexpr, OFF_SIG: tl.constexpr, OFF_CX: tl.constexpr,
        OFF_CW: tl.constexpr,
        STAGES: tl.constexpr,           # C_* bits (module doc)
        MASKS: tl.constexpr,            # 1: rank masks (err[ERR_MASK]); module doc
        LANES: tl.constexpr,            # lanes of each wait's poll (_wait_flags)
        PROFILE: tl.constexpr = 0,      # 1: stage stamps into err (ERR_PROF; _stamp)
        CARRIED: tl.constexpr = 0,      # 1: the dispatch carried the weights (module doc)
        PDL: tl.constexpr = 0):  # launched with PDL (_sync.after_previous_kernel)
    after_previous_kernel(PDL)
    b = tl.program_id(0)
    _stamp(err, 0, PROFILE, 1, NB)
    timeout_us = wait_bound_us(timeout_us, err)     # short once this rank has failed
    seq = tl.load(ctrl + b)
    set_off = (seq % 2) * SET_BYTES
    word = ((seq + 1) << EPOCH_SHIFT) | tag
    sig0 = (set_off + OFF_SIG) // 8
    flags = _at(tab, rank, set_off + OFF_SIG, tl.int64)
    if STAGES & 1:
        if not CARRIED:
            _push_weights(wts, n_tok, tab, rank, set_off, T, K, KP, W, NB, MAX_TOPK, OFF_CW)
        _stamp(err, 1, PROFILE, 1, NB)  # weights pushed
    msk = tl.full([], 0, tl.int64)     # ranks treated as absent (masks only)
    if MASKS:
        msk = tl.load(err + ERR_MASK, volatile=True)
    ok = 1
    if (STAGES & 8) and not CARRIED:    # C_SYNC_W (the dispatch's signal carried them)
        tl.debug_barrier()
        _signal(tab, sig0 + (SIG_WEIGHTS * NB + b) * W + rank, word, W, WP)
        ok, late = _wait_flags(flags + (SIG_WEIGHTS * NB + b) * W, word, timeout_us, err,
                               OP_COMBINE, PHASE_ENTRY, 1, W, WP, W, msk, MASKS, LANES)
        if MASKS:       # per block: block b's tokens depend on block b's wait only
            if late != 0:
                tl.atomic_or(err + ERR_MASK, late, sem="relaxed", scope="gpu")
            msk = msk | late
        _stamp(err, 2, PROFILE, 1, NB)  # weights of every rank arrived
    if STAGES & 2:      # C_REDUCE
        if ok:
            w_at = set_off + OFF_CW
            if CARRIED:
                w_at = w_off
            _reduce_partials(eo, row_of, ntok_in, tab, rank, set_off, w_at, msk, T, H, HP, K, W,
                             WP, NB, MAX_TOPK, OFF_CX)
    if STAGES & 16:     # C_SIGNAL_P
        tl.debug_barrier()              # outside ``if ok``: see _wait_flags
        if ok:
            _signal(tab, sig0 + (SIG_PARTIALS * NB + b) * W + rank, word, W, WP)
        _stamp(err, 3, PROFILE, 1, NB)  # partials reduced, pushed and signalled
    if STAGES & 32:     # C_WAIT_P (in a recv-half launch ok is 1: the send half's failure, if
        #                 any, is already in the error word and this wait then times out too)
        ok, late = _wait_flags(flags + (SIG_PARTIALS * NB + b) * W, word, timeout_us, err,
                               OP_COMBINE, PHASE_EXIT, ok, W, WP, W, msk, MASKS, LANES)
        if MASKS:
            if late != 0:
                tl.atomic_or(err + ERR_MASK, late, sem="relaxed", scope="gpu")
            msk = msk | late
        _stamp(err, 4, PROFILE, 1, NB)  # partials of every rank arrived
    if STAGES & 4:      # C_SUM
        if ok:
            _sum_partials(topk, n_tok, out, tab, rank, set_off, msk, T, H, HP, K, KP, E, L, W,
                          NB, OFF_CX)
        tl.store(ctrl + b, seq + 1)
    _stamp(err, PROF_LAST, PROFILE, 1, NB)

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
    sender (``_quantize_row``, the arithmetic of ``llcomm/ep/fp8.py``) and pushes ``H`` bytes of
    e4m3 plus ``H // 128`` fp32 scales: half the NVLink bytes of bf16. Stage 4 copies bytes and
    scales. The fp32 -> e4m3 rounding is done on the bits (``_e4m3_bits``), byte-equal to
    torch's ``.to(torch.float8_e4m3fn)`` on the GPU and under ``TRITON_INTERPRET=1`` (whose own
    fp8 cast does not round to nearest even). The LL dispatch rounds with the GPU's
    ``cvt.rn.satfinite`` in inline PTX instead (``E4M3_ASM``; byte-equal to torch's cast in the
    FP8 GPU tests, and faster); Triton's own cast was not byte-equal on the GPU machine.

``dispatch_kernel`` with ``LL`` = 1 (the LL dispatch; docs/ep.md "Scheme")
    The same stages 1, 2 and 4 without the signal and the wait: metadata, counts, the token
    count (with 15 tag bits) and carried weights are LL words ``(epoch << 32) | value``; rows
    are int32 words in slots armed with ROW_SENTINEL (a row word equal to it is sent as
    ROW_ESCAPE). ``_expand_ll`` waits for each word where it reads it (``_lamport._poll``, one
    block-wide verdict per poll, bounded by the timeout), copies, and arms the row slot again.
    No fence and no flag: the data is its own flag. Two sets suffice because every receiver
    waits for every source's token-count word of the call, which the source writes only after
    its previous call (and its re-arming) ended. Needs MASKS = 0.

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

from ...runtime.kernels.lamport import _pending, _poll, limit_ticks
from ...runtime.kernels.sync import (EPOCH_SHIFT, RANK_VARYING, after_previous_kernel, global_time_lanes,
                    global_time_ns, report_error, sm_cycles, wait_bound_us)
from .. import layout as EL
from ...runtime import protocol as P

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

# LL dispatch (LL = 1; module doc): a row word that has not arrived, and what a row word equal
# to it is sent as instead (both NaNs in every float format; e4m3 bytes 0xFF / 0x7F are NaN).
ROW_SENTINEL = tl.constexpr(-1)             # 0xFFFFFFFF, the armed state (ep_layout.ARM_BYTE)
ROW_ESCAPE = tl.constexpr(0x7FFFFFFF)
LL_HI = tl.constexpr(32)                    # an LL word's epoch sits above bit 32
NTOK_BITS = tl.constexpr(17)                # the ntok word: tag bits above the token count
NTOK_MASK = tl.constexpr((1 << 17) - 1)     # (at most MAX_TOKENS_LIMIT = 2**16 tokens)
NTOK_TAG_MASK = tl.constexpr((1 << 15) - 1)
LL_LOW = tl.constexpr(0xFFFFFFFF)           # an LL word's value bits

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
META_SHIFT = tl.constexpr(EL.META_SHIFT)
META_MASK = tl.constexpr((1 << EL.META_SHIFT) - 1)
FP8_BLOCK = tl.constexpr(EL.FP8_BLOCK)
FP8_MAX = tl.constexpr(448.0)           # largest finite float8_e4m3fn (llcomm/ep/fp8.py)
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


#: fp32 -> e4m3 by the GPU's convert, round to nearest even, four values to one register (byte
#: i from operand i: ``cvt`` puts its first operand in the high byte of a pair).
E4M3X4_PTX = tl.constexpr("""{
    .reg .b16 lo, hi;
    cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
    cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
    mov.b32 $0, {lo, hi};
}""")


#: ``_div_by``'s remainder argument needs every scale to be at least this: then an element whose
#: quotient reaches e4m3's rounding range (2**-11 and up) is at least 2**-100, so the remainder
#: ``x - s * q`` is a normal fp32 number and exact; smaller quotients round to 0 in e4m3
#: whatever their last fp32 bits.
RCP_MIN_SCALE = tl.constexpr(2.0 ** -89)
#: A block whose scale is below RCP_MIN_SCALE is divided as ``(x * RCP_LIFT) / (s * RCP_LIFT)``:
#: both products are exact (a power of two; no overflow, since ``|x| <= 448 s``), the quotient
#: is the same, and the lifted scale is above 2**-78: the smallest scale the quantiser makes is
#: the smallest bf16 amax over 448, about 2**-141.8.
RCP_LIFT = tl.constexpr(2.0 ** 64)


@triton.jit
def _div_by(v2, sc):
    """``v2 / sc[:, None]`` rounded once, as IEEE division (div_rn) rounds it, without a
    division per element: ``r = 1 / s`` once per scale (div_rn), ``q = x * r``, then one
    correction by the exact remainder ``fma(-s, q, x)``: ``fma(rem, r, q)`` (the refinement of
    the GPU's own div.rn fast path, with a correctly rounded reciprocal). Blocks with a scale
    below RCP_MIN_SCALE are lifted by RCP_LIFT first, block by block: no branch and no
    reduction across the block's warps (session 12 had a uniform branch to div_rn on the
    row's smallest scale, whose reduction went through shared memory and a barrier)."""
    lift = tl.where(sc < RCP_MIN_SCALE, RCP_LIFT, 1.0)
    s = sc * lift
    v = v2 * lift[:, None]
    r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)[:, None]
    q = v * r
    rem = tl.fma(-s[:, None] + tl.zeros_like(q), q, v)
    # an exact q stays as it is: fma(+0, r, -0) would turn a -0 quotient into +0
    return tl.where(rem == 0, q, tl.fma(rem, r, q))


@triton.jit
def _fp8_scales(v2, ROUND: tl.constexpr):
    """Scales of the 128-channel blocks ``v2`` ``[HP // 128, 128]``: amax / 448 (1 where amax
    is 0), ROUND: rounded up to a power of two (on the bits, as llcomm/ep/fp8.py)."""
    amax = tl.max(tl.abs(v2), axis=1)
    sc = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, FP8_MAX))
    if ROUND:
        bits = sc.to(tl.int32, bitcast=True)
        ex = (bits >> F32_MANT_BITS) + ((bits & F32_MANT_MASK) != 0).to(tl.int32)
        sc = (ex << F32_MANT_BITS).to(tl.float32, bitcast=True)
    return sc


@triton.jit
def _e4m3_clamped(q):
    """``_e4m3_bits`` of ``q`` clamped to +-448 (the low byte; the rest zero)."""
    return _e4m3_bits(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)) & 0xFF


@triton.jit
def _quantize_row(v, HP: tl.constexpr, ROUND: tl.constexpr):
    """fp32 row ``[HP]`` (zeros past H) -> (e4m3 bits as uint8 ``[HP]``, fp32 scales
    ``[HP // 128]``): ``_fp8_scales``, then x / scale (div_rn) clamped to +-448 and rounded on
    the bits (``_e4m3_bits``). The flag dispatch's quantiser; the LL one is ``_pack_row_fp8``.
    (Triton's own fp32 -> float8e4nv cast gave bytes that differ from torch's cast on the GPU
    machine: session 11, reverted.)"""
    v2 = tl.reshape(v, (HP // FP8_BLOCK, FP8_BLOCK))
    sc = _fp8_scales(v2, ROUND)
    return tl.reshape(_e4m3_clamped(tl.math.div_rn(v2, sc[:, None])), (HP,)).to(tl.uint8), sc


@triton.jit
def _pack_row_fp8(v, HP: tl.constexpr, HPW: tl.constexpr, ROUND: tl.constexpr,
                  ASM: tl.constexpr, RCP: tl.constexpr):
    """LL dispatch, FP8: fp32 row ``v`` ``[HP]`` -> (its e4m3 bytes packed four to an int32 word
    ``[HPW]``, its scales' bits ``[HP // 128]``), both as ``_row_words`` sends them; the
    arithmetic of ``_quantize_row``. RCP: the divisions by ``_div_by`` (same quotients). ASM:
    the GPU's ``cvt.rn.satfinite`` (E4M3X4_PTX) turns four quotients into one word, no clamp
    (every quotient is within an ulp of +-448 at most, and satfinite saturates there as the
    clamp would); the interpreter cannot run it. On one H200 the quantiser alone takes 1.5 us
    per 7168-channel row this way, 3.0 with a division per element and the bytes packed after
    the convert (tools/ep_fp8_micro.py, session 12)."""
    v2 = tl.reshape(v, (HP // FP8_BLOCK, FP8_BLOCK))
    sc = _fp8_scales(v2, ROUND)
    if RCP:
        q = _div_by(v2, sc)
    else:
        q = tl.math.div_rn(v2, sc[:, None])
    # the four quotients of each word, in byte order, in registers: element 4w + 2j + i is
    # [w, j, i], and a split takes the last axis (i) apart
    even, odd = tl.split(tl.reshape(q, (HPW, 2, 2)))        # [w, j] of i = 0 and i = 1
    e0, e2 = tl.split(even)
    e1, e3 = tl.split(odd)
    if ASM:
        words = tl.inline_asm_elementwise(E4M3X4_PTX, "=r,f,f,f,f", [e0, e1, e2, e3],
                                          dtype=tl.int32, is_pure=True, pack=1)
    else:
        words = (_e4m3_clamped(e0) | (_e4m3_clamped(e1) << 8) | (_e4m3_clamped(e2) << 16)
                 | (_e4m3_clamped(e3) << 24))
    return _row_words(words), _row_words(sc.to(tl.int32, bitcast=True))


@triton.jit
def _ll_word(ehi, v):
    """LL word: the epoch bits ``ehi`` above the 32 bits of ``v`` (int32 or fp32)."""
    return ehi | v.to(tl.uint32, bitcast=True).to(tl.int64)


@triton.jit
def _row_words(v):
    """int32 row words as the LL dispatch sends them: ROW_SENTINEL goes as ROW_ESCAPE."""
    return tl.where(v == ROW_SENTINEL, ROW_ESCAPE, v)


@triton.jit
def _ll_row(x, t, H: tl.constexpr, HP: tl.constexpr, FP8: tl.constexpr,
            RW: tl.constexpr, HPW: tl.constexpr, E4M3_ASM: tl.constexpr, FP8_RCP: tl.constexpr):
    """LL dispatch: token t's row as the RW int32 words it crosses NVLink as (``_row_words``;
    FP8: e4m3 bytes packed four to a word, ``_pack_row_fp8``), and its FP8 scales' words
    (a dummy without FP8)."""
    ws = tl.arange(0, HPW)
    if FP8:
        hs = tl.arange(0, HP)
        v = tl.load(x + t * H + hs, mask=hs < H, other=0.0)
        words, sw = _pack_row_fp8(v.to(tl.float32), HP, HPW, FP8 == 2, E4M3_ASM, FP8_RCP)
    else:
        words = _row_words(tl.load(x.to(tl.pointer_type(tl.int32)) + t * RW + ws, mask=ws < RW))
        sw = tl.zeros([1], tl.int32)
    return words, sw


@triton.jit
def _push_rows_ll(words, sw, bits, tab, set_off, slot, HP: tl.constexpr, W: tl.constexpr,
                  OFF_X: tl.constexpr, FP8: tl.constexpr, NS: tl.constexpr,
                  OFF_SC: tl.constexpr, RW: tl.constexpr, HPW: tl.constexpr):
    """LL dispatch: a row's words (``_ll_row``), which are their own flag, to the ranks in
    ``bits``; FP8: then its scales."""
    ws = tl.arange(0, HPW)
    for d in tl.static_range(W):
        if (bits >> d) & 1:
            tl.store(_at(tab, d, set_off + OFF_X, tl.int32) + slot * RW + ws, words, mask=ws < RW)
            if FP8:
                ns = tl.arange(0, HP // FP8_BLOCK)
                tl.store(_at(tab, d, set_off + OFF_SC, tl.int32) + slot * NS + ns, sw,
                         mask=ns < NS)


@triton.jit
def _push_rows(x, topk, n_tok, tab, rank, set_off, T: tl.constexpr, H: tl.constexpr,
               HP: tl.constexpr, K: tl.constexpr, E: tl.constexpr, L: tl.constexpr,
               W: tl.constexpr, NB: tl.constexpr, JP: tl.constexpr, OFF_X: tl.constexpr,
               FP8: tl.constexpr, NS: tl.constexpr, OFF_SC: tl.constexpr,
               LL: tl.constexpr = 0, RW: tl.constexpr = 1, HPW: tl.constexpr = 1,
               E4M3_ASM: tl.constexpr = 0, FP8_RCP: tl.constexpr = 0,
               SKIP_OWN: tl.constexpr = 0):
    """Each of this block's token rows once per destination rank (which ranks: a bit mask from
    scalar loads), into the source's slot ``rank * T + t`` there; FP8 quantises here, once.
    SKIP_OWN: not to this rank itself (its expand reads the row from x)."""
    b = tl.program_id(0)
    DT = x.dtype.element_ty
    hs = tl.arange(0, HP)
    hm = hs < H
    for j in range(0, JP):
        t = b + NB * j
        if t < n_tok:
            bits = _rank_bits(topk + t * K, K, E, L)
            if SKIP_OWN:
                bits = bits & ~(tl.full([], 1, tl.int64) << rank)
            slot = rank * T + t
            if LL:
                words, sw = _ll_row(x, t, H, HP, FP8, RW, HPW, E4M3_ASM, FP8_RCP)
                _push_rows_ll(words, sw, bits, tab, set_off, slot, HP, W, OFF_X, FP8, NS, OFF_SC,
                              RW, HPW)
            elif FP8:
                # quantised once here, on the sender: e4m3 bytes and scales cross NVLink
                v = tl.load(x + t * H + hs, mask=hm, other=0.0).to(tl.float32)
                qb, sc = _quantize_row(v, HP, FP8 == 2)
                ns = tl.arange(0, HP // FP8_BLOCK)
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
def _scan_tiles(topk, n_tok, tab, rank, set_off, ids, ehi, T: tl.constexpr, K: tl.constexpr,
                KP: tl.constexpr, E: tl.constexpr, L: tl.constexpr, W: tl.constexpr,
                EB: tl.constexpr, TT: tl.constexpr, MAX_TOPK: tl.constexpr,
                OFF_META: tl.constexpr, LL: tl.constexpr):
    """The top-k scan of ``_send``, TT tokens per tile: for this block's experts ``ids``, the
    tokens routed to each (returned: counts ``[EB]``, and the out-of-range entries seen), and
    each entry's metadata word stored into the rank that holds its expert.

    One own expert at a time, in the tile's own ``[TT, KP]`` layout: its hits, the tokens
    routed to it (a max over the entries), their exclusive running sum over the tokens and
    the metadata words, broadcast back over the entries. (A ``[TT, KP, EB]`` compare of every
    expert at once made Triton move the tile and the words between layouts through shared
    memory five times a tile.)"""
    ks = tl.arange(0, KP)
    kmask = ks < K
    eix = tl.arange(0, EB)
    cnt = tl.zeros([EB], tl.int32)                  # tokens so far routed to each own expert
    nbad = tl.full([], 0, tl.int32)
    for t0 in range(0, n_tok, TT):
        ts = t0 + tl.arange(0, TT)
        m2 = (ts < n_tok)[:, None] & kmask[None, :]
        tile = tl.load(topk + ts[:, None] * K + ks[None, :], mask=m2, other=-1)
        nbad += tl.sum(tl.sum((m2 & ((tile < -1) | (tile >= E))).to(tl.int32), axis=1), axis=0)
        tile = tl.where((tile >= 0) & (tile < E), tile, -2).to(tl.int32)
        # each entry naming an own expert (at most one of them): its metadata word, stored
        # into the one rank that holds the expert
        meta = tl.zeros([TT, KP], tl.int32)
        mine = tl.zeros([TT, KP], tl.int32)
        for i in tl.static_range(EB):
            e = tl.sum(tl.where(eix == i, ids, 0), axis=0)              # -1: no expert
            hit = (tile == e).to(tl.int32)                              # [TT, KP]
            routed = tl.max(hit, axis=1)        # [TT]: a token listing e twice gets one row
            before = tl.sum(tl.where(eix == i, cnt, 0), axis=0)        # earlier tiles
            pre = before + tl.cumsum(routed, axis=0) - routed           # exclusive
            cnt += tl.where(eix == i, tl.sum(routed, axis=0), 0)
            word = ((e - (e // L) * L) << META_SHIFT) | pre             # [TT]
            meta += hit * word[:, None]
            mine += hit
        dv = tile // L
        for d in tl.static_range(W):
            _store_meta(tab, d, set_off, (rank * T + ts[:, None]) * MAX_TOPK + ks[None, :], meta,
                        m2 & (mine > 0) & (dv == d), ehi, OFF_META, LL)
    return cnt, nbad


@triton.jit
def _store_words(base, idx, v, m, ehi, LL: tl.constexpr):
    """int32 values ``v`` at word ``idx`` from byte address ``base`` (a region's address, one
    per lane or for all): plain int32 words, or (LL) LL words with the epoch bits ``ehi``
    (metadata, counts and token counts, which the region holds in 8 bytes either way)."""
    if LL:
        tl.store(base.to(tl.pointer_type(tl.int64)) + idx, _ll_word(ehi, v), mask=m)
    else:
        tl.store(base.to(tl.pointer_type(tl.int32)) + idx, v, mask=m)


@triton.jit
def _store_meta(tab, d, set_off, idx, v, m, ehi, OFF: tl.constexpr, LL: tl.constexpr):
    """``_store_words`` into the region at byte OFF of rank d, through ``_at``'s aligned typed
    pointer: written as ``_store_words`` on the byte address, the dispatch's PTX grew by about
    110 lines (checked with ``tools/ptx_ep.py --same-as``)."""
    if LL:
        tl.store(_at(tab, d, set_off + OFF, tl.int64) + idx, _ll_word(ehi, v), mask=m)
    else:
        tl.store(_at(tab, d, set_off + OFF, tl.int32) + idx, v, mask=m)


@triton.jit
def _send(x, topk, n_tok, tab, err, rank, set_off,
          T: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, K: tl.constexpr,
          KP: tl.constexpr, E: tl.constexpr, L: tl.constexpr, W: tl.constexpr,
          WP: tl.constexpr, NB: tl.constexpr, EB: tl.constexpr, TT: tl.constexpr,
          TS: tl.constexpr, JP: tl.constexpr, MAX_TOPK: tl.constexpr, OFF_X: tl.constexpr,
          OFF_META: tl.constexpr, OFF_CNT: tl.constexpr, OFF_NTOK: tl.constexpr,
          FP8: tl.constexpr, NS: tl.constexpr, OFF_SC: tl.constexpr, ROWS_FIRST: tl.constexpr,
          PROFILE: tl.constexpr, ehi, tag, LL: tl.constexpr, RW: tl.constexpr,
          HPW: tl.constexpr, E4M3_ASM: tl.constexpr, FP8_RCP: tl.constexpr,
          SKIP_OWN: tl.constexpr):
    """Dispatch stages 1 and 2: counts, token rows and metadata pushed to their ranks.

    ROWS_FIRST: the rows go out before the scan (their destinations need only the token's own
    top-k), so they cross NVLink while the block scans; the release before the signal then
    waits for less. Otherwise they go out last, after the counts and the metadata.

    Block b owns experts ``b + NB * i`` (counts, and the metadata of every top-k entry that
    names one of them) and tokens ``b + NB * j`` (rows, and the -1 metadata of their entries
    for every other rank). One scan over this rank's top-k rows, a tile of TT tokens at a time,
    marks which tokens route to each own expert; an exclusive running sum of those marks is the
    prefix (earlier tokens routed to the same expert) that fixes each entry's row on the
    receiver, and its total is the count. The compare is ``[TT, KP]`` once per own expert
    (``_scan_tiles``): the work does not grow with the tokens a block owns (a ``[TT, KP, JP *
    KP]`` token-owner form took 167 us at 512 tokens when the buffer held 512, session 5).
    """
    b = tl.program_id(0)
    if ROWS_FIRST:
        _push_rows(x, topk, n_tok, tab, rank, set_off, T, H, HP, K, E, L, W, NB, JP, OFF_X, FP8,
                   NS, OFF_SC, LL, RW, HPW, E4M3_ASM, FP8_RCP, SKIP_OWN)
        _stamp(err, 1, PROFILE, 0, NB)  # rows pushed (issued; they land during the scan)
    ks = tl.arange(0, KP)
    kmask = ks < K
    es = b + NB * tl.arange(0, EB)
    emask = es < E
    ids = tl.where(emask, es, -1)                   # -1 matches no entry
    # one tile of TS tokens when that covers them all (decode at small batch: the compare and
    # the cumulative sum of a 128-token tile cost 0.7 us more at 1 token, session 9)
    if n_tok <= TS:
        cnt, nbad = _scan_tiles(topk, n_tok, tab, rank, set_off, ids, ehi, T, K, KP, E, L, W,
                                EB, TS, MAX_TOPK, OFF_META, LL)
    else:
        cnt, nbad = _scan_tiles(topk, n_tok, tab, rank, set_off, ids, ehi, T, K, KP, E, L, W,
                                EB, TT, MAX_TOPK, OFF_META, LL)
    if not ROWS_FIRST:
        _stamp(err, 1, PROFILE, 0, NB)  # top-k scan done

    # 1. counts of experts b + NB * i, into slot (rank, local expert) of the expert's rank;
    #    out-of-range ids count as -1 and are reported (block 0 saw every token).
    dst = es // L
    cbase = tl.load(tab + dst, mask=emask, other=0) + set_off + OFF_CNT
    _store_words(cbase, rank * L + (es - dst * L), cnt, emask, ehi, LL)
    if b == 0:
        if nbad > 0:
            tl.store(tl.load(err + 2).to(tl.pointer_type(tl.int64)), nbad.to(tl.int64))
        ps = tl.arange(0, WP)
        nbase = tl.load(tab + ps, mask=ps < W, other=0) + set_off + OFF_NTOK
        nval = n_tok
        if LL:      # the call's tag rides with the count: receivers check it (mismatches)
            nval = (((tag & NTOK_TAG_MASK) << NTOK_BITS) | n_tok).to(tl.int32)
        _store_words(nbase, rank, tl.full([WP], 0, tl.int32) + nval, ps < W, ehi, LL)

    # 2. -1 metadata of this block's tokens' entries for every rank that does not hold their
    #    expert (invalid entries: every rank); the expert's own rank got its word in the scan
    mt = b + NB * tl.arange(0, JP)
    live2 = (mt < n_tok)[:, None] & kmask[None, :]
    own = tl.load(topk + mt[:, None] * K + ks[None, :], mask=live2, other=-1)
    dv2 = tl.where((own >= 0) & (own < E), own // L, -1)
    for d in tl.static_range(W):
        _store_meta(tab, d, set_off, (rank * T + mt[:, None]) * MAX_TOPK + ks[None, :],
                    tl.full([JP, KP], -1, tl.int32), live2 & (dv2 != d), ehi, OFF_META, LL)
    if not ROWS_FIRST:
        _push_rows(x, topk, n_tok, tab, rank, set_off, T, H, HP, K, E, L, W, NB, JP, OFF_X, FP8,
                   NS, OFF_SC, LL, RW, HPW, E4M3_ASM, FP8_RCP, SKIP_OWN)


@triton.jit
def _first_entries(m, valid, earlier):
    """Entries of a pair's metadata words ``m`` that are valid and name their local expert for
    the first time (``earlier[k, i]``: entry i comes before entry k): one row per expert."""
    return valid & (tl.max(((m[:, None] == m[None, :]) & earlier).to(tl.int32), axis=1) == 0)


@triton.jit
def _expand(recv_x, recv_scales, row_of, src_info, recv_count, ntok_out, tab, rank, set_off,
            msk, T: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, K: tl.constexpr,
            KP: tl.constexpr, L: tl.constexpr, LB: tl.constexpr, W: tl.constexpr,
            WP: tl.constexpr, NB: tl.constexpr, MAX_TOPK: tl.constexpr, OFF_X: tl.constexpr,
            OFF_META: tl.constexpr, OFF_CNT: tl.constexpr, OFF_NTOK: tl.constexpr,
            FP8: tl.constexpr, NS: tl.constexpr, NSP: tl.constexpr, OFF_SC: tl.constexpr):
    """Dispatch stage 3: this rank's receive slots into the per-expert layout (FP8: recv_x
    is the uint8 view of the e4m3 output, and the scales are copied alongside). Sources in the
    bit mask ``msk`` (masked ranks) count as having sent nothing: no rows, no counts."""
    b = tl.program_id(0)
    DT = recv_x.dtype.element_ty
    hs = tl.arange(0, HP)
    hm = hs < H
    cntp = _at(tab, rank, set_off + OFF_CNT, tl.int32)
    ntp = _at(tab, rank, set_off + OFF_NTOK, tl.int32)
    metap = _at(tab, rank, set_off + OFF_META, tl.int32)
    xp = _at(tab, rank, set_off + OFF_X, DT)
    scp = _at(tab, rank, set_off + OFF_SC, tl.float32)
    ns = tl.arange(0, NSP)
    nsm = ns < NS
    ps = tl.arange(0, WP)
    # tokens each source sent, loaded once (masked sources: none)
    nts = tl.where(_masked(msk, ps), 0, tl.load(ntp + ps, mask=ps < W, other=0))
    if b == NB - 1:     # the last block: at small token counts it owns no pair
        for l0 in range(0, L, LB):
            ls = l0 + tl.arange(0, LB)
            lm = ls < L
            tot = tl.zeros([LB], tl.int32)
            for s in range(W):
                tot += tl.where(_masked(msk, s), 0, tl.load(cntp + s * L + ls, mask=lm, other=0))
            tl.store(recv_count + ls, tot, mask=lm)
        tl.store(ntok_out + ps, nts, mask=ps < W)
    ks = tl.arange(0, KP)
    kmask = ks < K
    earlier = ks[None, :] < ks[:, None]         # [k, i]: entry i comes before entry k
    for s in range(W):
        n_s = tl.sum(tl.where(ps == s, nts, 0), axis=0)
        for t in range(_first_token(b, s, NB, W), n_s, NB):
            slot = s * T + t
            # the row first: its address needs no metadata, so its load overlaps the metadata's
            # (a token reaches a rank only when one of its experts is there: the row is used)
            v = tl.load(xp + slot * H + hs, mask=hm)
            if FP8:
                sv = tl.load(scp + slot * NS + ns, mask=nsm)
            # the pair's top-k entries as one vector: every load of a pair is issued at once
            # (a chain of scalar loads per entry cost ~0.3 us each, the slope of the dispatch)
            m = tl.load(metap + slot * MAX_TOPK + ks, mask=kmask, other=-1)
            valid = m >= 0
            first = _first_entries(m, valid, earlier)
            le = tl.maximum(m, 0) >> META_SHIFT
            row = m & META_MASK
            for s2 in range(s):
                if not _masked(msk, s2):
                    row += tl.load(cntp + s2 * L + le, mask=valid, other=0)
            flat = le * (W * T) + row
            tl.store(row_of + slot * K + ks, tl.where(valid, flat, -1), mask=kmask)
            tl.store(src_info + flat, tl.full([KP], 0, tl.int32) + slot, mask=first)
            for k in tl.static_range(K):
                pick = ks == k
                if tl.sum((pick & first).to(tl.int32), axis=0) > 0:
                    flat_k = tl.sum(tl.where(pick, flat, 0), axis=0).to(tl.int64)
                    tl.store(recv_x + flat_k * H + hs, v, mask=hm)
                    if FP8:
                        tl.store(recv_scales + flat_k * NS + ns, sv, mask=nsm)


@triton.jit
def _take_ll(ptrs, m, srcs, epoch, failed, limit, err, POLL: tl.constexpr, LLW: tl.constexpr):
    """LL dispatch: the words at ``ptrs`` (lanes ``m``) once every one has arrived: LL words
    (LLW = 1) whose epoch is ``epoch``, or row words (LLW = 0) that are not ROW_SENTINEL.
    ``srcs``: each lane's source rank, named in the error word if the wait runs out. Returns
    (words, failed); after a failure nothing is waited for (``failed`` stays 1)."""
    v, status = _poll(ptrs, m, err, 1, failed < 0, failed, limit, ROW_SENTINEL, POLL, epoch,
                      LLW)
    if status > 0:      # STATUS_TIMEOUT (the tag is not checked here); block-uniform
        late = _pending(v, m, ROW_SENTINEL, epoch, LLW)
        bad = tl.reduce(tl.where(late, tl.full(m.shape, 1, tl.int64) << srcs, 0), 0, _bit_or)
        report_error(err, status, OP_DISPATCH, PHASE_DATA, bad)
        failed = 1
    return v, failed


@triton.jit
def _copy_rows(dst, flat, first, v, ROW: tl.constexpr, lanes, lm, K: tl.constexpr,
               KP: tl.constexpr):
    """Row ``v`` (lanes ``lanes``, mask ``lm``) into row ``flat[k]`` of ``dst`` (ROW elements
    per row) for every entry k in ``first`` (one row per distinct local expert).

    Each k takes its row from ``[KP]`` tensors spread over a warp's lanes: one sum across
    the lanes gives ``flat[k] + 1``, or 0 where k is not in ``first``, and the store is masked
    on it rather than branched on. So the K sums depend on nothing but ``flat`` and ``first``
    and can be issued together. A branch per k, with a sum for the test and another for the
    row, put 2K chains of shuffles in series with the stores: the largest stall of the
    expand in ncu (session 14)."""
    ks = tl.arange(0, KP)
    for k in tl.static_range(K):
        row1 = tl.sum(tl.where((ks == k) & first, flat + 1, 0), axis=0).to(tl.int64)
        # as a lane tensor: the interpreter takes no scalar in a store's mask
        row1 = row1 + tl.zeros_like(lanes).to(tl.int64)
        tl.store(dst + (row1 - 1) * ROW + lanes, v, mask=lm & (row1 > 0))


@triton.jit
def _expand_ll(recv_x, recv_scales, row_of, src_info, recv_count, ntok_out, tab, rank, set_off,
               seq, tag, timeout_us, err, w_off, T: tl.constexpr, K: tl.constexpr,
               KP: tl.constexpr, L: tl.constexpr, LB: tl.constexpr, W: tl.constexpr,
               WP: tl.constexpr, NB: tl.constexpr, MAX_TOPK: tl.constexpr, OFF_X: tl.constexpr,
               OFF_META: tl.constexpr, OFF_CNT: tl.constexpr, OFF_NTOK: tl.constexpr,
               FP8: tl.constexpr, NS: tl.constexpr, NSP: tl.constexpr, OFF_SC: tl.constexpr,
               RW: tl.constexpr, HPW: tl.constexpr, CARRY: tl.constexpr,
               OFF_WLL: tl.constexpr, POLL: tl.constexpr, OWN_FIRST: tl.constexpr,
               PROFILE: tl.constexpr = 0, x=0, OWN_X: tl.constexpr = 0):
    """LL dispatch, receive: what ``_expand`` does, each word waited for where it is read (no
    flag): the sources' token counts (and call tags), then per owned pair its metadata, the
    earlier sources' counts of its experts, its row (and FP8 scales, carried weights); the row
    slot is armed again with ROW_SENTINEL once copied. PROFILE: stamp 3 when the first source's
    pairs (this rank's own, with OWN_FIRST) are expanded, stamp 4 when the last row of a later
    source arrived (tools/ep_timeline.py). OWN_X: this rank's own rows are read from ``x`` (the
    send skipped them: ``_push_rows`` SKIP_OWN), exact and without a wait or a re-arm."""
    b = tl.program_id(0)
    epoch = (seq + 1).to(tl.int32)
    limit = limit_ticks(timeout_us, POLL)
    failed = tl.zeros([], tl.int32)
    cntp = _at(tab, rank, set_off + OFF_CNT, tl.int64)
    ntp = _at(tab, rank, set_off + OFF_NTOK, tl.int64)
    metap = _at(tab, rank, set_off + OFF_META, tl.int64)
    xp = _at(tab, rank, set_off + OFF_X, tl.int32)
    scp = _at(tab, rank, set_off + OFF_SC, tl.int32)
    wll = _at(tab, rank, set_off + OFF_WLL, tl.int64)
    wout = _at(tab, rank, w_off, tl.float32)
    rx = recv_x.to(tl.pointer_type(tl.int32))
    rs = recv_scales.to(tl.pointer_type(tl.int32))
    ws = tl.arange(0, HPW)
    wm = ws < RW
    ns = tl.arange(0, NSP)
    nsm = ns < NS
    ps = tl.arange(0, WP)
    nw, failed = _take_ll(ntp + ps, ps < W, ps.to(tl.int64), epoch, failed, limit, err, POLL, 1)
    nts = tl.where(ps < W, (nw & NTOK_MASK).to(tl.int32), 0)
    # a source whose tag differs runs another kind of call (use_fp8, round_scale, carried
    # weights, top-k): a mismatch, as the flag dispatch reports it
    other = (ps < W) & (((nw & LL_LOW) >> NTOK_BITS) != (tag & NTOK_TAG_MASK))
    if failed == 0:
        if tl.max(other.to(tl.int32), axis=0) > 0:
            report_error(err, STATUS_MISMATCH, OP_DISPATCH, PHASE_DATA,
                         tl.reduce(tl.where(other, tl.full([WP], 1, tl.int64) << ps, 0), 0,
                                   _bit_or))
            failed = 1
    if b == NB - 1:     # the last block: at small token counts it owns no pair
        for l0 in range(0, L, LB):
            ls = l0 + tl.arange(0, LB)
            lm = ls < L
            tot = tl.zeros([LB], tl.int32)
            for s in range(W):
                c, failed = _take_ll(cntp + s * L + ls, lm, tl.full([LB], s, tl.int64), epoch,
                                     failed, limit, err, POLL, 1)
                tot += c.to(tl.int32)
            tl.store(recv_count + ls, tot, mask=lm)
        tl.store(ntok_out + ps, nts, mask=ps < W)
    ks = tl.arange(0, KP)
    kmask = ks < K
    earlier = ks[None, :] < ks[:, None]         # [k, i]: entry i comes before entry k
    for i in range(W):
        s = i
        if OWN_FIRST:   # this rank's own rows first: they are local, the peers' still crossing
            s = (rank + i) % W
        n_s = tl.sum(tl.where(ps == s, nts, 0), axis=0)
        for t in range(_first_token(b, s, NB, W), n_s, NB):
            slot = s * T + t
            srcs = tl.full([KP], s, tl.int64)
            mw, failed = _take_ll(metap + slot * MAX_TOPK + ks, kmask, srcs, epoch, failed,
                                  limit, err, POLL, 1)
            m = tl.where(kmask & (failed == 0), mw.to(tl.int32), -1)
            valid = m >= 0
            first = _first_entries(m, valid, earlier)
            le = tl.maximum(m, 0) >> META_SHIFT
            row = m & META_MASK
            for s2 in range(s):
                c, failed = _take_ll(cntp + s2 * L + le, valid, tl.full([KP], s2, tl.int64),
                                     epoch, failed, limit, err, POLL, 1)
                row += c.to(tl.int32)
            if failed == 0:
                flat = le * (W * T) + row
                tl.store(row_of + slot * K + ks, tl.where(valid, flat, -1), mask=kmask)
                tl.store(src_info + flat, tl.full([KP], 0, tl.int32) + slot, mask=first)
                own_x = (s == rank) & (OWN_X == 1)
                if tl.max(valid.to(tl.int32), axis=0) > 0:      # the row was sent here
                    if own_x:
                        v = tl.load(x.to(tl.pointer_type(tl.int32)) + t * RW + ws, mask=wm)
                    else:
                        v, failed = _take_ll(xp + slot * RW + ws, wm,
                                             tl.full([HPW], s, tl.int64), epoch, failed, limit,
                                             err, POLL, 0)
                    if FP8:
                        sv, failed = _take_ll(scp + slot * NS + ns, nsm,
                                              tl.full([NSP], s, tl.int64), epoch, failed, limit,
                                              err, POLL, 0)
                    if CARRY:
                        wv, failed = _take_ll(wll + slot * MAX_TOPK + ks, kmask, srcs, epoch,
                                              failed, limit, err, POLL, 1)
                    if i > 0:
                        _stamp(err, 4, PROFILE, 0, NB)      # a later source's row arrived
                    if failed == 0:
                        _copy_rows(rx, flat, first, v, RW, ws, wm, K, KP)
                        if own_x == 0:
                            tl.store(xp + slot * RW + ws, tl.full([HPW], ROW_SENTINEL, tl.int32),
                                     mask=wm)   # armed again
                        if FP8:
                            _copy_rows(rs, flat, first, sv, NS, ns, nsm, K, KP)
                            tl.store(scp + slot * NS + ns, tl.full([NSP], ROW_SENTINEL,
                                                                   tl.int32), mask=nsm)
                        if CARRY:
                            tl.store(wout + slot * MAX_TOPK + ks,
                                     wv.to(tl.int32).to(tl.float32, bitcast=True), mask=kmask)
        if i == 0:
            _stamp(err, 3, PROFILE, 0, NB)      # the first source's pairs expanded
            _stamp(err, 4, PROFILE, 0, NB)


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
        PROFILE: tl.constexpr = 0,      # 1: stage stamps into err (ERR_PROF; _stamp)
        CARRY: tl.constexpr = 0,        # 1: the top-k weights travel too (module doc)
        LL: tl.constexpr = 0,           # 1: the LL dispatch (module doc); needs MASKS = 0
        RW: tl.constexpr = 1,           # LL: int32 words per row slot (ep.ll_row_consts)
        HPW: tl.constexpr = 1,          # LL: pow2(RW), the lanes of a row
        OFF_WLL: tl.constexpr = 0,      # LL, CARRY: the weights' LL words, bytes
        OWN_FIRST: tl.constexpr = 1,    # LL: expand this rank's own pairs before the peers'
        E4M3_ASM: tl.constexpr = 0,     # LL, FP8: round by the GPU's convert (_pack_row_fp8)
        FP8_RCP: tl.constexpr = 0,      # LL, FP8: divide by the reciprocal (_div_by)
        OWN_X: tl.constexpr = 0,        # LL, not FP8: own rows expanded from x (_expand_ll)
        PDL: tl.constexpr = 0):  # launched with PDL (_sync.after_previous_kernel)
    after_previous_kernel(PDL)
    tl.static_assert((LL == 0) | (MASKS == 0))
    # own rows from x only when one launch sends and receives (a hook's caller may reuse x)
    OWN_X_ON: tl.constexpr = OWN_X & LL & (FP8 == 0) & ((STAGES & 3) == 3)
    b = tl.program_id(0)
    _stamp(err, 0, PROFILE, 0, NB)
    timeout_us = wait_bound_us(timeout_us, err)     # short once this rank has failed
    seq = tl.load(ctrl + b)
    set_off = (seq % 2) * SET_BYTES
    word = ((seq + 1) << EPOCH_SHIFT) | tag
    ehi = (seq + 1) << LL_HI                        # LL words: this call's epoch bits
    if STAGES & 1:
        if CARRY:       # released with the rows by this dispatch's signal (LL: own words)
            if LL:
                _push_weights(wts, n_tok, tab, rank, set_off, T, K, KP, W, NB, MAX_TOPK,
                              OFF_WLL, ehi, 1)
            else:
                _push_weights(wts, n_tok, tab, rank, w_off, T, K, KP, W, NB, MAX_TOPK, 0)
        _send(x, topk, n_tok, tab, err, rank, set_off, T, H, HP, K, KP, E, L, W, WP, NB, EB, TT,
              TS, JP, MAX_TOPK, OFF_X, OFF_META, OFF_CNT, OFF_NTOK, FP8, NS, OFF_SC, ROWS_FIRST,
              PROFILE, ehi, tag, LL, RW, HPW, E4M3_ASM, FP8_RCP, OWN_X_ON)
        _stamp(err, 2, PROFILE, 0, NB)  # rows, counts and metadata pushed
    if LL:
        if STAGES & 2:      # D_RECV; polls only with D_WAIT (the interpreter tests read once)
            POLL: tl.constexpr = (STAGES & 8) != 0
            _expand_ll(recv_x, recv_scales, row_of, src_info, recv_count, ntok_out, tab, rank,
                       set_off, seq, tag, timeout_us, err, w_off, T, K, KP, L, LB, W, WP, NB,
                       MAX_TOPK, OFF_X, OFF_META, OFF_CNT, OFF_NTOK, FP8, NS, NSP, OFF_SC, RW,
                       HPW, CARRY, OFF_WLL, POLL, OWN_FIRST, PROFILE, x, OWN_X_ON)
            tl.store(ctrl + b, seq + 1)
        _stamp(err, PROF_LAST, PROFILE, 0, NB)
        return
    if STAGES & 4:      # D_SIGNAL
        tl.debug_barrier()
        _signal(tab, (set_off + OFF_SIG) // 8 + (SIG_DISPATCH * NB + b) * W + rank, word, W, WP)
        _stamp(err, 3, PROFILE, 0, NB)
    msk = tl.full([], 0, tl.int64)     # ranks treated as absent (masks only)
    if MASKS:
        msk = tl.load(err + ERR_MASK, volatile=True)
    ok = 1
    if STAGES & 8:      # D_WAIT
        flags = _at(tab, rank, set_off + OFF_SIG, tl.int64) + SIG_DISPATCH * NB * W
        ok, late = _wait_flags(flags, word, timeout_us, err, OP_DISPATCH, PHASE_ENTRY, 1, NB * W,
                               FP, W, msk, MASKS, LANES)
        if MASKS:
            agreed = _agree_mask(err, seq + 1, msk | late)
            # a rank late here but seen by the deciding block has arrived: wait for it again
            # (uniform condition; an error if it does not come)
            need = (late & ~agreed) != 0
            ok2, _ = _wait_flags(flags, word, timeout_us, err, OP_DISPATCH, PHASE_ENTRY, need,
                                 NB * W, FP, W, agreed, 0, LANES)
            ok = ok & (ok2 | (need == 0))
            if agreed != msk:
                tl.atomic_or(err + ERR_MASK, agreed, sem="relaxed", scope="gpu")
            msk = agreed
        _stamp(err, 4, PROFILE, 0, NB)
    if STAGES & 2:      # D_RECV
        if ok:
            _expand(recv_x, recv_scales, row_of, src_info, recv_count, ntok_out, tab, rank,
                    set_off, msk, T, H, HP, K, KP, L, LB, W, WP, NB, MAX_TOPK, OFF_X, OFF_META,
                    OFF_CNT, OFF_NTOK, FP8, NS, NSP, OFF_SC)
        tl.store(ctrl + b, seq + 1)
    _stamp(err, PROF_LAST, PROFILE, 0, NB)


@triton.jit
def _push_weights(wts, n_tok, tab, rank, set_off, T: tl.constexpr, K: tl.constexpr,
                  KP: tl.constexpr, W: tl.constexpr, NB: tl.constexpr, MAX_TOPK: tl.constexpr,
                  OFF_CW: tl.constexpr, ehi=0, LL: tl.constexpr = 0):
    """Combine stage A (or the dispatch with CARRY): this rank's top-k weights into slot
    (rank, t) of the weights region at byte ``set_off + OFF_CW`` of every rank (LL: as LL
    words with the epoch bits ``ehi``)."""
    b = tl.program_id(0)
    ks = tl.arange(0, KP)
    kmask = ks < K
    for t in range(_first_token(b, rank, NB, W), n_tok, NB):
        w = tl.load(wts + t * K + ks, mask=kmask, other=0.0)
        for d in tl.static_range(W):
            if LL:
                wp = _at(tab, d, set_off + OFF_CW, tl.int64) + (rank * T + t) * MAX_TOPK
                tl.store(wp + ks, _ll_word(ehi, w), mask=kmask)
            else:
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

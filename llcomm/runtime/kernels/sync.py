"""Device-side protocol helpers shared by every kernel: clock, bounded waits, signals.

Numbers mirror ``llcomm/runtime/protocol.py``. Every wait here is bounded by ``timeout_us``
(read from the GPU's nanosecond timer); on expiry it writes an error word to host-visible
memory and reports failure, so a missing peer becomes an exception on the host, never a hung GPU.

The clocks are read by inline assembly, PTX on NVIDIA and AMDGCN on AMD, picked when the kernel
is compiled: ``tl.target_info.is_hip()`` asks the driver Triton compiles for. Triton's
interpreter (``TRITON_INTERPRET=1``, read at import) runs no assembly: there the global timer is
the host's monotonic clock, and each reading yields to other threads, so a rank spinning in a
wait lets the ranks it waits for run (the interpreter tests and ``llcomm bench ep``'s
interpreter rows run several virtual ranks in one process).

Signal timeline of one barrier between ranks A and B (block b of each)::

    A: stores to B's staging ... bar.sync; atom.release.sys B.flag[b][A] = word
    B: spin on acquire loads of B.flag[b][A] == word ... bar.sync; read staging
"""
import os
import time

import triton
import triton.language as tl

from .. import protocol as P

#: Triton's interpreter runs the kernels (module doc: the clock).
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
#: Functions the interpreted clock calls at each reading (the simulated NIC of
#: ``llcomm/ep/hosts/nic.py`` moves on them: every poll of a wait reads the clock).
INTERPRETER_TICKS: list = []

EPOCH_SHIFT = tl.constexpr(P.EPOCH_SHIFT)
TAG_MASK = tl.constexpr(P.TAG_MASK)
STATUS_TIMEOUT = tl.constexpr(P.STATUS_TIMEOUT)
STATUS_MISMATCH = tl.constexpr(P.STATUS_MISMATCH)
POISON_BITS = tl.constexpr(P.POISON_BITS)
#: Arguments the kernels must not be specialised on: their values differ between ranks (or
#: between a first launch and the rest), and a specialisation would make one rank compile at
#: a call where its peers do not, while they wait on it (llcomm/runtime/launch.py).
RANK_VARYING = ["rank", "timeout_us"]


@triton.jit
def global_time_ns(WIDTH: tl.constexpr = 2):
    """The GPU's global timer in ns (same clock on every SM).

    Meant as one value for the whole block, so that all threads agree on whether a deadline has
    passed. It is NOT: the PTX (tools/ptx.py --dump) shows the [WIDTH] maximum compiled to one
    lane-pair shuffle, so each pair of lanes agrees and different warps can disagree for the
    nanoseconds around a deadline, and some warps leave a wait loop one iteration before the
    others. Harmless where the loop has no barrier inside (TP's waits over a few flags); a wait
    whose loop holds block-wide reductions must make the block agree: pass WIDTH >= the block's
    threads (the maximum then goes through shared memory), or fold the per-thread reading into
    a block-wide reduction the loop does anyway (EP's waits and the Lamport waits in
    ``lamport.py`` fold it, with the poll's verdict, into one maximum). That costs a
    shared-memory round per reading, so TP's flag waits keep the default until it is measured
    (docs/failures.md, known gap).
    """
    return tl.max(global_time_lanes(WIDTH), axis=0)


#: AMD: ``s_memrealtime`` counts the GPU's constant 100 MHz clock (CDNA3), so 10 ns a tick.
REALTIME_NS_PER_TICK = tl.constexpr(10)
#: AMD: the scalar memory reads of a counter, each followed by the wait for its result (the
#: compiler does not track what inline assembly leaves outstanding). Triton's own
#: ``tl.extra.hip.memrealtime`` waits on vector memory instead (3.9), so it is not used.
AMD_REALTIME = tl.constexpr("s_memrealtime $0\ns_waitcnt lgkmcnt(0)")
AMD_CYCLES = tl.constexpr("s_memtime $0\ns_waitcnt lgkmcnt(0)")


@triton.jit
def global_time_lanes(WIDTH: tl.constexpr):
    """``[WIDTH]`` readings of the global timer in ns, one per lane (not reduced): for callers
    that fold them into a reduction of their own (EP's waits, one shared-memory round). On AMD
    the real-time counter, one reading per wavefront (a scalar register)."""
    if INTERPRETED:
        return _host_clock_lanes(WIDTH)
    elif tl.target_info.is_hip():
        return tl.inline_asm_elementwise(AMD_REALTIME, "=s,s", [tl.zeros([WIDTH], tl.int64)],
                                         dtype=tl.int64, is_pure=False,
                                         pack=1) * REALTIME_NS_PER_TICK
    else:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l",
                                         [tl.zeros([WIDTH], tl.int64)], dtype=tl.int64,
                                         is_pure=False, pack=1)


if INTERPRETED:
    @triton.jit
    def _host_clock_lanes(WIDTH: tl.constexpr):
        """The interpreter's global timer (module doc)."""
        time.sleep(0)
        for tick in INTERPRETER_TICKS:
            tick()
        return tl.full([WIDTH], time.monotonic_ns(), tl.int64)
else:
    @triton.jit
    def _host_clock_lanes(WIDTH: tl.constexpr):
        """Compiled kernels read the GPU's clocks; this stand-in is never called there (the
        compiler's dependency scan refuses host functions such as ``time``'s)."""
        return tl.zeros([WIDTH], tl.int64)


@triton.jit
def sm_cycles():
    """This SM's cycle counter (%clock64; on AMD the shader clock, ``s_memtime``): fine-grained,
    but per SM, so only differences taken within one block mean anything (profiling stamps, EP's
    PROFILE)."""
    if INTERPRETED:
        t = _host_clock_lanes(2)
    elif tl.target_info.is_hip():
        t = tl.inline_asm_elementwise(AMD_CYCLES, "=s,s", [tl.zeros([2], tl.int64)],
                                      dtype=tl.int64, is_pure=False, pack=1)
    else:
        t = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,l", [tl.zeros([2], tl.int64)],
                                      dtype=tl.int64, is_pure=False, pack=1)
    return tl.max(t, axis=0)


@triton.jit
def poll_read(ptrs, m=None, other=None):
    """One read of a poll: words a peer (or another block, or the host) stores while this
    kernel spins on them, lanes ``m`` (``other`` elsewhere). A volatile load; on AMD an acquire
    atomic at system scope that adds 0, because Triton's AMD backend drops ``volatile`` from
    the loads it rewrites (buffer loads of a kernel argument's memory, and others), and a wait
    could then spin on a cached value until its bound."""
    if tl.target_info.is_hip():
        got = tl.atomic_add(ptrs, 0, mask=m, sem="acquire", scope="sys")
        if m is not None:   # a masked-off lane of an atomic returns no value
            got = tl.where(m, got, other)
        return got
    else:
        return tl.load(ptrs, mask=m, other=other, volatile=True)


@triton.jit
def after_previous_kernel(PDL: tl.constexpr):
    """First statement of every llcomm kernel. PDL (programmatic dependent launch, sm90+):
    the launch lets this kernel's blocks become resident while the kernel before it on the
    stream still runs; ``griddepcontrol.wait`` then holds them until that kernel has finished
    and its memory is visible. Nothing is read before it: the operand, the round counter
    ``ctrl`` and the error word may all be written by that kernel. The launch of the kernel
    after this one is then allowed at once (it waits the same way), so at most one kernel is
    resident ahead. Without PDL (or under the interpreter) nothing is emitted."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def op_start(ctrl, err, timeout_us, PDL: tl.constexpr):
    """The prologue of every TP kernel: wait for the kernel ahead under PDL
    (``after_previous_kernel``), then this block's index ``b``, the bound of its waits and
    whether this rank had already failed (``wait_bound``), and its op counter ``seq = ctrl[b]``
    (round parity ``seq % 2``, epoch ``seq + 1``). Returns (b, timeout_us, seq, broken)."""
    after_previous_kernel(PDL)
    b = tl.program_id(0)
    timeout_us, broken = wait_bound(timeout_us, err)    # short once this rank has failed
    return b, timeout_us, tl.load(ctrl + b), broken


#: Bound, in microseconds, of every wait of a kernel that starts after this rank already failed
#: (device error word set): the kernels queued behind a failure (a decode-step graph holds a
#: hundred or more) then end in about this long each instead of a whole timeout each.
AFTER_FAILURE_US = tl.constexpr(100)


@triton.jit
def wait_bound(timeout_us, err_ptr):
    """The bound of this kernel's waits: ``timeout_us``, or AFTER_FAILURE_US once this rank's
    device error word (``err_ptr[0]``) is set. Read once, at kernel start: the word is written by
    a wait that ran out, so an earlier kernel of the stream or, at the earliest, a bound after
    this kernel began: every thread reads the same value and the waits stay block-uniform.
    Returns (bound, broken): ``broken`` says the word was set, so whatever this kernel
    computes is poisoned like a failed wait's outputs (the rounds after a failure are not
    trusted: a peer's flags and Lamport words may be a failed round's)."""
    broken = tl.load(err_ptr) != 0
    return tl.where(broken, tl.minimum(timeout_us, AFTER_FAILURE_US), timeout_us), broken


@triton.jit
def poison(ptr, offs, m):
    """Store POISON_BITS (every bit set: NaN in each float dtype, -1 in signed integers) at
    ``ptr + offs``, lanes ``m``, through an integer view of the element's width. What a
    failed op leaves in the outputs it did not compute (protocol.POISON_BITS); called only on
    failure paths."""
    BITS: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth
    if BITS == 8:
        _poison_as(ptr, offs, m, tl.int8)
    elif BITS == 16:
        _poison_as(ptr, offs, m, tl.int16)
    elif BITS == 32:
        _poison_as(ptr, offs, m, tl.int32)
    else:
        _poison_as(ptr, offs, m, tl.int64)


@triton.jit
def _poison_as(ptr, offs, m, IT: tl.constexpr):
    """``poison`` through ``ptr`` viewed as the signed integer type ``IT`` of its width."""
    tl.store(ptr.to(tl.pointer_type(IT)) + offs, tl.full(offs.shape, POISON_BITS, IT), mask=m)


@triton.jit
def poison_chunks(out, n, b, NB: tl.constexpr, BLOCK: tl.constexpr):
    """``poison`` block b's elements of ``out`` (``n``; blocks take BLOCK-element chunks in
    turn, as ``push_to_slot``): what a flag kernel's block writes, and so what it poisons when
    its wait failed or the rank had failed before it started."""
    lanes = tl.arange(0, BLOCK)
    for start in range(b * BLOCK, n, NB * BLOCK):
        offs = start + lanes
        poison(out, offs, offs < n)


@triton.jit
def ptr_from_table(table, idx, DTYPE: tl.constexpr):
    """Address ``table[idx]`` (an int64 table of per-rank base addresses) as a DTYPE pointer."""
    return tl.load(table + idx).to(tl.pointer_type(DTYPE))


@triton.jit
def push_to_slot(x, stage_tab, n, b, half, rank, slot, cap, W: tl.constexpr, NB: tl.constexpr,
                 BLOCK: tl.constexpr):
    """The flag kernels' push: block b's elements of x (``n``; blocks take BLOCK-element chunks
    in turn) into slot ``slot`` of half ``half`` of the staging of every rank but ``rank``
    (``cap`` elements per slot); this rank's own part is read from x where it is needed."""
    DT = x.dtype.element_ty
    lanes = tl.arange(0, BLOCK)
    for start in range(b * BLOCK, n, NB * BLOCK):
        offs = start + lanes
        m = offs < n
        v = tl.load(x + offs, mask=m)
        for p in tl.static_range(W):
            if p != rank:
                dst = tl.multiple_of(ptr_from_table(stage_tab, p, DT), 16) + (half * W + slot) * cap
                tl.store(dst + offs, v, mask=m)


@triton.jit
def report_error(err_ptr, status, op, phase, mask):
    """Record an error word; the first error of a communicator wins.

    ``err_ptr`` points at the device copy (int64, in the ctrl region); ``err_ptr[1]`` holds the
    address of the host-visible copy (pinned, mapped) that the host reads without a sync. Only
    the block that wins the compare-and-swap on the device copy writes the host copy, so a later
    timeout of another block cannot hide the mismatch that caused it.
    """
    zero = tl.full([], 0, tl.int64)
    word = ((zero + status) << 48) | ((zero + op) << 40) | ((zero + phase) << 32) | (zero + mask)
    if tl.atomic_cas(err_ptr, zero, word, sem="relaxed", scope="gpu") == 0:
        host = tl.load(err_ptr + 1).to(tl.pointer_type(tl.int64))
        tl.store(host, word)


@triton.jit
def signal_peers(flag_tab, slot, word, rank, W: tl.constexpr, WP: tl.constexpr):
    """Publish ``word`` into ``flags[slot][rank]`` on every rank (release, system scope).

    Caller must issue ``tl.debug_barrier()`` first so the whole block's stores precede it.
    ``slot`` selects (phase, block); each rank's flags region is ``int64[slots][W]``.
    """
    ps = tl.arange(0, WP)
    live = ps < W
    bases = tl.load(flag_tab + ps, mask=live, other=0)
    ptrs = bases.to(tl.pointer_type(tl.int64)) + slot * W + rank
    vals = tl.full([WP], 0, tl.int64) + word
    tl.atomic_xchg(ptrs, vals, mask=live, sem="release", scope="sys")


@triton.jit
def wait_peers(flags, slot, word, timeout_us, err_ptr, op, phase,
               W: tl.constexpr, WP: tl.constexpr):
    """Spin until every rank p has arrived: ``flags[slot][p] == word`` (or a later epoch);
    bounded by ``timeout_us``.

    Returns 1 on success, 0 on timeout or mismatch (after writing the error word).
    ``flags`` is this rank's own flags region (int64 pointer).
    """
    ps = tl.arange(0, WP)
    live = ps < W
    ptrs = flags + slot * W + ps
    zero = tl.full([WP], 0, tl.int64)
    epoch = word >> EPOCH_SHIFT
    limit_ns = timeout_us.to(tl.int64) * 1000   # i32 microseconds: see launch.py
    t0 = global_time_ns()
    status = 0
    bad = zero
    while status == 0:
        got = tl.atomic_add(ptrs, zero, mask=live, sem="acquire", scope="sys")
        # A later epoch means the peer already finished this op and signalled its next one
        # over the same slot: it arrived. Only the same epoch with another tag is a mismatch.
        arrived = (got == word) | ((got >> EPOCH_SHIFT) > epoch) | (ps >= W)
        wrong = ((got >> EPOCH_SHIFT) == epoch) & (got != word) & live
        if tl.sum(wrong.to(tl.int32), axis=0) > 0:
            status = STATUS_MISMATCH
            bad = wrong.to(tl.int64)
        elif tl.sum(arrived.to(tl.int32), axis=0) == WP:
            status = -1
        elif global_time_ns() - t0 > limit_ns:
            status = STATUS_TIMEOUT
            bad = (arrived == 0).to(tl.int64)
    ok = status == -1
    if not ok:
        report_error(err_ptr, status, op, phase, tl.sum(bad << ps.to(tl.int64), axis=0))
    tl.debug_barrier()
    return ok

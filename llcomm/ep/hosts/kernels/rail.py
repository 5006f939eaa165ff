"""The two-level kernels' transport: one message to a rank on another host, the receiver's
consistency step after it saw the message's flag, and a store or signal to a rank of this host.

Across hosts a message is one *put-with-signal*: ``n_bytes`` from this rank's heap to the same
offset family on rank ``pe``, then ``word`` stored into a flag word there, the flag ordered
after the data by SHMEM itself (data lands before its signal, on every transport). Every
message has a flag of its own (an id block per host, a row per token and host), so no two
messages share a flag and nothing needs a ``fence`` between messages: a receiver that sees a
flag may read exactly that message's bytes. A put-with-signal is block-collective: every
thread of the block makes the call, and SHMEM issues one message (no thread-scope SHMEM call
anywhere in the kernels, so no per-thread network operation). Where the backend's device
library has it the put is non-blocking (NVSHMEM: ``nvshmemx_putmem_signal_nbi_block``,
declared here as torch declares its own externs), so a block keeps its messages in flight.

When may a staging slot be written again after a non-blocking put read it? The kernels never
``quiet``. A slot of buffer set ``s`` is rewritten two calls later (the sets alternate). Before
that, in the call between, this rank waited for a message from every rank it sent to in the
call before (each rail rank sends its id block, or its weights, to every other host in every
call, and sends them only after its previous call ended, which waited for every message this
rank had sent it). A message that was delivered has been read from its source, so the slot is
free. docs/multihost.md, "Messages and flags", has the timeline.

The receiver polls its own flag words (a bounded wait, as everywhere: SHMEM's own waits never
give up), then calls SHMEM's ``signal_wait_until`` on a flag it saw, once per wait. It returns
at once, after the transport's consistency step: on NVSHMEM's CPU-proxy transport without
GDRCopy, a round trip through the proxy that makes every write that arrived before the flag
visible to this GPU (NVSHMEM's threads of one block coalesce it into one round trip: each
raises the same issue counter); elsewhere a memory fence. Without it the rows after a flag
would be outside SHMEM's guarantee.

``SHMEM`` picks the backend, and each backend's constants come from that backend:

- ``NVSHMEM`` (1): NVSHMEM through torch's ``_nvshmem_triton`` layer, plus the declared
  non-blocking put-with-signal;
- ``ROCSHMEM`` (2): rocSHMEM through torch's ``_rocshmem_triton`` layer (blocking: the layer
  declares no non-blocking put-with-signal, and no rocSHMEM bitcode was at hand to check one);
- ``PLAIN`` (0): plain stores through the region table, as inside a host. Under Triton's
  interpreter the message goes to the simulated NIC instead (``llcomm/ep/hosts/nic.py``),
  which delivers no earlier than SHMEM promises.

Both layers define the two device functions used (``putmem_signal_block``,
``signal_wait_until``); neither ``signal_op`` (a compile-time error in rocSHMEM's layer) nor
``quiet`` nor ``fence`` is called.

Inside a host every write is a store through the region table (peer memory), and a signal a
release store of system scope, as in the single-host kernels.
"""
import triton
import triton.language as tl
from triton.language import core

from ....runtime.kernels.sync import (EPOCH_SHIFT, INTERPRETED, STATUS_MISMATCH, STATUS_TIMEOUT,
                                      global_time_lanes, global_time_ns, poll_read, report_error)
from ....runtime.shmem import layer_devices
from ...kernels.common import (BLOCK_WIDE, ELAPSED_MASK, SEEN_SHIFT, SEEN_WAITING, SEEN_WRONG,
                               WAIT_SKIPPED, _at, _bit_or)

#: ``SHMEM``: the backend of the messages across hosts (module doc).
PLAIN = tl.constexpr(0)
NVSHMEM = tl.constexpr(1)
ROCSHMEM = tl.constexpr(2)
#: NVSHMEM's constants (nvshmem_common_transport.h, nvshmem_constants.h): the signal
#: operation that stores its value, and the comparison "equal". torch's docstrings give 0 for
#: the signal operation, which NVSHMEM takes for another one (flags then arrive wrong).
NV_SIGNAL_SET = tl.constexpr(9)
NV_CMP_EQ = tl.constexpr(0)
#: rocSHMEM's (rocshmem_common.hpp: the first enumerators of its signal operations and
#: comparisons).
ROC_SIGNAL_SET = tl.constexpr(0)
ROC_CMP_EQ = tl.constexpr(0)
#: Bytes of a flag word (int64): a flag region's stride.
FLAG = tl.constexpr(8)
#: int32 words a plain-store copy moves per step.
PUT_CHUNK = tl.constexpr(1024)
#: The NVSHMEM device function of a non-blocking, block-collective put-with-signal
#: (tools/ptx_shmem.py checks the bitcode defines it).
NV_PUT_SIGNAL_NBI = "nvshmemx_putmem_signal_nbi_block"

nv = layer_devices("nvshmem")
roc = layer_devices("rocshmem")


@core.extern
def _nv_put_signal_nbi(dst, src, n_bytes, sig, word, sig_op, pe, _semantic=None):
    """NVSHMEM's non-blocking block put-with-signal (module doc); addresses as int64."""
    return core.extern_elementwise(
        "", "", [dst, src, n_bytes, sig, word, sig_op, pe],
        {(core.dtype("int64"), core.dtype("int64"), core.dtype("int64"), core.dtype("int64"),
          core.dtype("uint64"), core.dtype("int32"), core.dtype("int32")):
         (NV_PUT_SIGNAL_NBI, core.dtype("int32"))},
        is_pure=False, _semantic=_semantic)


@triton.jit
def copy_words(dst, src, n_words, CHUNK: tl.constexpr):
    """``n_words`` int32 words from ``src`` to ``dst`` (int32 pointers), CHUNK at a time."""
    for w0 in range(0, n_words, CHUNK):
        ws = w0 + tl.arange(0, CHUNK)
        m = ws < n_words
        tl.store(dst + ws, tl.load(src + ws, mask=m), mask=m)


if INTERPRETED:
    from ..nic import post as _nic_post

    @triton.jit
    def _plain_send(tab, rank, pe, dst_off, src_off, n_bytes, sig_off, word):
        """The interpreter: hand the message to the simulated NIC."""
        _nic_post(tab, rank, pe, dst_off, src_off, n_bytes, sig_off, word)
else:
    @triton.jit
    def _plain_send(tab, rank, pe, dst_off, src_off, n_bytes, sig_off, word):
        """Stores through the region table, then the flag: block barrier, release of system
        scope."""
        base = tl.load(tab + rank)
        copy_words((tl.load(tab + pe) + dst_off).to(tl.pointer_type(tl.int32)),
                   (base + src_off).to(tl.pointer_type(tl.int32)), n_bytes // 4, PUT_CHUNK)
        tl.debug_barrier()
        tl.atomic_xchg(_at(tab, pe, sig_off, tl.int64), word, sem="release", scope="sys")


@triton.jit
def rail_send(tab, rank, pe, dst_off, src_off, n_bytes, sig_off, word, SHMEM: tl.constexpr):
    """One message to rank ``pe`` on another host: ``n_bytes`` (a multiple of 16) from this
    rank's region at byte ``src_off`` to ``pe``'s at ``dst_off``, then ``word`` (int64) into
    the flag at byte ``sig_off`` there, ordered after the data. Call it after a block barrier
    that follows the last store to the source. Offsets need 4-byte alignment only."""
    base = tl.load(tab + rank)
    n = tl.full([], 0, tl.int64) + n_bytes          # a value, not a constexpr
    if SHMEM == NVSHMEM:
        _nv_put_signal_nbi(base + dst_off, base + src_off, n, base + sig_off,
                           word.to(tl.uint64), NV_SIGNAL_SET, pe.to(tl.int32))
    elif SHMEM == ROCSHMEM:
        roc.putmem_signal_block(base + dst_off, base + src_off, n, base + sig_off, word,
                                ROC_SIGNAL_SET, pe.to(tl.int32))
    else:
        _plain_send(tab, rank, pe, dst_off, src_off, n, sig_off, word)


@triton.jit
def rail_arrived(flag, word, SHMEM: tl.constexpr):
    """After a bounded poll saw ``word`` in the flag word ``flag`` (an int64 pointer into this
    rank's heap): SHMEM's wait on it, once, for the transport's consistency step (module
    doc). Nothing to do for plain stores: the poll's acquire orders them."""
    if SHMEM == NVSHMEM:
        nv.signal_wait_until(flag, NV_CMP_EQ, word)
    elif SHMEM == ROCSHMEM:
        roc.signal_wait_until(flag, ROC_CMP_EQ, word)


@triton.jit
def rail_wait(flags, need, src, word, timeout_us, err, op, phase, go, SHMEM: tl.constexpr):
    """Bounded wait until every flag word ``flags[i]`` (int64 pointers into this rank's heap,
    one lane each) with ``need[i]`` holds ``word``: the messages this block reads next. Then
    one acquire per flag, and SHMEM's wait once, on one flag seen (``rail_arrived``). The
    block leaves the loop at one iteration (verdict and clock reduced together, as
    ``common._wait_flags`` does). Returns 1, or 0 after writing the error word: status
    timeout or mismatch, its mask the sources ``1 << src[i]`` of the lanes that were late or
    disagreed. ``go == 0`` (an earlier wait failed) returns 0 at once. Status -1 is "all
    arrived", as in ``common._wait_flags``."""
    NP: tl.constexpr = flags.shape[0]
    tl.static_assert(NP <= BLOCK_WIDE)
    epoch = word >> EPOCH_SHIFT
    limit_ns = timeout_us.to(tl.int64) * 1000
    t0 = global_time_ns(BLOCK_WIDE)
    status = tl.where((tl.full([], 0, tl.int32) + go) != 0, 0, WAIT_SKIPPED)
    bad = tl.zeros([NP], tl.int64)
    while status == 0:
        got = poll_read(flags, need, 0)
        waiting = need & (got != word)
        wrong = waiting & ((got >> EPOCH_SHIFT) >= epoch)
        seen = tl.where(wrong, SEEN_WRONG, tl.where(waiting, SEEN_WAITING, 0)).to(tl.int64)
        elapsed = tl.maximum(global_time_lanes(BLOCK_WIDE) - t0, 0)
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
    ok = status == -1
    if ok:
        tl.atomic_add(flags, tl.zeros([NP], tl.int64), mask=need, sem="acquire", scope="sys")
        last = tl.max(tl.where(need, tl.arange(0, NP), -1), axis=0)
        if last >= 0:
            rail_arrived(tl.sum(tl.where(tl.arange(0, NP) == last,
                                         flags.to(tl.int64), 0), axis=0)
                         .to(tl.pointer_type(tl.int64)), word, SHMEM)
    elif status != WAIT_SKIPPED:
        report_error(err, status, op, phase,
                     tl.reduce(tl.where(bad != 0, tl.full([NP], 1, tl.int64) << src, 0), 0,
                               _bit_or))
    tl.debug_barrier()
    return ok


@triton.jit
def host_signal(tab, q, sig_off, word):
    """Store ``word`` at byte ``sig_off`` of rank ``q`` of this host (peer memory), after this
    block's stores: block barrier, release of system scope."""
    tl.debug_barrier()
    tl.atomic_xchg(_at(tab, q, sig_off, tl.int64), word, sem="release", scope="sys")

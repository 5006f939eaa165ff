"""The two-level kernels' transport: a put and a signal to a rank on another host, and a store
or signal to a rank of this host.

Across hosts (``SHMEM`` = 1) the puts and signals are SHMEM's, through PyTorch's SHMEM Triton
layer (``llcomm/runtime/shmem.py`` finds it: NVSHMEM on CUDA, rocSHMEM on ROCm). A put names
its destination by the *symmetric* address, i.e. the address of the same object in this rank's
own heap, and the PE; its source must be in the heap too (registered memory, for RDMA), which
is why the kernels stage what they send. ``SHMEM`` = 0 writes the same bytes with plain stores
through the region table, as inside a host: the interpreter tests run the whole protocol that
way on a simulated heap (one CPU tensor per virtual rank), and one machine declared as several
hosts could too.

Inside a host every write is a store through the region table (peer memory), and a signal a
release store of system scope, as in the single-host kernels.

Ordering of a put and its signal (SHMEM): every thread of the block has issued its share of
the puts (``putmem_block`` is collective over the block), ``quiet`` completes them, a block
barrier, then the signal. The receiver polls the signal word in its own heap (a bounded wait:
SHMEM's own ``signal_wait_until`` never gives up) and acquires it before reading.
"""
import triton
import triton.language as tl

from ....runtime.shmem import shmem_device
from ...kernels.common import _at

#: NVSHMEM's signal operation that stores the value: NVSHMEM_SIGNAL_SET is 9 in NVSHMEM's
#: enum (ADD is 10). torch's docstrings give 0, which NVSHMEM takes for another operation: the
#: flags then arrive wrong (seen on the GPU as a mismatch at the first wait).
SIGNAL_SET = tl.constexpr(9)
#: int32 words a plain-store put moves per step.
PUT_CHUNK = tl.constexpr(1024)

shmem = shmem_device()


@triton.jit
def copy_words(dst, src, n_words, CHUNK: tl.constexpr):
    """``n_words`` int32 words from ``src`` to ``dst`` (int32 pointers), CHUNK at a time."""
    for w0 in range(0, n_words, CHUNK):
        ws = w0 + tl.arange(0, CHUNK)
        m = ws < n_words
        tl.store(dst + ws, tl.load(src + ws, mask=m), mask=m)


@triton.jit
def rail_put(tab, rank, pe, dst_off, src_off, n_bytes, SHMEM: tl.constexpr):
    """Put ``n_bytes`` (a multiple of 16) from this rank's region at byte ``src_off`` to rank
    ``pe``'s region at byte ``dst_off``; blocking for the source, not for delivery. The offsets
    need only 4-byte alignment (no 16-byte claim is made for them)."""
    base = tl.load(tab + rank)
    src = (base + src_off).to(tl.pointer_type(tl.int32))
    if SHMEM:
        n_words = tl.full([], 0, tl.int64) + n_bytes // 4     # a value, not a constexpr
        shmem.put((base + dst_off).to(tl.pointer_type(tl.int32)), src, n_words,
                  pe.to(tl.int32))
    else:
        copy_words((tl.load(tab + pe) + dst_off).to(tl.pointer_type(tl.int32)), src,
                   n_bytes // 4, PUT_CHUNK)


@triton.jit
def rail_signal(tab, rank, pe, sig_off, word, SHMEM: tl.constexpr):
    """After this block's puts: complete them and store ``word`` (int64) at byte ``sig_off``
    of rank ``pe``'s region, ordered after them."""
    if SHMEM:
        shmem.quiet()
        tl.debug_barrier()
        base = tl.load(tab + rank)
        shmem.signal_op(base + sig_off, word, SIGNAL_SET, pe.to(tl.int32))
    else:
        tl.debug_barrier()
        tl.atomic_xchg(_at(tab, pe, sig_off, tl.int64), word, sem="release", scope="sys")


@triton.jit
def host_signal(tab, q, sig_off, word):
    """Store ``word`` at byte ``sig_off`` of rank ``q`` of this host (peer memory), after this
    block's stores: block barrier, release of system scope."""
    tl.debug_barrier()
    tl.atomic_xchg(_at(tab, q, sig_off, tl.int64), word, sem="release", scope="sys")

"""A simulated symmetric heap and a NIC that promises only what SHMEM promises: how the
two-level kernels run in Triton's interpreter (``TRITON_INTERPRET=1``) with ``SHMEM`` = 0.

The heap is one CPU region per virtual rank; a table of their addresses stands for the
symmetric heap's peer mappings. Inside a host the kernels store through it, as on GPUs. A
message across hosts (``kernels/rail.py``, ``rail_send``) goes to the NIC, which delivers it
no earlier than SHMEM guarantees, and randomly later, by a seed:

- a message's bytes land in chunks, in any order, and are read from the source when they land
  (a source slot reused too early sends the new bytes);
- its flag lands only after all of its bytes (put-with-signal), at any time after that;
- nothing orders two messages, to one rank or to several: any pending chunk or flag may land
  next.

The NIC moves when the kernels read the clock (every poll of a wait does: the interpreted
clock calls ``sync.INTERPRETER_TICKS``) and when a message is posted: each tick lands one
pending item with probability ``p_land``. ``lazy=False`` lands every message whole as it is
posted (plain stores). Threads of concurrently interpreted ranks share one NIC under a lock.
The NIC counts what it carried per destination rank (messages, flags, bytes): the kernels'
own ledger must agree with it.
"""
from __future__ import annotations

import ctypes
import random
import threading

import torch

#: Bytes per chunk of a message as the NIC lands it (a multiple of 16: the puts' unit).
CHUNK_BYTES = 64
#: Default probability that a tick lands one pending item.
P_LAND = 0.5

_current = None         # the installed NIC (``install``), or None: messages land whole


def _int(v) -> int:
    """A scalar of the interpreter (a tensor holding one value) or a Python int, as an int."""
    h = getattr(v, "handle", None)
    data = getattr(h, "data", v)
    try:
        return int(data.reshape(-1)[0])
    except AttributeError:
        return int(data)


class LazyNIC:
    """The simulated NIC (module doc). ``seed`` fixes its choices."""

    def __init__(self, seed: int = 0, lazy: bool = True, p_land: float = P_LAND):
        self.rng = random.Random(seed)
        self.lazy = lazy
        self.p_land = p_land
        self.lock = threading.RLock()
        self.pending: list[dict] = []
        self.carried: dict[int, list[int]] = {}     # dest rank -> [messages, flags, bytes]

    def post(self, pe: int, dst: int, src: int, n_bytes: int, sig: int, word: int) -> None:
        """One put-with-signal: ``n_bytes`` from address ``src`` to ``dst``, then the int64
        ``word`` at ``sig`` (addresses in the simulated heap)."""
        chunks = [(o, min(CHUNK_BYTES, n_bytes - o)) for o in range(0, n_bytes, CHUNK_BYTES)]
        msg = {"pe": pe, "dst": dst, "src": src, "chunks": chunks, "sig": sig, "word": word}
        with self.lock:
            c = self.carried.setdefault(pe, [0, 0, 0])
            c[0] += 1
            c[1] += 1
            c[2] += n_bytes
            if not self.lazy:
                self._land_all(msg)
                return
            self.rng.shuffle(chunks)
            self.pending.append(msg)
        self.tick()

    def tick(self) -> None:
        """Maybe land one pending item: a chunk of some message, or the flag of a message whose
        bytes have all landed."""
        with self.lock:
            if not self.pending or self.rng.random() >= self.p_land:
                return
            msg = self.rng.choice(self.pending)
            if msg["chunks"]:
                self._land_chunk(msg, msg["chunks"].pop())
            else:
                ctypes.c_int64.from_address(msg["sig"]).value = msg["word"]
                self.pending.remove(msg)

    def drain(self) -> None:
        """Land everything still pending."""
        with self.lock:
            for msg in self.pending:
                self._land_all(msg)
            self.pending.clear()

    def _land_chunk(self, msg: dict, chunk: tuple[int, int]) -> None:
        off, n = chunk
        ctypes.memmove(msg["dst"] + off, msg["src"] + off, n)

    def _land_all(self, msg: dict) -> None:
        for chunk in msg["chunks"]:
            self._land_chunk(msg, chunk)
        msg["chunks"] = []
        ctypes.c_int64.from_address(msg["sig"]).value = msg["word"]


def install(nic: LazyNIC | None) -> None:
    """Make ``nic`` the one the interpreted kernels post to and the clock ticks (None: land
    every message whole at once)."""
    global _current
    from ...runtime.kernels import sync
    if _current is not None and _current.tick in sync.INTERPRETER_TICKS:
        sync.INTERPRETER_TICKS.remove(_current.tick)
    _current = nic
    if nic is not None:
        sync.INTERPRETER_TICKS.append(nic.tick)


def post(tab, rank, pe, dst_off, src_off, n_bytes, sig_off, word) -> None:
    """Called by the interpreted ``rail_send``: the message from ``rank``'s region to ``pe``'s
    (offsets into the regions of the table ``tab``)."""
    tab_addr, rank, pe = _int(tab), _int(rank), _int(pe)
    base = ctypes.c_int64.from_address(tab_addr + 8 * rank).value
    peer = ctypes.c_int64.from_address(tab_addr + 8 * pe).value
    args = (pe, peer + _int(dst_off), base + _int(src_off), _int(n_bytes),
            peer + _int(sig_off), _int(word))
    if _current is None:
        LazyNIC(lazy=False).post(*args)
    else:
        _current.post(*args)


def simulated_heap(lay, NB: int, mask_bits: int = 0, nic_seed: int | None = None):
    """The simulated symmetric heap of ``lay``'s ranks and their private words: (heap, region
    table, host error words, ``err`` with ``mask_bits`` as the rank mask, block counters,
    ledgers ``[2][NB, N, 3]``: dispatch and combine). ``nic_seed``: install a lazy NIC with
    that seed (None: messages land whole). Keep ``heap`` alive while the table is used."""
    from ..layout import ERR_MASK
    from .layout import ERR_WORDS
    cpu = torch.device("cpu")
    W, N = lay.world, lay.num_hosts
    heap = [torch.zeros(lay.total_bytes, dtype=torch.uint8, device=cpu) for _ in range(W)]
    tab = torch.tensor([h.data_ptr() for h in heap], dtype=torch.int64, device=cpu)
    host_words = [torch.zeros(2, dtype=torch.int64, device=cpu) for _ in range(W)]
    err = [torch.zeros(ERR_WORDS, dtype=torch.int64, device=cpu) for _ in range(W)]
    for e, h in zip(err, host_words):
        e[1:3] = torch.tensor([h.data_ptr(), h.data_ptr() + 8], dtype=torch.int64, device=cpu)
        e[ERR_MASK] = mask_bits
    ctrl = [torch.zeros(2, NB, dtype=torch.int64, device=cpu) for _ in range(W)]
    ledger = [torch.zeros(2, NB, N, 3, dtype=torch.int64, device=cpu) for _ in range(W)]
    install(None if nic_seed is None else LazyNIC(nic_seed))
    return heap, tab, host_words, err, ctrl, ledger


def current() -> LazyNIC | None:
    """The installed NIC."""
    return _current

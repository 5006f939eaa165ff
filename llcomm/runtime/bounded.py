"""Collectives of a reference backend (TP's and EP's) with a bound and a call check.

Bounded waits (docs/failures.md): on gloo every collective is issued ``async_op=True`` and waited
for at most ``timeout_ms`` on the host (default 30 s, ``protocol.REFERENCE_DEFAULT_TIMEOUT_MS``);
a wait that runs out, or a transport error (a peer process died: "Connection reset by peer"),
raises ``CommTimeoutError`` naming the op, and every later call raises ``CommBrokenError``, as
on the peer backend. On NCCL the calls stay
asynchronous (no host wait, so they can be captured in a CUDA graph) and the process group's own
timeout and NCCL's watchdog bound them instead.

Call check (``check_calls``, docs/failures.md): a collective whose ranks disagree about its size
or dtype aborts the process inside gloo (``gloo::EnforceNotMet``, SIGABRT) and is undefined on
NCCL. So before the first collective of each call, every rank sends the others a fixed-size
header (op, dtype and the sizes that must agree: ``CALLS``) in one small collective that always
matches, compares, and raises ``CommMismatchError`` on every rank where they differ, before any
payload moves. On by default over gloo; off by default over NCCL, where it costs a host round
trip per call and rules out graph capture.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..errors import CommMismatchError, CommTimeoutError, UnsupportedConfigError
from . import protocol as P
from .backend import device_backends, reference_device


#: The call check's header: int64 words ``[op code, dtype code, *fields, 0...]``. Per op: its
#: code and the names of the fields that every rank must give the same value (what the
#: collectives' sizes depend on, and what the peer backend's flag tags compare).
HEADER_WORDS = 8
CALLS = {
    "all_reduce": (1, ("numel",)),
    "all_reduce_residual_rmsnorm": (2, ("tokens", "hidden")),
    "broadcast": (3, ("numel", "src")),
    "all_gather": (4, ("numel",)),
    "all_gather_2d": (5, ("tokens", "part")),
    "reduce_scatter": (6, ("numel",)),
    "dispatch": (7, ("topk", "fp8", "weights", "hidden", "max_tokens", "num_experts")),
    "combine": (8, ("topk", "weights", "hidden", "max_tokens", "num_experts")),
    "all_reduce_rmsnorm": (9, ("tokens", "hidden")),
    "all_reduce_residual_rmsnorm_fp8": (10, ("tokens", "hidden")),
    "all_reduce_residual_rmsnorm_fp8_per_group": (11, ("tokens", "hidden")),
}
_OP_NAMES = {code: op for op, (code, _) in CALLS.items()}
_DTYPE_NAMES = {code: name for name, code in P.DTYPE_CODES.items()}
assert all(len(fields) <= HEADER_WORDS - 2 for _, fields in CALLS.values())


def carried_by_gloo(group: dist.ProcessGroup, device: torch.device | None = None) -> bool:
    """Whether gloo carries the reference backend's collectives on ``group``: its tensors'
    device type (``device``, by default where the reference backend puts them) is gloo's, on a
    gloo group or a mixed one (``"cpu:gloo,cuda:nccl"`` carries CPU tensors over gloo, CUDA
    tensors over NCCL)."""
    device = reference_device(group) if device is None else device
    return device_backends(group).get(device.type) == "gloo"


def default_check_calls(group: dist.ProcessGroup) -> bool:
    """``check_calls=None``: on where gloo carries the calls (a mismatch would abort the process
    there), off elsewhere (NCCL: the check costs a host round trip per call and rules out graph
    capture)."""
    return carried_by_gloo(group)


def _describe(row: list[int]) -> str:
    """One rank's header as ``op(field=value, ..., dtype=name)``."""
    op = _OP_NAMES.get(row[0])
    if op is None:
        return f"op#{row[0]}"
    fields = ", ".join(f"{name}={v}" for name, v in zip(CALLS[op][1], row[2:]))
    dtype = _DTYPE_NAMES.get(row[1], f"#{row[1]}")
    return f"{op}({fields}{', ' if fields else ''}dtype={dtype})"


class BoundedCalls:
    """Runs the torch.distributed calls of one communicator (or EP buffer) with a host-side bound
    on gloo, checks that every rank makes the same call (``checked``), and latches the first
    failure. ``what`` names the object in messages.

    ``run(op, call)``: ``call(async_op)`` issues one collective and returns its Work when
    ``async_op`` is true. On gloo it is waited for ``timeout_ms`` at most; any error of the
    collective (timeout, lost connection) becomes ``CommTimeoutError`` naming ``op``. On other
    backends it is issued synchronously as before (NCCL: enqueued on the current stream).

    ``agree(op, dtype, *fields)``: the call check (module doc); does nothing unless ``checked``.
    The owner calls it once per call, before the call's first collective. Every rank must give
    the same ``checked`` (a rank that sends headers would meet another's payload): the owners
    compare it in their construction's exchange (``runtime/backend.choose_backend``)."""

    def __init__(self, group: dist.ProcessGroup, timeout_ms: int, what: str, *,
                 device: torch.device, checked: bool):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_ms = timeout_ms
        self.bounded = carried_by_gloo(group, device)
        self._timeout = datetime.timedelta(milliseconds=timeout_ms)
        self.failure = P.FailureLatch(self.rank, what)
        self.device = device
        self._bufs: dict = {}       # words per rank -> (host buffer, its numpy view, on device)
        self.checked = bool(checked)

    def _gather(self, op: str, words: list[int], n: int) -> list[list[int]]:
        """Gather ``n`` int64 words of every rank (bounded like any call); by rank. An all-reduce
        of zeros but this rank's slot, in a buffer kept per ``n``: gloo's all_gather_single took
        about twice the host time to issue (cProfile of one-rank calls on a CPU host)."""
        bufs = self._bufs.get(n)
        if bufs is None:
            host = torch.zeros(self.world_size * n, dtype=torch.int64, device="cpu")
            dev = host if self.device.type == "cpu" else torch.empty_like(host, device=self.device)
            bufs = self._bufs[n] = (host, host.numpy(), dev)
        host, slots, dev = bufs
        slots[:] = 0
        slots[self.rank * n:(self.rank + 1) * n] = words
        if dev is not host:
            dev.copy_(host)
        self.run(op, lambda a: dist.all_reduce(dev, op=dist.ReduceOp.SUM, group=self.group,
                                               async_op=a))
        return dev.view(self.world_size, n).tolist()

    def agree(self, op: str, dtype: torch.dtype, *fields: int) -> None:
        """Raise CommMismatchError on every rank (and break the object) unless every rank of
        the group is making this same call: same ``op``, ``dtype`` and ``fields``."""
        if not self.checked:
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise UnsupportedConfigError(
                f"llcomm: rank {self.rank}: {op}: the call check (check_calls=True) waits on the "
                "host for the ranks' headers, which a CUDA graph capture cannot do; create the "
                f"{self.failure.what} with check_calls=False to capture its calls")
        words = [CALLS[op][0], P.DTYPE_CODES[str(dtype).removeprefix("torch.")], *fields]
        words += [0] * (HEADER_WORDS - len(words))
        rows = self._gather(op, words, HEADER_WORDS)
        mine = rows[self.rank]
        others = [r for r, row in enumerate(rows) if row != mine]
        if not others:
            return
        calls = "; ".join(f"rank {r}: {_describe(row)}" for r, row in enumerate(rows))
        raise self.failure.fail(CommMismatchError(
            f"llcomm: rank {self.rank}: {op} (reference backend, call check): the ranks made "
            f"different calls in the same round ({calls}); every rank must issue the same "
            "sequence of calls with the same shapes and dtypes. Nothing was sent. The "
            f"{self.failure.what} is now broken: destroy it and create a new one.",
            op=op, phase="call check", ranks=others))

    def check(self) -> None:
        """Raise CommBrokenError if an earlier call failed."""
        self.failure.check(0)

    def run(self, op: str, call) -> None:
        self.start(op, call)()

    def start(self, op: str, call):
        """Issue one collective now; return a function that waits for it (bounded on gloo, the
        same errors as ``run``). Split-phase callers do their own work in between."""
        self.check()
        if not self.bounded:
            call(False)
            return _nothing
        try:
            work = call(True)
        except RuntimeError as e:
            raise self._fail(op, e) from e

        def wait() -> None:
            try:
                work.wait(timeout=self._timeout)
            except RuntimeError as e:  # gloo: "Operation timed out!", "Connection reset by peer"
                raise self._fail(op, e) from e
        return wait

    def _fail(self, op: str, e: Exception):
        others = [r for r in range(self.world_size) if r != self.rank]
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        err = CommTimeoutError(
            f"llcomm: rank {self.rank}: {op} (reference backend, gloo): the collective did "
            f"not complete within timeout_ms={self.timeout_ms} ({cause}); a peer of ranks "
            f"{others} did not arrive or its process is gone. The {self.failure.what} is now "
            "broken: destroy it and create a new one (after the missing ranks are back).",
            op=op, phase="collective", ranks=())
        return self.failure.fail(err)


def _nothing() -> None:
    return None

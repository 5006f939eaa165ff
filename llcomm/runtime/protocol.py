"""The wire protocol between ranks: op codes, flag words, error words, timeouts.

Pure Python (no Triton): the kernels mirror these numbers as ``tl.constexpr`` in
``llcomm/runtime/kernels/sync.py`` and the host decodes what the kernels write with the functions
here.

Flag word (int64, written by a peer into this rank's signal region)::

    bits 63..24  epoch   = the writer block's op sequence number + 1 (never reset, always grows)
    bits 23..16  op code of the call that wrote it
    bits 15..0   size tag (a hash of element count and dtype)

A waiter expects exactly ``(epoch << 24) | tag``. An older epoch means "not yet"; the right epoch
with another tag means the ranks disagree about the call (mismatch), which is reported instead of
computed.

Lamport tag word (int32, written by a peer's Lamport all-reduce into this rank's Lamport region,
one per (half, block, source rank), idle at 0 and reset to 0 by the reader)::

    bit  24      LAMPORT_TAG_BIT (so a written tag is never the idle 0)
    bits 23..0   the same op code and size tag as a flag word

Lamport sends no flag (the data is its own flag), so the tag is what tells a reader that its peer
called the same op with the same element count and dtype. It needs no epoch: like the data words
it is consumed (reset to 0) in the op that wrote it.

Error word (int64, written by a kernel into host-visible memory when a wait gives up)::

    bits 55..48  status: 1 = timeout, 2 = mismatch
    bits 47..40  op code
    bits 39..32  phase code
    bits 31..0   bit mask of the ranks that had not arrived (or disagreed)
"""
from __future__ import annotations

from ..errors import CommBrokenError, CommMismatchError, CommTimeoutError, LLCommError

#: Default bound of every device-side wait, milliseconds (``LLCOMM_TIMEOUT_MS`` overrides): an
#: order of magnitude above the longest stall of a healthy rank, since a timeout breaks the
#: object for good while a late report of a dead peer costs only seconds
#: (docs/failures.md, "The default bound: 10 s").
DEFAULT_TIMEOUT_MS = 10_000
#: Default bound of the reference backend's host-side waits on gloo (ms) when neither
#: ``timeout_ms`` nor ``LLCOMM_TIMEOUT_MS`` is given: CPU processes are scheduled by the OS and
#: do their own work between calls, so a loaded host can hold a healthy rank back for seconds.
REFERENCE_DEFAULT_TIMEOUT_MS = 30_000
NS_PER_MS = 1_000_000
US_PER_MS = 1_000
#: Largest timeout: kernels take the bound in microseconds as a 32-bit int (about 35 minutes).
MAX_TIMEOUT_MS = (2**31 - 1) // US_PER_MS

EPOCH_SHIFT = 24
TAG_BITS = 24
TAG_MASK = (1 << TAG_BITS) - 1
SIZE_TAG_MASK = 0xFFFF
#: Set in every Lamport tag word (lamport_tag), above the tag, so a written tag is never 0.
LAMPORT_TAG_BIT = 1 << TAG_BITS

# Operation codes (carried in flags and error words).
OPS = {
    1: "all_reduce(one_shot)",
    2: "all_reduce(two_shot)",
    3: "all_reduce(lamport)",
    4: "broadcast",
    5: "all_gather",
    6: "reduce_scatter",
    7: "dispatch",
    8: "combine",
    9: "all_reduce_residual_rmsnorm(lamport)",
    10: "all_reduce_residual_rmsnorm(one_shot)",
    11: "reduce_scatter(lamport)",
    12: "all_reduce_rmsnorm(lamport)",
    13: "all_reduce_rmsnorm(one_shot)",
    14: "all_reduce_residual_rmsnorm_fp8(lamport)",
    15: "all_reduce_residual_rmsnorm_fp8(one_shot)",
    16: "all_reduce_residual_rmsnorm_fp8_per_group(lamport)",
    17: "all_reduce_residual_rmsnorm_fp8_per_group(one_shot)",
}
OP_ONE_SHOT, OP_TWO_SHOT, OP_LAMPORT = 1, 2, 3
OP_BROADCAST, OP_ALL_GATHER, OP_REDUCE_SCATTER = 4, 5, 6
OP_DISPATCH, OP_COMBINE = 7, 8
OP_FUSED_LAMPORT, OP_FUSED_ONE_SHOT = 9, 10
OP_LAMPORT_REDUCE_SCATTER = 11
# the other fused norms (llcomm/tp/kernels/fused_norm.py variants), Lamport and one-shot each
OP_NORM_LAMPORT, OP_NORM_ONE_SHOT = 12, 13
OP_FP8_LAMPORT, OP_FP8_ONE_SHOT = 14, 15
OP_FP8_GROUP_LAMPORT, OP_FP8_GROUP_ONE_SHOT = 16, 17

# Phase codes: which wait gave up. Entry and exit barriers have distinct codes (seed contract).
PHASES = {1: "entry barrier", 2: "exit barrier", 3: "data poll"}
PHASE_ENTRY, PHASE_EXIT, PHASE_DATA = 1, 2, 3

STATUS_TIMEOUT, STATUS_MISMATCH = 1, 2

#: What a failed op leaves in the outputs it did not compute (docs/failures.md): every bit set.
#: That is a NaN in every float dtype (fp32 0xFFFFFFFF, 16-bit 0xFFFF, e4m3/e5m2 0xFF) and -1 in
#: every signed integer, so a reader tells a failed op's output from a result on the device,
#: without a sync: ``isnan`` for floats, ``recv_count < 0`` for the EP dispatch's counts (a real
#: count is never negative), -1 words for the movement ops' integer payloads.
POISON_BITS = -1
#: The EP dispatch's ``recv_count`` of every local expert after a failed dispatch.
POISON_COUNT = POISON_BITS

#: Every dtype an op takes, by name (``str(dtype)`` without ``torch.``): its code in size tags and
#: in the reference backend's call headers. Each has its own code, so ranks that pass different
#: dtypes are a mismatch even where the bytes would move alike (float32 and int32 of one numel).
#: Codes are never reused or renumbered: they are what ranks compare.
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "uint8": 4, "int32": 5, "int64": 6,
               "int8": 7, "int16": 8, "bool": 9, "float64": 10, "float8_e4m3fn": 11,
               "float8_e5m2": 12, "uint16": 13, "uint32": 14, "uint64": 15, "complex64": 16,
               "complex128": 17, "float8_e4m3fnuz": 18, "float8_e5m2fnuz": 19,
               "float8_e8m0fnu": 20, "float4_e2m1fn_x2": 21}


def resolve_timeout_ms(timeout_ms: int | None, setting: int | None,
                       default: int = DEFAULT_TIMEOUT_MS) -> int:
    """The wait bound in ms: the argument if given, else ``setting`` (``LLCOMM_TIMEOUT_MS`` as
    ``runtime/settings.py`` parsed it; None when unset), else ``default`` (10 000;
    ``REFERENCE_DEFAULT_TIMEOUT_MS`` for the reference backend).

    Raises ValueError naming ``timeout_ms`` when the argument is not a positive integer (a bool
    is not an integer of milliseconds here)."""
    if timeout_ms is None:
        return default if setting is None else setting
    if not isinstance(timeout_ms, int) or isinstance(timeout_ms, bool) \
            or not 0 < timeout_ms <= MAX_TIMEOUT_MS:
        raise ValueError(f"timeout_ms={timeout_ms!r}: expected a positive integer of milliseconds, "
                         f"at most {MAX_TIMEOUT_MS}")
    return timeout_ms


def size_tag(op: int, numel: int, dtype_name: str) -> int:
    """The 24-bit tag a flag carries: op code plus a 16-bit hash of (numel, dtype)."""
    h = (numel * 2654435761 + DTYPE_CODES.get(dtype_name, 0) * 40503) & 0xFFFFFFFF
    h = (h ^ (h >> 16)) & SIZE_TAG_MASK
    return (op << 16) | h


def lamport_tag(op: int, numel: int, dtype_name: str) -> int:
    """The int32 word a Lamport all-reduce writes beside its data: ``size_tag`` plus
    LAMPORT_TAG_BIT, never 0 (the idle value of a tag word)."""
    return LAMPORT_TAG_BIT | size_tag(op, numel, dtype_name)


def decode_error(word: int, rank: int, rank_of=None) -> LLCommError | None:
    """Turn an error word written by a kernel into the exception to raise, or None if clear.
    ``rank_of(phase, i)``: the rank that bit i of the word's mask names, where a kernel's waits
    number their sources otherwise (the two-level EP kernels); default: rank i."""
    if word == 0:
        return None
    status = (word >> 48) & 0xFF
    op = OPS.get((word >> 40) & 0xFF, f"op#{(word >> 40) & 0xFF}")
    phase_id = (word >> 32) & 0xFF
    phase = PHASES.get(phase_id, f"phase#{phase_id}")
    mask = word & 0xFFFFFFFF
    ranks = [r if rank_of is None else rank_of(phase_id, r) for r in range(32) if mask >> r & 1]
    if status not in (STATUS_TIMEOUT, STATUS_MISMATCH):
        return LLCommError(
            f"llcomm: rank {rank}: unrecognised error word {word:#x} (status {status}, {op}, "
            f"{phase}, ranks {ranks}): the error memory was overwritten or the kernels and "
            "llcomm/runtime/protocol.py disagree. The communicator is now broken: destroy it and "
            "create a new one.")
    if status == STATUS_MISMATCH:
        return CommMismatchError(
            f"llcomm: rank {rank}: {op} {phase}: ranks {ranks} called a different op, size or "
            "dtype in the same round; every rank must issue the same sequence of calls with the "
            "same shapes and dtypes. The communicator is now broken: destroy it and create a new "
            "one.",
            op=op, phase=phase, ranks=ranks)
    return CommTimeoutError(
        f"llcomm: rank {rank}: {op} {phase}: ranks {ranks} did not arrive within the timeout. "
        "The communicator is now broken: destroy it and create a new one (after the missing "
        "ranks are back).", op=op, phase=phase, ranks=ranks)


class FailureLatch:
    """The first device error of a communicator (or EP buffer): raised once, then every later
    call raises CommBrokenError. ``what`` names the object in messages."""

    def __init__(self, rank: int, what: str):
        self.rank, self.what = rank, what
        self.error: LLCommError | None = None

    def fail(self, error: LLCommError) -> LLCommError:
        """Record ``error`` as the first failure (host-detected, e.g. the reference backend's
        bounded wait) unless one came earlier; returns what to raise now."""
        if self.error is None:
            self.error = error
            return error
        return self._broken()

    def _broken(self) -> CommBrokenError:
        return CommBrokenError(f"llcomm: rank {self.rank}: this {self.what} failed earlier "
                               f"({self.error}); destroy it and create a new one.")

    def check(self, word: int, rank_of=None) -> None:
        """Raise if ``word`` (the host copy of the error word) is set or an error came earlier.
        ``rank_of``: as ``decode_error``'s."""
        if self.error is None and word != 0:
            self.error = decode_error(int(word), self.rank, rank_of)
            raise self.error
        if self.error is not None:
            raise self._broken()

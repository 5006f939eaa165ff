"""Exceptions raised by llcomm. Every failure a caller can meet is one of these."""


class LLCommError(RuntimeError):
    """Base class of every llcomm error."""


class CommTimeoutError(LLCommError):
    """A device-side wait ran past ``timeout_ms``: some peer never arrived.

    Attributes: ``op`` (name of the operation), ``phase`` (which wait), ``ranks`` (the ranks
    that had not arrived when the wait gave up).
    """

    def __init__(self, message: str, *, op: str = "?", phase: str = "?", ranks=()):
        super().__init__(message)
        self.op = op
        self.phase = phase
        self.ranks = tuple(ranks)


class CommMismatchError(LLCommError):
    """Ranks called different operations, sizes or dtypes in the same round."""

    def __init__(self, message: str, *, op: str = "?", phase: str = "?", ranks=()):
        super().__init__(message)
        self.op = op
        self.phase = phase
        self.ranks = tuple(ranks)


class CommBrokenError(LLCommError):
    """The communicator failed earlier (timeout or mismatch) and can no longer be used."""


class CommClosedError(LLCommError):
    """An op was called on a Communicator or EPBuffer after its ``close()``."""


class AlgoTableError(LLCommError, ValueError):
    """An all_reduce algorithm table (``llcomm tune``'s file) is unreadable or malformed. The
    message names the file and every problem."""


class UnsupportedConfigError(LLCommError):
    """The requested backend cannot run on this configuration (e.g. no peer access)."""

"""Send halves in flight (``EPBuffer(sends_in_flight=...)``, ``return_recv_hook=True``): which
calls a buffer may issue before the receive hooks of earlier ones, checked on the host before
anything is launched.

With ``sends_in_flight`` D (1 or 2) a buffer has 2 D buffer sets and 2 D handle slots
(``layout.num_sets``). The rules, per op (dispatch, combine): at most D send halves whose hooks
have not run; hooks run in the order of their sends (FIFO: the kernels' receive counter follows
the send counter, kernels/__init__.py "Buffer sets"); a call without a hook waits until no hook
of its op is pending; a dispatch that would reuse the handle slot of a combine whose hook is
pending waits for that hook (the combine's receive half reads nothing of the slot, but its
wait is what proves every peer has read the weights the dispatch carried there).
"""
from __future__ import annotations

from collections import deque

from ..runtime import validate as V
from .layout import MAX_SENDS_IN_FLIGHT, num_sets

OPS = ("dispatch", "combine")


def check_sends_in_flight(pr: V.Problems, value) -> int:
    """The ``sends_in_flight`` argument: 1 or 2 (1 after a problem, which ``pr`` names)."""
    if isinstance(value, bool) or not isinstance(value, int):
        pr.add(f"sends_in_flight={value!r}; expected 1 or 2", type_error=True)
        return 1
    if not 1 <= value <= MAX_SENDS_IN_FLIGHT:
        pr.add(f"sends_in_flight={value}; expected 1 (one send half before its receive hook) or "
               f"{MAX_SENDS_IN_FLIGHT} (two, as two-batch overlap issues them)")
        return 1
    return value


class SendsInFlight:
    """The calls of each op whose receive hook has not run, oldest first (host side)."""

    def __init__(self, sends_in_flight: int = 1):
        self.limit = sends_in_flight
        self.slots = num_sets(sends_in_flight)          # handle slots (= buffer sets)
        self.pending: dict[str, deque] = {op: deque() for op in OPS}
        self.combine_handles: deque = deque()           # handle index of each pending combine

    def dispatch_pending(self, index: int) -> bool:
        """Dispatch #index has issued its send half but its receive hook has not run."""
        return index in self.pending["dispatch"]

    def check(self, pr: V.Problems, op: str, return_recv_hook, dispatch_index: int | None = None
              ) -> None:
        """Problems with issuing a call of ``op`` now (``dispatch_index``: the dispatch's)."""
        if not isinstance(return_recv_hook, bool):
            pr.add(f"return_recv_hook={return_recv_hook!r}; expected True or False",
                   type_error=True)
        waiting = self.pending[op]
        if waiting and (not return_recv_hook or len(waiting) >= self.limit):
            names = " and ".join(f"#{i}" for i in waiting)
            if return_recv_hook and self.limit > 1:     # a send half past the limit
                how = (f"sends_in_flight={self.limit} allows {self.limit} send halves in flight; "
                       f"call the receive hook of {op} #{waiting[0]} before the next {op}")
            else:
                how = (f"call {'it' if len(waiting) == 1 else 'them'} before the next {op} on "
                       "this buffer")
            pr.add(f"the receive hook of {op} {names} (return_recv_hook=True) "
                   f"{'has' if len(waiting) == 1 else 'have'} not been called: {how}")
        if op == "dispatch" and dispatch_index is not None:
            for c, h in zip(self.pending["combine"], self.combine_handles):
                if dispatch_index - h >= self.slots:
                    pr.add(f"dispatch #{dispatch_index} would reuse the handle slot of dispatch "
                           f"#{h}, whose combine #{c} has not had its receive hook called: "
                           "call that hook first")

    def hook(self, op: str, index: int, recv, closed, handle_index: int | None = None):
        """The receive-half callable of a split call; runs ``recv`` once, in send order.
        ``closed``: returns whether the buffer is closed. ``handle_index``: a combine's."""
        self.pending[op].append(index)
        if op == "combine":
            self.combine_handles.append(handle_index)
        waiting = self.pending[op]

        def hook():
            V.check_open(closed(), f"EPBuffer.{op} receive hook", "EPBuffer")
            if index not in waiting:
                raise RuntimeError(f"llcomm.EPBuffer: the receive hook of {op} #{index} has "
                                   "already been called (a hook runs once)")
            if waiting[0] != index:
                raise RuntimeError(f"llcomm.EPBuffer: the receive hook of {op} #{index} was "
                                   f"called before that of {op} #{waiting[0]}: receive hooks "
                                   f"run in the order of their send halves; call {op} "
                                   f"#{waiting[0]}'s first")
            waiting.popleft()
            if op == "combine":
                self.combine_handles.popleft()
            recv()
        hook.__doc__ = f"Receive half of {op} #{index} (llcomm.EPBuffer, return_recv_hook=True)."
        return hook

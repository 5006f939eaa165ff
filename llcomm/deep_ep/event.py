"""``EventOverlap``: the event ``llcomm.deep_ep`` calls return, with DeepEP's methods."""
from __future__ import annotations

import torch


class EventOverlap:
    """An event after a ``llcomm.deep_ep`` call, as DeepEP's ``EventOverlap``.

    llcomm's calls run on the caller's current stream, so the stream that made a call is
    already ordered after it. With ``async_finish=True`` on a CUDA device the call records a
    ``torch.cuda.Event`` on that stream after its work; ``current_stream_wait()`` makes the
    *now* current stream wait for it, which matters when the caller has switched streams.
    Without ``async_finish`` (and on CPU, where the calls are complete when they return) the
    event is None and ``current_stream_wait()`` has nothing to wait for (DeepEP asserts there
    instead).

    Attributes:
        event: the ``torch.cuda.Event``, or None.
        extra_tensors: tensors the call read or wrote, kept alive with the event (DeepEP's way
            of recording them for another stream without ``record_stream``).

    As a context manager, the current stream waits for the event when the block ends::

        with event:
            work_that_may_overlap()
    """

    def __init__(self, event: torch.cuda.Event | None = None,
                 extra_tensors: tuple | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """The current CUDA stream waits for the event (a device-side wait, no host sync)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()


def after(device: torch.device, async_finish: bool, tensors: tuple) -> EventOverlap:
    """The event a call returns: recorded on the current stream of ``device`` when
    ``async_finish`` and the device is a GPU, else an empty ``EventOverlap``."""
    if not async_finish:
        return EventOverlap()
    if device.type != "cuda":
        return EventOverlap(None, tensors)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return EventOverlap(event, tensors)

"""``EventHandle`` and ``EventOverlap``: the events ``llcomm.deep_ep`` calls return, with
DeepEP's classes and methods (``deep_ep.utils`` re-exports them under DeepEP's module path)."""
from __future__ import annotations

from typing import Callable

import torch


class EventHandle:
    """DeepEP's ``EventHandle``: an event recorded, when it is made, on the current CUDA stream.

    ``EventHandle()`` takes no arguments, as DeepEP's. Without CUDA it records nothing and is
    complete from the start: on CPU llcomm's calls have finished when they return.

    Attributes:
        event: the ``torch.cuda.Event`` recorded, or None (complete).
    """

    def __init__(self) -> None:
        self.event: torch.cuda.Event | None = None
        if torch.cuda.is_available():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())

    @classmethod
    def recorded_on(cls, device: torch.device) -> EventHandle:
        """A handle recorded on the current stream of ``device``; complete (no event) when
        ``device`` is not a GPU."""
        handle = cls.__new__(cls)
        handle.event = None
        if device.type == "cuda":
            handle.event = torch.cuda.Event()
            handle.event.record(torch.cuda.current_stream(device))
        return handle

    def current_stream_wait(self) -> None:
        """The current CUDA stream waits for the event (a device-side wait, no host sync);
        nothing to wait for when the handle is complete."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __repr__(self) -> str:
        return f"EventHandle({'recorded' if self.event is not None else 'complete'})"


class EventOverlap:
    """An event after a ``llcomm.deep_ep`` call, as DeepEP's ``EventOverlap``.

    llcomm's calls run on the caller's current stream, so the stream that made a call is
    already ordered after it. With ``async_finish=True`` the call returns an ``EventHandle``
    recorded on that stream after its work (on CPU a complete one); ``current_stream_wait()``
    makes the *now* current stream wait for it, which matters when the caller has switched
    streams. Without ``async_finish`` the event is None and ``current_stream_wait()`` has
    nothing to wait for (DeepEP asserts there instead).

    Attributes:
        event: the ``EventHandle``, or None.
        extra_tensors: tensors the call read or wrote, kept alive with the event (DeepEP's way
            of recording them for another stream without ``record_stream``).
        hook_after_wait: a callable run once by the next ``current_stream_wait()``
            (``register_hook_after_wait``), or None.

    As a context manager, the current stream waits for the event when the block ends
    (``with event(release_handle=True):`` also drops the handle afterwards)::

        with event:
            work_that_may_overlap()
    """

    def __init__(self, event: EventHandle | None = None,
                 extra_tensors: tuple | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait: Callable[[], object] | None = None
        self._release_on_exit = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """The current CUDA stream waits for the event (a device-side wait, no host sync), then
        the registered hook runs; ``release_handle`` drops the event afterwards."""
        if self.event is not None:
            self.event.current_stream_wait()
        hook, self.hook_after_wait = self.hook_after_wait, None
        if hook is not None:
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], object]) -> None:
        """Run ``hook_after_wait()`` once, after the next ``current_stream_wait()`` (on the
        stream that waited). TypeError if it is not callable, ValueError if one is already
        registered."""
        if not callable(hook_after_wait):
            raise TypeError(f"llcomm.deep_ep.EventOverlap.register_hook_after_wait: "
                            f"hook_after_wait={hook_after_wait!r} is not callable")
        if self.hook_after_wait is not None:
            raise ValueError("llcomm.deep_ep.EventOverlap.register_hook_after_wait: a hook is "
                             "already registered on this event (hook_after_wait)")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        """``with event(release_handle=True):``: the same object, dropping its handle when the
        block ends."""
        self._release_on_exit = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc) -> None:
        release, self._release_on_exit = self._release_on_exit, False
        self.current_stream_wait(release_handle=release)


def after(device: torch.device, async_finish: bool, tensors: tuple) -> EventOverlap:
    """The event a call returns: with ``async_finish`` an ``EventHandle`` recorded on the
    current stream of ``device`` (complete off the GPU) and the call's tensors; else empty."""
    if not async_finish:
        return EventOverlap()
    return EventOverlap(EventHandle.recorded_on(device), tensors)


def on_call_stream(device: torch.device, hook: Callable[[], object]) -> Callable[[], object]:
    """``hook`` made to run on the stream current on ``device`` now (at the call that returns
    it), whichever thread calls it and whatever stream is current there then, as DeepEP's
    receive hooks launch on the stream of their send half. Off the GPU, ``hook`` itself."""
    if device.type != "cuda":
        return hook
    stream = torch.cuda.current_stream(device)

    def on_stream():
        with torch.cuda.stream(stream):
            return hook()
    on_stream.__doc__ = hook.__doc__
    return on_stream

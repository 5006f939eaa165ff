"""The rest of DeepEP's ``Buffer``: class-level settings, streams and events (a mixin of
``Buffer``; docs/deep_ep.md, "DeepEP's names")."""
from __future__ import annotations

import torch

from .checks import PREFIX
from .event import EventHandle, EventOverlap

#: DeepEP's default SM count of its high-throughput kernels (``Buffer.num_sms``).
DEFAULT_NUM_SMS = 20


class DeepEPSurface:
    """``Buffer``'s names beyond the low-latency calls. The ``Buffer`` provides ``_ep``."""

    #: SMs of DeepEP's normal-mode kernels (``set_num_sms``): the ``num_sms`` of the configs
    #: ``get_dispatch_config`` / ``get_combine_config`` return.
    num_sms: int = DEFAULT_NUM_SMS

    @classmethod
    def set_num_sms(cls, new_num_sms: int) -> None:
        """DeepEP's SM count of its high-throughput kernels, a class-level setting: checked (a
        positive even int: TypeError / ValueError naming ``new_num_sms``) and kept in
        ``Buffer.num_sms``, which the default normal-mode configs carry (their channels,
        ``num_sms // 2``, count the handle's channel matrices). The low-latency calls do not use
        it (nor do DeepEP's): llcomm's kernels size their grid themselves (one block per SM up
        to ``llcomm.ep.layout.DEFAULT_NUM_BLOCKS``, or ``LLCOMM_EP_NUM_BLOCKS``)."""
        if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int):
            raise TypeError(f"{PREFIX}.set_num_sms: new_num_sms={new_num_sms!r}; expected an int")
        if new_num_sms <= 0 or new_num_sms % 2:
            raise ValueError(f"{PREFIX}.set_num_sms: new_num_sms={new_num_sms}; expected a "
                             "positive even number of SMs, as DeepEP's")
        cls.num_sms = new_num_sms

    @staticmethod
    def is_sm90_compiled() -> bool:
        """DeepEP: whether its build includes the SM90 features (FP8 casts). llcomm has no
        build of its own (its kernels compile for the GPU at hand; on CPU the reference backend
        runs on torch) and offers FP8 dispatch on every backend: True."""
        return True

    @staticmethod
    def capture() -> EventOverlap:
        """An ``EventOverlap`` holding an ``EventHandle`` recorded now on the current CUDA
        stream (complete, with no event, without CUDA)."""
        return EventOverlap(EventHandle())

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        """The stream this buffer's communication runs on. llcomm uses **no stream of its
        own**: every call runs on the caller's current stream, so this is
        ``torch.cuda.current_stream()`` of the buffer's device, read now (``with
        torch.cuda.stream(buffer.get_comm_stream()):`` changes nothing). None where the buffer
        runs on the CPU (the reference backend over gloo: its calls are complete when they
        return), or, before the first call, where there is no CUDA."""
        ep = self._ep
        if ep is not None:
            return torch.cuda.current_stream(ep.device) if ep.device.type == "cuda" else None
        return torch.cuda.current_stream() if torch.cuda.is_available() else None

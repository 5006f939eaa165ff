"""DeepEP's low-latency API on ``llcomm.EPBuffer``: ``import llcomm.deep_ep as deep_ep`` in
place of ``import deep_ep`` for the low-latency mode (docs/deep_ep.md).

``Buffer`` (``buffer``) takes DeepEP's constructor arguments and offers its low-latency calls
with DeepEP's arguments, tuples and layouts; ``convert`` turns ``EPBuffer``'s outputs into
DeepEP's layouts (source token and per-rank row ranges, column-major and UE8M0 scales), on a
GPU (peer backend) in one launch of ``kernels``' conversion kernel, elsewhere as torch ops;
``handle`` is DeepEP's handle tuple carrying llcomm's ``EPHandle``; ``event`` is
``EventOverlap``; ``masks`` holds shrink mode's mask calls (a mixin of ``Buffer``). Arguments llcomm
cannot honour raise NotImplementedError naming them.

This layer sits above ``llcomm.ep`` and uses its public API only; nothing in llcomm imports it.
"""
from .buffer import Buffer, Config, topk_idx_t
from .event import EventOverlap
from .handle import LowLatencyHandle

__all__ = ["Buffer", "Config", "EventOverlap", "LowLatencyHandle", "topk_idx_t"]

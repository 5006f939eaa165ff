"""MoE expert-parallel dispatch / combine: ``EPBuffer`` (``api``; its argument checks in
``checks``, ``EPHandle`` in ``handle``), the peer backend (``peer``, kernels in ``kernels/``), the
reference backend (``reference``), the two-level path across hosts (``hosts/``: its kernels,
host side, layout and reference exchange), the backends with rank masks
(``MASK_BACKENDS``), the buffer layout and size hint (``layout``: a handle lives for
``HANDLE_SLOTS`` dispatches, ``EPBuffer.handle_slots`` with two sends in flight: ``inflight``)
and ``DeepEPOutputs`` (``deep_layouts``: ``dispatch(deep_ep=...)``).
"""
from .api import EPBuffer, EPHandle
from .deep_layouts import DeepEPOutputs
from .layout import HANDLE_SLOTS
from .masks import MASK_BACKENDS

__all__ = ["EPBuffer", "EPHandle", "DeepEPOutputs", "HANDLE_SLOTS", "MASK_BACKENDS"]

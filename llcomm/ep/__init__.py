"""MoE expert-parallel dispatch / combine: ``EPBuffer`` (``api``; its argument checks in
``checks``, ``EPHandle`` in ``handle``), the peer backend (``peer``, kernels in ``kernels/``), the
reference backend (``reference``), the buffer layout and size hint (``layout``) and the FP8
format (``fp8``)."""
from .api import EPBuffer, EPHandle

__all__ = ["EPBuffer", "EPHandle"]

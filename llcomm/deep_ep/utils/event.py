"""DeepEP 2's ``deep_ep.utils.event``: the same ``EventHandle`` and ``EventOverlap``."""
from ..event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]

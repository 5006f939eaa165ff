"""DeepEP's ``deep_ep.utils``: ``from llcomm.deep_ep.utils import EventHandle, EventOverlap``
works as DeepEP's does (``event`` is DeepEP 2's module path of the same classes)."""
from ..event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]

"""Op handles: the int that names a Communicator or EPBuffer to the torch.library ops
(``llcomm.ops``), which take only tensors and plain values."""
from __future__ import annotations

import itertools
import weakref

_objects: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_next_handle = itertools.count(1)


def register(obj) -> int:
    """Give ``obj`` (a Communicator or EPBuffer) its ``op_handle`` and return it.

    Called by the constructors; calling it again returns the same int. The registry holds a weak
    reference, so registering keeps nothing alive. Handles are per process and never reused.
    """
    h = getattr(obj, "op_handle", None)
    if h is None:
        h = next(_next_handle)
        _objects[h] = obj
        obj.op_handle = h
    return h


def lookup(h: int, fn: str):
    obj = _objects.get(h)
    if obj is None:
        raise ValueError(f"llcomm.ops.{fn}: no live Communicator or EPBuffer has op_handle={h} "
                         "in this process (pass obj.op_handle of an object that is still alive)")
    return obj


def handle_of(obj) -> int:
    h = getattr(obj, "op_handle", None)
    return h if h is not None else register(obj)

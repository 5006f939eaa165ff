"""``LowLatencyHandle``: DeepEP's handle tuple, carrying llcomm's ``EPHandle`` for combine."""
from __future__ import annotations


class LowLatencyHandle(tuple):
    """The handle ``Buffer.low_latency_dispatch`` returns: DeepEP's five-tuple
    ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)``, so code
    that indexes or unpacks it works unchanged, plus what ``low_latency_combine`` needs.

    Attributes:
        ep_handle: the ``llcomm.EPHandle`` of the dispatch (rows, slot, lifetime).
        combine_buffer_taken: ``get_next_low_latency_combine_buffer`` was called with this
            handle (``low_latency_combine(..., zero_copy=True)`` reads that tensor).

    Combine takes only handles of this class: a tuple rebuilt by hand lacks the dispatch's
    state. Like DeepEP's, a handle lives until two more dispatches have been made.
    """

    def __new__(cls, src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden,
                num_experts, ep_handle, owner):
        self = super().__new__(cls, (src_info, layout_range, num_max_dispatch_tokens_per_rank,
                                     hidden, num_experts))
        self.ep_handle = ep_handle
        self.combine_buffer_taken = False
        self._owner = owner
        return self

    def __repr__(self):
        return (f"LowLatencyHandle(dispatch #{self.ep_handle.index}, "
                f"num_max_dispatch_tokens_per_rank={self[2]}, hidden={self[3]}, "
                f"num_experts={self[4]})")

"""``EPHandle``: what ``EPBuffer.combine`` needs to know about one ``dispatch``."""
from __future__ import annotations

import torch


class EPHandle:
    """What ``combine`` needs to know about one ``dispatch``; returned by ``dispatch``.

    Attributes:
        num_tokens, topk: the dispatch's ``x.shape[0]`` and ``topk_idx.shape[1]``.
        recv_count: ``[num_local_experts]`` int32, rows of ``recv_x`` filled per local expert
            (the same tensor ``dispatch`` returned).
        src_info: ``[num_local_experts, num_ranks * max_tokens]`` int32; row ``j <
            recv_count[e]`` of expert e came from rank ``src_info[e, j] // max_tokens``, token
            ``src_info[e, j] % max_tokens``. Entries past ``recv_count[e]`` are unspecified.

        carries_weights: True when the dispatch was given ``topk_weights`` (they travelled with
            it; ``combine`` then takes ``topk_weights=None``).

    Lifetime: valid until two more ``dispatch`` calls of the same buffer have been made (the
    buffer keeps two handle slots and reuses the older); ``combine`` refuses an older handle.
    On the peer backend ``recv_count``, ``src_info`` and carried weights live in that slot too.
    """

    __slots__ = ("_owner", "index", "num_tokens", "topk", "recv_count", "src_info", "_state",
                 "carries_weights", "_weights")

    def __init__(self, owner, index, num_tokens, topk, recv_count, src_info, state,
                 weights=None, carries_weights=False):
        self._owner = owner
        self.index = index
        self.num_tokens = num_tokens
        self.topk = topk
        self.recv_count = recv_count
        self.src_info = src_info
        self._state = state
        self.carries_weights = carries_weights
        self._weights = weights         # reference backend: the dispatch's copy

    def src_rank(self) -> torch.Tensor:
        """``[num_local_experts, num_ranks * max_tokens]`` source rank of every row (new tensor)."""
        return torch.div(self.src_info, self._owner.max_tokens, rounding_mode="floor")

    def src_token(self) -> torch.Tensor:
        """``[num_local_experts, num_ranks * max_tokens]``: the source token of every row (a new
        tensor)."""
        return torch.remainder(self.src_info, self._owner.max_tokens)

    def __repr__(self):
        return f"EPHandle(dispatch #{self.index}, num_tokens={self.num_tokens}, topk={self.topk})"

"""Rank masks of ``EPBuffer`` (``enable_masks=True``; peer backend, or SHMEM across hosts): the
methods that read and change this rank's mask, as a mixin of ``EPBuffer``, and the one
device-side update of the mask word that both kernel backends and the interpreter tests share.

The mask is word ``layout.ERR_MASK`` of the kernels' private ``err`` tensor (bit s: rank
s is masked; ``kernels/common.py``). The kernels read it at the start of each call and OR in the
ranks a wait gives up on; the host changes it only with small torch ops on the caller's stream,
so every change is ordered with the calls around it and is captured by a CUDA graph.
"""
from __future__ import annotations

import torch

from ..runtime import validate as V
from .layout import ERR_MASK

#: Backends with rank masks: a torch.distributed collective cannot leave a member out.
MASK_BACKENDS = ("peer", "shmem")
#: Most ranks a buffer with rank masks can have (the kernels keep the mask in 32 bits).
MAX_MASK_RANKS = 32


def update_mask_word(err: torch.Tensor, rank: int, masked: bool) -> None:
    """Set (``masked``) or clear bit ``rank`` of ``err[ERR_MASK]``: one in-place op on
    ``err``'s device and the current stream, no host synchronisation, capturable."""
    word = err[ERR_MASK:ERR_MASK + 1]
    if masked:
        word.bitwise_or_(1 << rank)
    else:
        word.bitwise_and_(~(1 << rank))


def check_mask_args(fn: str, num_ranks: int, rank, masked, rank_name: str = "rank",
                    masked_name: str = "masked") -> None:
    """``rank`` an int in ``[0, num_ranks)`` and ``masked`` True or False, else one TypeError /
    ValueError naming each bad argument (``llcomm.<fn>: ...``)."""
    pr = V.Problems(fn)
    if isinstance(rank, bool) or not isinstance(rank, int):
        pr.add(f"{rank_name}={rank!r}; expected an int rank of the group", type_error=True)
    elif not 0 <= rank < num_ranks:
        pr.add(f"{rank_name}={rank}; expected a rank in [0, {num_ranks})")
    if not isinstance(masked, bool):
        pr.add(f"{masked_name}={masked!r}; expected True or False", type_error=True)
    pr.raise_if_any()


class RankMasks:
    """``EPBuffer``'s rank-mask methods (docs/ep.md, "Rank masks"). Each raises ValueError
    unless the buffer has ``enable_masks=True`` (not on the reference backend); none is a
    collective or synchronises the host."""

    def query_mask(self) -> torch.Tensor:
        """The ranks this rank treats as absent: a new ``[num_ranks]`` int32 tensor on the
        buffer's device, 1 for a masked rank, else 0 (this rank's view; peers may differ).

        Stream-ordered, no host synchronisation: it reflects every call queued before it on the
        current stream (``.tolist()`` waits for them). Not a collective. Raises ValueError unless
        the buffer has ``enable_masks=True`` (not on the reference backend).
        """
        self._check_masks("query_mask")
        return self._impl.query_mask()

    def clean_mask(self) -> None:
        """Unmask every rank: later calls wait for all ranks again. Stream-ordered (takes effect
        for the calls issued after it on the current stream); not a collective, no sync.

        Call it once the masked ranks are back **in step**: they have made the same calls as
        this rank (the flags carry a call count, so a rank that skipped calls is not seen as
        arrived). A rank that is still missing is simply masked again by the next call, after
        one more timeout. Raises ValueError unless the buffer has ``enable_masks=True`` (peer
        backend only)."""
        self._check_masks("clean_mask")
        self._impl.clean_mask()

    def set_mask(self, rank: int, masked: bool) -> None:
        """Mask (``masked=True``) or unmask (``masked=False``) one rank by hand, in this rank's
        mask only (DeepEP's ``low_latency_update_mask_buffer``).

        A rank masked by hand is absent exactly as one a wait gave up on (docs/ep.md, "Rank
        masks"): later calls on this rank do not wait for it, receive no rows from it (dispatch:
        as if it sent no token), leave its partials out of each sum (combine) and compute none
        for its tokens; data is still pushed to it. Any rank may be masked, this one included
        (its own tokens are then not served by its own experts). Unmasking follows
        ``clean_mask``'s rule: the rank must be back in step, else the next call masks it again
        after one timeout. The other ranks' masks do not change: a peer that still waits for
        this rank while this rank masks it gets unspecified results for its tokens here.

        Stream-ordered (it takes effect for the calls issued after it on the current stream),
        no host synchronisation, capturable in a CUDA graph; not a collective. Raises
        ValueError unless the buffer has ``enable_masks=True``; TypeError / ValueError naming
        ``rank`` (an int in ``[0, num_ranks)``) or ``masked`` (a bool), before anything
        changes (the arguments are checked first, whatever the buffer)."""
        check_mask_args("EPBuffer.set_mask", self.num_ranks, rank, masked)
        self._check_masks("set_mask")
        self._impl.set_mask(rank, masked)

    def _check_masks(self, fn: str) -> None:
        if not self.enable_masks:
            raise ValueError(f"llcomm.EPBuffer.{fn}: this buffer was created without rank masks; "
                             "pass enable_masks=True to EPBuffer(...)")

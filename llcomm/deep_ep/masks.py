"""Shrink mode of ``llcomm.deep_ep.Buffer`` (``enable_shrink=True``): DeepEP's three mask calls
on ``EPBuffer``'s rank masks, as a mixin of ``Buffer`` (docs/deep_ep.md, "Rank masks")."""
from __future__ import annotations

import torch

from ..ep import EPBuffer
from ..errors import UnsupportedConfigError
from ..runtime import validate as V
from .checks import PREFIX, check_bools, check_int


class ShrinkMasks:
    """``Buffer``'s mask calls. The ``Buffer`` provides ``group``, ``group_size``,
    ``enable_shrink``, ``_backend``, ``_ep``, ``_early_mask`` and ``_check_open``."""

    def _masks(self, fn: str) -> EPBuffer | None:
        self._check_open(fn)
        if self.enable_shrink:
            return self._ep
        # before the EPBuffer exists: the reference backend where asked for or without CUDA (a
        # gloo group of GPU ranks may run the peer backend: then this is the ValueError below)
        if (self._ep.backend if self._ep is not None else self._backend) == "reference" \
                or (self._ep is None and not torch.cuda.is_available()):
            raise UnsupportedConfigError(
                f"{PREFIX}.{fn}: rank masks need the peer backend or the two-level kernels, and "
                "this buffer runs on the reference backend: a torch.distributed collective "
                "cannot leave a member out")
        raise ValueError(f"{PREFIX}.{fn}: this Buffer was created without enable_shrink=True "
                         "(rank masks)")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask (``mask=False``) rank ``rank_to_mask`` in this rank's
        mask: ``EPBuffer.set_mask(rank_to_mask, mask)``, stream-ordered, no host sync, not a
        collective. A masked rank is not waited for, its rows are not received and its partials
        count as zero (docs/ep.md, "Rank masks"). Before the first call has created the
        EPBuffer the change is kept and applied when it is created (``low_latency_query_mask_
        buffer`` reports it meanwhile). TypeError / ValueError naming ``rank_to_mask`` (an int
        in ``[0, num_ranks)``) or ``mask`` (a bool), before anything changes."""
        fn = "low_latency_update_mask_buffer"
        self._check_open(fn)
        pr = V.Problems(f"deep_ep.Buffer.{fn}")
        if check_int(pr, "rank_to_mask", rank_to_mask) and rank_to_mask >= self.group_size:
            pr.add(f"rank_to_mask={rank_to_mask}; expected a rank in [0, {self.group_size})")
        check_bools(pr, mask=mask)
        pr.raise_if_any()
        ep = self._masks(fn)
        if ep is not None:
            ep.set_mask(rank_to_mask, mask)
        elif mask:
            self._early_mask |= 1 << rank_to_mask
        else:
            self._early_mask &= ~(1 << rank_to_mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write this rank's view of the masked ranks into ``mask_status`` (``[num_ranks]``
        int32, 1 = masked): ``EPBuffer.query_mask()``, stream-ordered, no host sync. Before the
        first call has created the EPBuffer: the ranks masked by hand so far."""
        ep = self._masks("low_latency_query_mask_buffer")
        pr = V.Problems("deep_ep.Buffer.low_latency_query_mask_buffer")
        if not isinstance(mask_status, torch.Tensor):
            pr.add(f"mask_status must be a torch.Tensor, got {type(mask_status).__name__}",
                   type_error=True)
        elif mask_status.dtype != torch.int32:
            pr.add(f"mask_status has dtype {mask_status.dtype}; expected torch.int32",
                   type_error=True)
        elif tuple(mask_status.shape) != (self.group_size,):
            pr.add(f"mask_status has shape {tuple(mask_status.shape)}; expected "
                   f"[num_ranks] = [{self.group_size}]")
        elif ep is not None and mask_status.device != ep.device:
            pr.add(f"mask_status is on {mask_status.device}; expected {ep.device}")
        pr.raise_if_any()
        if ep is None:      # the masks set before the EPBuffer exists
            mask_status.copy_(torch.tensor([(self._early_mask >> r) & 1
                                            for r in range(self.group_size)], dtype=torch.int32,
                                           device="cpu"))
        else:
            mask_status.copy_(ep.query_mask())

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (``EPBuffer.clean_mask()``): stream-ordered, not a collective.
        Call it once the masked ranks are back in step (docs/ep.md, "Rank masks")."""
        ep = self._masks("low_latency_clean_mask_buffer")
        self._early_mask = 0
        if ep is not None:
            ep.clean_mask()

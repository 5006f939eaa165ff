"""The local buffer of ``llcomm.deep_ep.Buffer``: the memory of the zero-copy combine, which
``get_local_buffer_tensor`` views and ``get_next_low_latency_combine_buffer`` hands out
(a mixin of ``Buffer``; docs/deep_ep.md, "The local buffer")."""
from __future__ import annotations

import torch

from ..runtime import validate as V
from .checks import PREFIX, check_bools, check_handle, check_int, refuse


class LocalBuffer:
    """``Buffer``'s local buffer: one byte region per rank holding the ``ep.handle_slots``
    zero-copy combine inputs ``[L, W * T, hidden]`` (the EPBuffer's dtype) back to back,
    allocated by the first call that needs it once the EPBuffer exists. In DeepEP these live in
    the RDMA buffer, which ``get_local_buffer_tensor(..., use_rdma_buffer=True)`` views; here
    too. The protocol's state (flags carrying call counts, armed receive slots, handle slots)
    stays inside the EPBuffer, outside this region, so nothing written here can break a call.

    The ``Buffer`` provides ``_ep``, ``_local``, ``_dispatches``, ``num_nvl_bytes`` and
    ``_check_open``."""

    def _region(self) -> torch.Tensor | None:
        """The region (uint8, uninitialised when made: a memset would be captured into a CUDA
        graph whose capture makes it), or None before the EPBuffer exists."""
        ep = self._ep
        if ep is None:
            return None
        if self._local is None:
            slot = ep.num_local_experts * ep.num_ranks * ep.max_tokens * ep.hidden
            self._local = torch.empty(ep.handle_slots * slot * ep.dtype.itemsize,
                                      dtype=torch.uint8, device=ep.device)
        return self._local

    def _combine_buffer(self, handle) -> torch.Tensor:
        """The zero-copy combine input of ``handle``'s slot: a view of the region."""
        ep = self._ep
        shape = (ep.num_local_experts, ep.num_ranks * ep.max_tokens, ep.hidden)
        n = shape[0] * shape[1] * shape[2]
        slot = handle.ep_handle.index % ep.handle_slots
        return self._region().view(ep.dtype)[slot * n:(slot + 1) * n].view(shape)

    def get_next_low_latency_combine_buffer(self, handle) -> torch.Tensor:
        """The ``[L, W * T, hidden]`` tensor (x's dtype of the dispatch) for the experts to
        write their outputs into before ``low_latency_combine(..., zero_copy=True)``, which
        reads it in place of ``x``. One per handle slot (S = ``ep_buffer.handle_slots``, 4:
        handles k and k + S share it), a view of the local buffer (``get_local_buffer_tensor``):
        slot ``k % S`` starts at byte ``(k % S) * L * W * T * hidden * itemsize``. llcomm's
        combine reads any input in place, so this saves an allocation, not a copy. ValueError
        for a handle S dispatches old."""
        self._check_open("get_next_low_latency_combine_buffer")
        pr = V.Problems("deep_ep.Buffer.get_next_low_latency_combine_buffer")
        h = check_handle(self, pr, handle)
        slots = self._ep.handle_slots if self._ep is not None else 0
        if h is not None and self._dispatches - h.ep_handle.index > slots:
            pr.add(f"handle is from dispatch #{h.ep_handle.index}, whose slot dispatch "
                   f"#{h.ep_handle.index + slots} has reused (a handle lives for "
                   f"{slots} dispatches)")
        pr.raise_if_any()
        t = self._combine_buffer(h)
        h.combine_buffer_taken = True
        return t

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None = None,
                                offset: int = 0, use_rdma_buffer: bool = False) -> torch.Tensor:
        """This rank's communication buffer as a ``dtype`` tensor: a view, not a copy.

        With ``use_rdma_buffer=True``, the low-latency buffer: the region that holds the
        zero-copy combine inputs of its handle slots (``ep_buffer.handle_slots * num_experts *
        T * hidden * itemsize`` bytes, allocated by the first call that
        needs it; ``get_next_low_latency_combine_buffer`` returns views of it). Zeroing it
        (``.zero_()``, as engines do after a fault) leaves the buffer usable: the next dispatch
        and combine work as before, since llcomm's protocol state (flags carrying call counts,
        armed receive slots) is kept in the EPBuffer, outside this region. A zero-copy combine
        reads what is there when it runs, so fill ``get_next_low_latency_combine_buffer(handle)``
        after zeroing, as before every zero-copy combine. Before the first call has created the
        EPBuffer there is no region yet: an empty tensor.

        With ``use_rdma_buffer=False`` (DeepEP's default), DeepEP's NVLink buffer of its
        high-throughput mode: llcomm has none, so with ``num_nvl_bytes=0`` an empty tensor, as
        DeepEP gives in low-latency mode; else NotImplementedError.

        Args:
            dtype: the element type of the view (any ``torch.dtype``).
            size: optional ``torch.Size`` (or tuple of ints): the first ``size.numel()``
                elements, viewed as that shape (ValueError if the buffer holds fewer).
            offset: where the view starts, in **bytes**, as DeepEP's implementation applies
                it; a multiple of ``dtype``'s item size, at most the buffer's size.
            use_rdma_buffer: see above.

        Returns:
            1-D ``[(nbytes - offset) // itemsize]`` of ``dtype`` on the buffer's device, or
            ``size``.
        """
        fn = "get_local_buffer_tensor"
        self._check_open(fn)
        pr = V.Problems(f"deep_ep.Buffer.{fn}")
        check_bools(pr, use_rdma_buffer=use_rdma_buffer)
        if not isinstance(dtype, torch.dtype):
            pr.add(f"dtype={dtype!r}; expected a torch.dtype", type_error=True)
        shape = None
        if size is not None:
            if not isinstance(size, (tuple, list)) or not all(
                    isinstance(d, int) and not isinstance(d, bool) for d in size):
                pr.add(f"size={size!r}; expected a torch.Size or a tuple of ints",
                       type_error=True)
            elif any(d < 0 for d in size):
                pr.add(f"size={tuple(size)}; dimensions must not be negative")
            else:
                shape = torch.Size(size)
        check_int(pr, "offset", offset)
        pr.raise_if_any()
        if not use_rdma_buffer and self.num_nvl_bytes:
            refuse(fn, {"use_rdma_buffer=False": f"there is no NVLink buffer of DeepEP's "
                        f"high-throughput mode (num_nvl_bytes={self.num_nvl_bytes}); the "
                        "low-latency buffer is use_rdma_buffer=True (docs/deep_ep.md)"})
        region = self._region() if use_rdma_buffer else None
        if region is None:
            ep = self._ep
            device = ep.device if ep is not None else (
                torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                else torch.device("cpu"))
            region = torch.empty(0, dtype=torch.uint8, device=device)
        item = dtype.itemsize
        if offset % item or offset > region.numel():
            pr.add(f"offset={offset} (bytes); expected a multiple of {dtype}'s {item} bytes, "
                   f"at most the buffer's {region.numel()} bytes")
        pr.raise_if_any()
        n = (region.numel() - offset) // item
        t = region[offset:offset + n * item].view(dtype)
        if shape is None:
            return t
        if shape.numel() > n:
            raise ValueError(f"{PREFIX}.{fn}: size={tuple(shape)} holds {shape.numel()} "
                             f"elements; the buffer has {n} of {dtype} from offset={offset}")
        return t[:shape.numel()].view(shape)

"""``EPBuffer.size_hint``: the symmetric memory an ``EPBuffer`` takes per rank, on one host
(``layout.ep_layout``) or across hosts (``hosts.peer.make_layout``)."""
from __future__ import annotations

import torch

from ..errors import UnsupportedConfigError
from ..runtime import validate as V
from ..runtime.settings import EPSettings
from .hosts.peer import hosts_region_bytes
from .inflight import check_sends_in_flight
from .layout import default_num_blocks, ep_layout, num_sets

#: The token dtypes an EPBuffer takes.
EP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, for messages."""
    return str(dtype).removeprefix("torch.")


def size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
              num_experts: int, dtype: torch.dtype = torch.bfloat16, fp8: bool = False,
              num_ranks_per_host: int | None = None, sends_in_flight: int = 1) -> int:
    """Bytes of symmetric memory the peer backend allocates per rank for these arguments.

    Computed by the same ``ep_layout`` the constructor uses. About ``4 * num_ranks *
    max_tokens * hidden * itemsize`` (two sets of a dispatch and a combine receive region of
    one slot per (rank, token)) plus small metadata; docs/ep.md has a table. ``fp8=True``
    (a buffer for FP8 dispatches only): the dispatch region holds ``hidden * 33 / 32`` bytes
    per slot in place of ``hidden * itemsize``, about 24% less in total for bf16.

    ``num_ranks_per_host``: ranks on several hosts (fewer than ``num_ranks`` per host, a
    divisor of it): the bytes of the SHMEM heap the two-level kernels take per rank
    (``hosts.peer.make_layout``; docs/multihost.md), for GPUs of at least 128 SMs (fewer
    SMs give fewer flags, a few KB less).

    ``sends_in_flight``: the buffer's (``EPBuffer(sends_in_flight=2)``: four sets, twice the
    bytes; one host only, UnsupportedConfigError with ``num_ranks_per_host``).
    """
    if dtype not in EP_DTYPES:
        raise TypeError(f"llcomm.EPBuffer.size_hint: dtype={dtype}; expected one of "
                        f"{', '.join(map(dtype_name, EP_DTYPES))}")
    if not isinstance(fp8, bool):
        raise TypeError(f"llcomm.EPBuffer.size_hint: fp8={fp8!r}; expected True or False")
    pr = V.Problems("EPBuffer.size_hint")
    sends_in_flight = check_sends_in_flight(pr, sends_in_flight)
    pr.raise_if_any()
    if num_ranks_per_host is not None and num_ranks_per_host != num_ranks:
        if sends_in_flight > 1:
            raise UnsupportedConfigError(
                f"llcomm.EPBuffer.size_hint: sends_in_flight={sends_in_flight} with "
                "num_ranks_per_host: the two-level exchange across hosts keeps one send half "
                "in flight")
        if not isinstance(num_ranks_per_host, int) or num_ranks_per_host < 1 \
                or num_ranks % num_ranks_per_host:
            raise ValueError(f"llcomm.EPBuffer.size_hint: num_ranks_per_host="
                             f"{num_ranks_per_host!r}; expected a divisor of num_ranks="
                             f"{num_ranks}")
        return hosts_region_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                  num_ranks_per_host, dtype.itemsize, fp8, num_experts)
    return ep_layout(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts,
                     dtype.itemsize, fp8=fp8, sets=num_sets(sends_in_flight),
                     num_blocks=default_num_blocks(EPSettings.read().num_blocks)).total_bytes

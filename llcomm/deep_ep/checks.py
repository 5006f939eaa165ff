"""Argument checks of ``llcomm.deep_ep.Buffer``'s calls: ValueError / TypeError through
``Problems`` (every bad argument named in one message), NotImplementedError for arguments llcomm
cannot honour (named, never ignored)."""
from __future__ import annotations

import torch

from ..runtime import validate as V
from .handle import LowLatencyHandle

PREFIX = "llcomm.deep_ep.Buffer"
#: The section of docs/deep_ep.md that lists DeepEP's names and what each does here.
DOC_SECTION = "DeepEP's names"


def refuse(fn: str, reasons: dict[str, str]) -> None:
    """NotImplementedError naming every argument in ``reasons`` (name -> why), if any."""
    if reasons:
        raise NotImplementedError(f"{PREFIX}.{fn}: " + "; ".join(
            f"{name} is not supported: {why}" for name, why in reasons.items()))


def not_implemented(name: str, why: str) -> None:
    """NotImplementedError for a DeepEP name llcomm does not serve: ``name`` (as written after
    ``llcomm.deep_ep.``), why, and where the status of every name is listed."""
    raise NotImplementedError(f"llcomm.deep_ep.{name} is not implemented: {why} "
                              f"(docs/deep_ep.md, {DOC_SECTION!r})")


def check_bools(pr: V.Problems, **values) -> None:
    """Each value is True or False."""
    for name, v in values.items():
        if not isinstance(v, bool):
            pr.add(f"{name}={v!r}; expected True or False", type_error=True)


def check_int(pr: V.Problems, name: str, v, lo: int = 0) -> bool:
    """``v`` is an int of at least ``lo``; True when it is."""
    if isinstance(v, bool) or not isinstance(v, int):
        pr.add(f"{name}={v!r}; expected an int", type_error=True)
        return False
    if v < lo:
        pr.add(f"{name}={v}; expected at least {lo}")
        return False
    return True


def check_stats(pr: V.Problems, stats, ep) -> None:
    """``cumulative_local_expert_recv_stats``: int32 ``[num_local_experts]`` on the device,
    contiguous."""
    name = "cumulative_local_expert_recv_stats"
    if not isinstance(stats, torch.Tensor):
        pr.add(f"{name} must be a torch.Tensor or None, got {type(stats).__name__}",
               type_error=True)
    elif stats.dtype != torch.int32:
        pr.add(f"{name} has dtype {stats.dtype}; expected torch.int32", type_error=True)
    elif tuple(stats.shape) != (ep.num_local_experts,):
        pr.add(f"{name} has shape {tuple(stats.shape)}; expected [num_local_experts] = "
               f"[{ep.num_local_experts}]")
    elif stats.device != ep.device:
        pr.add(f"{name} is on {stats.device}; expected {ep.device}")
    elif not stats.is_contiguous():
        pr.add(f"{name} is not contiguous; the counts are added into it in place, so pass a "
               "contiguous tensor")


def check_handle(buf, pr: V.Problems, handle) -> LowLatencyHandle | None:
    """The handle one of ``buf``'s dispatches returned (lifetime: the EPBuffer checks it)."""
    if not isinstance(handle, LowLatencyHandle):
        pr.add(f"handle must be the one low_latency_dispatch returned (a LowLatencyHandle), "
               f"got {type(handle).__name__}: a tuple rebuilt by hand lacks the dispatch's "
               "state", type_error=True)
    elif handle._owner is not buf:
        pr.add("handle comes from another deep_ep.Buffer; pass one this buffer's "
               "low_latency_dispatch returned")
    else:
        return handle
    return None


def check_cost_stats(pr: V.Problems, name: str, stats, num_ranks: int, device=None) -> None:
    """DeepEP's wait-cost statistics (``dispatch_wait_recv_cost_stats`` /
    ``combine_wait_recv_cost_stats``): None, or int64 ``[num_ranks]``, contiguous, on
    ``device`` (not checked while None: before the EPBuffer exists)."""
    if stats is None:
        return
    if not isinstance(stats, torch.Tensor):
        pr.add(f"{name} must be a torch.Tensor or None, got {type(stats).__name__}",
               type_error=True)
    elif stats.dtype != torch.int64:
        pr.add(f"{name} has dtype {stats.dtype}; expected torch.int64", type_error=True)
    elif tuple(stats.shape) != (num_ranks,):
        pr.add(f"{name} has shape {tuple(stats.shape)}; expected [num_ranks] = [{num_ranks}]")
    elif device is not None and stats.device != device:
        pr.add(f"{name} is on {stats.device}; expected {device}")
    elif not stats.is_contiguous():
        pr.add(f"{name} is not contiguous")


def refuse_cost_stats(buf, fn: str, name: str, stats) -> None:
    """NotImplementedError naming ``name`` when wait-cost statistics are asked of a Buffer that
    runs on the reference backend."""
    if stats is None:
        return
    ep = buf.ep_buffer
    # Before the EPBuffer exists (it is made by the first call), refuse what is sure to run on
    # the reference backend without making it: asked for, or "auto" where this rank has no
    # GPU. What only the group can tell (ranks on two hosts, ...) is refused once it exists.
    if (ep.backend == "reference" if ep is not None else
            buf._backend == "reference" or (buf._backend == "auto"
                                            and not torch.cuda.is_available())):
        refuse(fn, {name: "it needs the kernels (they time their waits per source rank), and "
                    "this buffer runs on the reference backend, whose collectives have no "
                    "receive from one rank to time; pass None"})


#: ``topk_idx`` dtypes taken: DeepEP's ``topk_idx_t`` is int64, or int32 in DeepEP builds with
#: 32-bit top-k indices (``TOPK_IDX_BITS=32``); EPBuffer takes int64.
TOPK_DTYPES = (torch.int64, torch.int32)


def check_topk_dtype(pr: V.Problems, topk_idx) -> None:
    """``topk_idx``, when a tensor, is int64 or int32 (its other checks are EPBuffer's)."""
    if isinstance(topk_idx, torch.Tensor) and topk_idx.dtype not in TOPK_DTYPES:
        pr.add(f"topk_idx has dtype {topk_idx.dtype}; expected torch.int64 (topk_idx_t) or "
               "torch.int32", type_error=True)


def topk_int64(topk_idx):
    """``topk_idx`` as EPBuffer takes it: int32 converted once (one small kernel on the
    current stream), anything else returned as it is (int64 without a copy)."""
    if isinstance(topk_idx, torch.Tensor) and topk_idx.dtype == torch.int32:
        return topk_idx.to(torch.int64)
    return topk_idx

"""Argument checks of ``EPBuffer``'s calls: each adds what is wrong to the call's
``Problems`` (every bad argument named in one message, nothing touched before it is raised)."""
from __future__ import annotations

import torch

from ..runtime import validate as V
from ..runtime.fp8_format import FP8_BLOCK, FP8_DTYPE, SCALE_DTYPE
from .handle import EPHandle
from .layout import MAX_TOPK


def check_topk(buf, pr: V.Problems, topk_idx, num_tokens: int | None) -> bool:
    if not V.check_tensor(pr, "topk_idx", topk_idx, buf.device, dtypes=(torch.int64,)):
        return False
    if topk_idx.dim() != 2:
        pr.add(f"topk_idx has shape {tuple(topk_idx.shape)}; expected 2-D [num_tokens, topk]")
        return False
    if num_tokens is not None and topk_idx.shape[0] != num_tokens:
        pr.add(f"topk_idx has {topk_idx.shape[0]} rows; expected num_tokens={num_tokens}")
        return False
    if not 1 <= topk_idx.shape[1] <= MAX_TOPK:
        pr.add(f"topk_idx has topk={topk_idx.shape[1]}; expected 1 to {MAX_TOPK}")
        return False
    if topk_idx.device.type == "cpu" and topk_idx.numel():
        # Host tensors are checked here; device tensors on the device (see check()).
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= buf.num_experts:
            pr.add(f"topk_idx holds values in [{lo}, {hi}]; expected -1 (no expert) or an "
                   f"expert id in [0, {buf.num_experts})")
            return False
    return True


def check_out(buf, pr: V.Problems, name: str, t, shape, *, written: bool = True) -> None:
    """A tensor of the buffer's dtype and ``shape`` (None: nothing to check); ``written``:
    the call writes into it (an ``out=``), not reads it (``expert_out``)."""
    if t is None:
        return
    if not V.check_tensor(pr, name, t, buf.device, dtypes=(buf.dtype,), written=written):
        return
    if tuple(t.shape) != tuple(shape):
        pr.add(f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}")


def check_fp8(buf, pr: V.Problems, use_fp8, round_scale, out) -> bool:
    """Check use_fp8 / round_scale and the out= that goes with them; True for FP8."""
    ok = True
    for name, v in (("use_fp8", use_fp8), ("round_scale", round_scale)):
        if not isinstance(v, bool):
            pr.add(f"{name}={v!r}; expected True or False", type_error=True)
            ok = False
    if not ok:
        return False
    if round_scale and not use_fp8:
        pr.add("round_scale=True needs use_fp8=True (it rounds the FP8 scales)")
    if use_fp8 and buf.hidden % FP8_BLOCK:
        pr.add(f"use_fp8=True needs hidden to be a multiple of {FP8_BLOCK} (one scale per "
               f"{FP8_BLOCK} channels); this buffer has hidden={buf.hidden}")
        return False
    if not use_fp8 and buf.fp8:
        pr.add("use_fp8=False on a buffer created with fp8=True: its dispatch region holds "
               "FP8 rows only; pass use_fp8=True or create the EPBuffer with fp8=False")
        return False
    if not use_fp8:
        check_out(buf, pr, "out", out, buf._recv_shape())
        return False
    if out is None:
        return True
    if not (isinstance(out, tuple) and len(out) == 2):
        pr.add("out must be the pair (recv_x_fp8, recv_scales) with use_fp8=True, got "
               f"{type(out).__name__}", type_error=True)
        return True
    for name, t, shape, dt in (("out[0]", out[0], buf._recv_shape(), FP8_DTYPE),
                               ("out[1]", out[1], buf._scales_shape(), SCALE_DTYPE)):
        if V.check_tensor(pr, name, t, buf.device, dtypes=(dt,), written=True) \
                and tuple(t.shape) != shape:
            pr.add(f"{name} has shape {tuple(t.shape)}; expected {shape}")
    return True


def check_weights(buf, pr: V.Problems, topk_weights, topk_idx) -> None:
    if V.check_tensor(pr, "topk_weights", topk_weights, buf.device, dtypes=(torch.float32,)) \
            and isinstance(topk_idx, torch.Tensor) \
            and tuple(topk_weights.shape) != tuple(topk_idx.shape):
        pr.add(f"topk_weights has shape {tuple(topk_weights.shape)}; expected "
               f"{tuple(topk_idx.shape)} (that of topk_idx)")


def check_handle(buf, pr: V.Problems, handle) -> bool:
    """The handle is one of this buffer's ``handle_slots`` latest dispatches; True when
    usable."""
    if not isinstance(handle, EPHandle):
        pr.add(f"handle must be the EPHandle a dispatch returned, got {type(handle).__name__}",
               type_error=True)
    elif handle._owner is not buf:
        pr.add("handle comes from another EPBuffer; pass the handle this buffer's dispatch "
               "returned")
    elif buf._dispatches - handle.index > buf.handle_slots:
        slots = buf.handle_slots
        pr.add(f"handle is from dispatch #{handle.index}, but dispatch #"
               f"{handle.index + slots} has reused its buffer slot (a handle lives for "
               f"{slots} dispatches): combine before dispatching again")
    else:
        return True
    return False


def check_wait_stats(buf, fn: str, pr: V.Problems, t) -> None:
    """``wait_stats``: None, or an int64 ``[num_ranks]`` contiguous tensor on the buffer's
    device; kernel backends only (NotImplementedError on the reference one, for a tensor that
    passes the other checks)."""
    if t is None:
        return
    if not V.check_tensor(pr, "wait_stats", t, buf.device, dtypes=(torch.int64,)):
        return
    if tuple(t.shape) != (buf.num_ranks,):
        pr.add(f"wait_stats has shape {tuple(t.shape)}; expected [num_ranks] = [{buf.num_ranks}]")
    elif buf.backend not in ("peer", "shmem"):
        raise NotImplementedError(
            f"llcomm.EPBuffer.{fn}: wait_stats needs the kernels (peer, or the two-level "
            f"kernels across hosts), and this buffer runs on the {buf.backend} backend (it "
            "moves the data in torch.distributed collectives, with no receive from one rank to "
            "time apart from the others); pass wait_stats=None")


def check_rail_fp8(buf, pr: V.Problems, rail_fp8) -> bool:
    """``rail_fp8``: a bool; True needs ``hidden`` a multiple of FP8_BLOCK (one scale per
    block). Returns whether the host sums cross hosts in FP8: only where the buffer spans
    hosts (within a host nothing crosses a rail, and the option changes nothing)."""
    if not isinstance(rail_fp8, bool):
        pr.add(f"rail_fp8 is {rail_fp8!r}; expected True or False")
        return False
    if rail_fp8 and buf.hidden % FP8_BLOCK:
        pr.add(f"rail_fp8=True needs hidden to be a multiple of {FP8_BLOCK} (one scale per "
               f"{FP8_BLOCK} channels); this buffer's hidden is {buf.hidden}")
    return rail_fp8 and buf.hosts.spans_hosts

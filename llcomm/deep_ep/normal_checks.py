"""Argument checks of ``llcomm.deep_ep.Buffer``'s normal-mode calls (``normal``): each adds
what is wrong to a ``Problems``, naming the argument and what was expected."""
from __future__ import annotations

import torch

from ..runtime import validate as V
from .checks import TOPK_DTYPES, check_int

#: What a dispatch's rows may hold: bf16 (or any float) values, or FP8 with per-128 scales.
FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPES = (torch.float32, torch.int32)


def check_int_arg(fn: str, name: str, v) -> None:
    pr = V.Problems(f"deep_ep.Buffer.{fn}")
    check_int(pr, name, v, 1)
    pr.raise_if_any()


def check_topk(pr: V.Problems, topk_idx, num_tokens: int | None = None) -> bool:
    """``topk_idx``: a contiguous 2-D int64 / int32 tensor (``num_tokens`` rows if given)."""
    if not isinstance(topk_idx, torch.Tensor):
        pr.add(f"topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}",
               type_error=True)
        return False
    if topk_idx.dtype not in TOPK_DTYPES:
        pr.add(f"topk_idx has dtype {topk_idx.dtype}; expected torch.int64 (topk_idx_t) or "
               "torch.int32", type_error=True)
        return False
    if topk_idx.dim() != 2 or (num_tokens is not None and topk_idx.shape[0] != num_tokens):
        pr.add(f"topk_idx has shape {tuple(topk_idx.shape)}; expected [num_tokens"
               f"{'' if num_tokens is None else f' = {num_tokens}'}, topk]")
        return False
    if not topk_idx.is_contiguous():
        pr.add("topk_idx is not contiguous")
        return False
    return True


def check_weights(pr: V.Problems, topk_weights, topk_idx) -> None:
    if V.check_tensor(pr, "topk_weights", topk_weights, topk_idx.device,
                      dtypes=(torch.float32,)) and topk_weights.shape != topk_idx.shape:
        pr.add(f"topk_weights has shape {tuple(topk_weights.shape)}; expected topk_idx's "
               f"{tuple(topk_idx.shape)}")


def check_x(pr: V.Problems, x):
    """(values, scales or None) of the dispatch's ``x``; (None, None) when it is bad."""
    scales = None
    if isinstance(x, tuple):
        if len(x) != 2:
            pr.add(f"x as a tuple must be (FP8 values, scales), got {len(x)} items",
                   type_error=True)
            return None, None
        x, scales = x
        if not isinstance(x, torch.Tensor) or x.dtype != FP8_DTYPE:
            pr.add(f"x[0] must be a {FP8_DTYPE} tensor, got "
                   f"{getattr(x, 'dtype', type(x).__name__)}", type_error=True)
            return None, None
    if not isinstance(x, torch.Tensor):
        pr.add(f"x must be a torch.Tensor or an FP8 tuple, got {type(x).__name__}",
               type_error=True)
        return None, None
    if x.dim() != 2 or not x.is_contiguous():
        pr.add(f"x must be a contiguous [num_tokens, hidden] tensor, got shape "
               f"{tuple(x.shape)}" + ("" if x.is_contiguous() else " (not contiguous)"))
        return None, None
    if scales is None and not x.is_floating_point():
        pr.add(f"x has dtype {x.dtype}; expected a float dtype (bfloat16) or an FP8 tuple",
               type_error=True)
        return None, None
    if scales is not None:
        if not isinstance(scales, torch.Tensor) or scales.dtype not in SCALE_DTYPES:
            pr.add(f"x[1] (scales) must be a float32 or int32 tensor, got "
                   f"{getattr(scales, 'dtype', type(scales).__name__)}", type_error=True)
            return None, None
        if scales.dim() != 2 or scales.shape[0] != x.shape[0] or scales.device != x.device:
            pr.add(f"x[1] (scales) has shape {tuple(scales.shape)} on {scales.device}; "
                   f"expected [{x.shape[0]}, num_scales] on {x.device}")
            return None, None
    return x, scales


def check_layout(pr: V.Problems, W: int, T: int, per_rank, in_rank, per_expert) -> None:
    for name, t, dtype, shape in (("num_tokens_per_rank", per_rank, torch.int32, (W,)),
                                  ("is_token_in_rank", in_rank, torch.bool, (T, W))):
        if not isinstance(t, torch.Tensor):
            pr.add(f"{name} is required without a handle (get_dispatch_layout gives it), got "
                   f"{type(t).__name__}", type_error=True)
        elif t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            pr.add(f"{name} has dtype {t.dtype} and shape {tuple(t.shape)}; expected a "
                   f"contiguous {dtype} tensor of shape {list(shape)}")
    if not isinstance(per_expert, torch.Tensor):
        pr.add(f"num_tokens_per_expert is required without a handle, got "
               f"{type(per_expert).__name__}", type_error=True)
    elif per_expert.dtype != torch.int32 or per_expert.dim() != 1 \
            or per_expert.numel() % W or not per_expert.numel():
        pr.add(f"num_tokens_per_expert has dtype {per_expert.dtype} and shape "
               f"{tuple(per_expert.shape)}; expected int32 [num_experts], a multiple of {W}")


def check_handle(pr: V.Problems, handle, W: int, T: int | None):
    """The handle as a 6-tuple of tensors that fits ``W`` ranks and ``T`` tokens, or None."""
    if not isinstance(handle, tuple) or len(handle) != 6 \
            or not all(isinstance(t, torch.Tensor) for t in handle):
        pr.add("handle must be the 6-tuple a normal dispatch returned (rank_prefix_matrix, "
               "..., send_head)", type_error=True)
        return None
    if tuple(handle[0].shape) != (W, W):
        pr.add(f"handle[0] (rank_prefix_matrix) has shape {tuple(handle[0].shape)}; expected "
               f"[{W}, {W}]: the handle is from another group")
        return None
    if T is not None and tuple(handle[4].shape) != (T, W):
        pr.add(f"handle[4] (is_token_in_rank) has shape {tuple(handle[4].shape)}; expected "
               f"[{T}, {W}]: x has {T} tokens")
        return None
    return handle


def check_bias(pr: V.Problems, bias, x, T: int | None) -> list:
    if bias is None:
        return []
    items = list(bias) if isinstance(bias, tuple) else [bias]
    if len(items) > 2:
        pr.add(f"bias must be a tensor or a pair of tensors, got {len(items)} items")
        return []
    for b in items:
        if x is not None and V.check_tensor(pr, "bias", b, x.device, dtypes=None) \
                and tuple(b.shape) != (T, x.shape[1]):
            pr.add(f"bias has shape {tuple(b.shape)}; expected [{T}, {x.shape[1]}]")
    return [b for b in items if b is not None]

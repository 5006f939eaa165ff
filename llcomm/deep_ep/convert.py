"""From ``EPBuffer``'s outputs to DeepEP's low-latency layouts, on the device.

Every function here runs as a few torch ops on the tensors' device, on the current stream, with
no host synchronisation, so a CUDA graph can capture them with the dispatch they follow.

``EPBuffer.dispatch`` gives, per local expert ``e``, rows packed from 0 in source rank order, then
source token order, with ``src_info[e, j] = source_rank * T + source_token`` (docs/ep.md). DeepEP's
handle describes the same rows with two tensors:

- ``src_info`` ``[L, W * T]`` int32: the source token of each row (its index in its own rank's
  ``x``), without the rank;
- ``layout_range`` ``[L, W]`` int64: ``(begin << 32) | count`` where rows ``begin .. begin +
  count - 1`` of expert ``e`` came from rank ``s``.

FP8 scales: ``EPBuffer`` returns a contiguous float32 ``[L, W * T, H / 128]``. DeepEP returns a
tensor of that shape whose storage is ``[L, H / 128, W * T]`` (the last two dimensions
column-major), or, with UE8M0, an int32 ``[L, W * T, H / 512]`` view of an ``[L, H / 512, W * T]``
storage in which each word packs the exponent bytes of four consecutive scales, scale ``4 i + b``
in byte ``b`` (bits ``8 b .. 8 b + 7``).
"""
from __future__ import annotations

import torch

from ..ep.fp8 import FP8_BLOCK

#: Scales per UE8M0 word.
UE8M0_PER_WORD = 4
#: Channels per UE8M0 word: ``hidden`` must be a multiple of this for ``use_ue8m0=True``.
UE8M0_CHANNELS = FP8_BLOCK * UE8M0_PER_WORD
_EXP_SHIFT = 23          # fp32: 23 mantissa bits below the 8 exponent bits
_EXP_MASK = 0xFF


def source_token(src_info: torch.Tensor, max_tokens: int, out: torch.Tensor) -> None:
    """``out[e, j]`` = the source token of row j (``EPBuffer``'s ``src_info`` modulo
    ``max_tokens``). Rows past ``recv_count[e]`` get unspecified values, as the input's."""
    torch.remainder(src_info, max_tokens, out=out)


def layout_range(src_info: torch.Tensor, recv_count: torch.Tensor, max_tokens: int,
                 num_ranks: int, out: torch.Tensor) -> None:
    """``out[e, s]`` = ``(begin << 32) | count`` of the rows of local expert e that came from
    rank s (``count`` 0 and ``begin`` the rows before it when s sent e nothing).

    Counted from the filled rows only (``j < recv_count[e]``; what lies past them is never
    read), so a masked rank, which sent nothing, gets count 0.
    """
    L, rows = src_info.shape
    filled = torch.arange(rows, device=src_info.device).unsqueeze(0) < recv_count.unsqueeze(1)
    # rows past recv_count hold anything: clamped to a valid index, and they add 0
    rank = torch.div(src_info, max_tokens, rounding_mode="floor").clamp_(0, num_ranks - 1)
    count = torch.zeros((L, num_ranks), dtype=torch.int64, device=src_info.device)
    count.scatter_add_(1, rank.to(torch.int64), filled.to(torch.int64))
    begin = count.cumsum(1) - count          # rows are packed source rank major from row 0
    out.copy_(torch.bitwise_or(begin << 32, count))


def scales_storage(num_local_experts: int, rows: int, hidden: int, ue8m0: bool,
                   device: torch.device) -> torch.Tensor:
    """A new ``[L, rows, groups]`` tensor laid out as DeepEP lays out its scales: a transposed
    view of a contiguous ``[L, groups, rows]`` storage; float32 with ``groups = hidden / 128``,
    or int32 with ``groups = hidden / 512`` for UE8M0."""
    if ue8m0:
        shape, dtype = (num_local_experts, hidden // UE8M0_CHANNELS, rows), torch.int32
    else:
        shape, dtype = (num_local_experts, hidden // FP8_BLOCK, rows), torch.float32
    return torch.empty(shape, dtype=dtype, device=device).transpose(1, 2)


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """fp32 power-of-two ``scales [..., G]`` (G a multiple of 4) -> int32 ``[..., G / 4]``:
    each scale's biased exponent byte (its bits 23..30: ``2 ** (byte - 127)`` is the scale),
    four to a word, scale ``4 i + b`` in byte ``b`` of word ``i`` (bits ``8 b .. 8 b + 7``)."""
    exp = (scales.contiguous().view(torch.int32) >> _EXP_SHIFT) & _EXP_MASK
    exp = exp.view(*scales.shape[:-1], scales.shape[-1] // UE8M0_PER_WORD, UE8M0_PER_WORD)
    shifts = torch.arange(UE8M0_PER_WORD, dtype=torch.int64, device=scales.device) * 8
    word = (exp.to(torch.int64) << shifts).sum(-1)          # the four bytes never overlap
    word = torch.where(word >= 1 << 31, word - (1 << 32), word)   # bit 31 set: a negative int32
    return word.to(torch.int32)


def fill_scales(out: torch.Tensor, scales: torch.Tensor, ue8m0: bool) -> None:
    """Copy ``EPBuffer``'s contiguous scales into ``out`` (from ``scales_storage``), packed to
    UE8M0 words when ``ue8m0``."""
    out.copy_(pack_ue8m0(scales) if ue8m0 else scales)

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

On the peer backend the dispatch's own receive stage writes all of it
(``EPBuffer.dispatch(deep_ep=...)``, ``llcomm/ep/kernels/deep_ep_layout.py``); the torch
functions below do the same as separate ops after the dispatch (the reference backend's path,
on the CPU among others, and the tests' oracle of the kernels).
"""
from __future__ import annotations

import torch

from ..runtime.fp8_format import FP8_BLOCK

#: Scales per UE8M0 word.
UE8M0_PER_WORD = 4
#: Channels per UE8M0 word: ``hidden`` must be a multiple of this for ``use_ue8m0=True``.
UE8M0_CHANNELS = FP8_BLOCK * UE8M0_PER_WORD
_EXP_SHIFT = 23          # fp32: 23 mantissa bits below the 8 exponent bits


def source_token(src_info: torch.Tensor, max_tokens: int, out: torch.Tensor) -> None:
    """``out[e, j]`` = the source token of row j (``EPBuffer``'s ``src_info`` modulo
    ``max_tokens``). Rows past ``recv_count[e]`` get unspecified values, as the input's."""
    torch.remainder(src_info, max_tokens, out=out)


def layout_aux(num_local_experts: int, rows: int, max_tokens: int, num_ranks: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Constants of ``layout_range`` for one buffer, made once: the row numbers ``[1, rows]``
    and every expert's rank boundaries ``s * max_tokens``, ``s = 0 .. num_ranks``."""
    row = torch.arange(rows, dtype=torch.int32, device=device).unsqueeze(0)
    bounds = (torch.arange(num_ranks + 1, dtype=torch.int32, device=device) * max_tokens)
    return row, bounds.unsqueeze(0).expand(num_local_experts, -1).contiguous()


def layout_range(src_info: torch.Tensor, recv_count: torch.Tensor, aux, out: torch.Tensor) -> None:
    """``out[e, s]`` = ``(begin << 32) | count`` of the rows of local expert e that came from
    rank s (``count`` 0, and ``begin`` the rows before it, when s sent e nothing).

    The filled rows (``j < recv_count[e]``) are sorted by ``src_info`` (source rank major, then
    source token), so the rows of rank s start where ``s * max_tokens`` would be inserted; the
    rows past them hold anything and are set past every boundary first. A masked rank, which
    sent nothing, gets count 0. ``aux`` is ``layout_aux(...)``. Six small kernels.
    """
    row, bounds = aux
    key = torch.where(row < recv_count.unsqueeze(1), src_info, torch.iinfo(torch.int32).max)
    pos = torch.searchsorted(key, bounds)                      # [L, W + 1] int64
    count = pos[:, 1:] - pos[:, :-1]
    torch.bitwise_or(pos[:, :-1] << 32, count, out=out)


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
    four to a word, scale ``4 i + b`` at byte ``b`` of word ``i`` in memory, which is bits
    ``8 b .. 8 b + 7`` of the int32 on a little-endian device (every CUDA GPU, x86, Arm)."""
    exp = (scales.contiguous().view(torch.int32) >> _EXP_SHIFT).to(torch.uint8)   # sign is 0
    return exp.view(torch.int32)


def fill_scales(out: torch.Tensor, scales: torch.Tensor, ue8m0: bool) -> None:
    """Copy ``EPBuffer``'s contiguous scales into ``out`` (from ``scales_storage``), packed to
    UE8M0 words when ``ue8m0``."""
    out.copy_(pack_ue8m0(scales) if ue8m0 else scales)

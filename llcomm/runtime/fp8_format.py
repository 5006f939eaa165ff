"""llcomm's FP8 formats, in plain torch: one definition, used by the reference backends and
offered to callers; the kernels (``llcomm/runtime/kernels/e4m3.py``) evaluate the same
arithmetic in Triton and the tests hold them to byte equality.

**Per-group** (the EP dispatch's ``use_fp8=True``, the TP ``*_fp8_per_group`` joins): for each
token row and each group of ``FP8_BLOCK`` = 128 consecutive channels, all in fp32 with IEEE
round-to-nearest-even on every operation::

    amax  = max |x[c]|                     over the group (x converted exactly to fp32)
    scale = amax / 448   (1.0 where amax == 0)                      fp32 division, rounded once
    scale = 2 ** ceil(log2(scale))         only with round_scale=True, computed on the bits:
                                           exponent + 1 when the mantissa is not zero (a scale
                                           below 2**-126 becomes 2**-126)
    q[c]  = e4m3(clamp(x[c] / scale, -448, 448))     fp32 division, then round to nearest even
                                                      to float8_e4m3fn (torch's format)

so ``x[c] ~ float(q[c]) * scale`` with a relative error of at most 2**-4 for values near the
group's maximum, and an absolute error of at most ``scale * 2**-10`` for values below
``scale * 2**-6`` (e4m3 subnormals). ``hidden`` must be a multiple of 128.

**Static** (the TP ``all_reduce_residual_rmsnorm_fp8`` join): one float32 ``scale`` for the
whole tensor, given by the caller (calibrated)::

    inv  = 1 / scale                                  fp32 division, rounded once
    q[c] = e4m3(clamp(x[c] * inv, -448, 448))         fp32 product, then round to nearest even

A multiplication by the reciprocal, as vLLM's static FP8 quantisation does, so a scale
calibrated for that gives the same codes here. ``x ~ float(q) * scale``.

Inputs must be finite (a NaN or inf makes its group, or its element, undefined).
"""
from __future__ import annotations

import torch

#: Channels per scale (per-group format).
FP8_BLOCK = 128
#: Largest finite float8_e4m3fn value; a group's amax maps onto it, larger products saturate.
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
_MANTISSA_MASK = 0x7FFFFF
_MANTISSA_BITS = 23


def round_scale_up(scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``scale`` rounded up to a power of two (bit arithmetic; see the module doc)."""
    bits = scale.contiguous().view(torch.int32)
    exp = (bits >> _MANTISSA_BITS) + ((bits & _MANTISSA_MASK) != 0).to(torch.int32)
    return (exp << _MANTISSA_BITS).view(torch.float32)


def quantize(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group: ``x [..., H]`` (bf16, fp16 or fp32, H a multiple of 128) -> ``(q [..., H]
    float8_e4m3fn, scales [..., H // 128] float32)``. Allocates its outputs."""
    H = x.shape[-1]
    if H % FP8_BLOCK:
        raise ValueError(f"llcomm fp8 quantize: hidden={H} is not a multiple of {FP8_BLOCK}")
    xf = x.float().reshape(*x.shape[:-1], H // FP8_BLOCK, FP8_BLOCK)
    amax = xf.abs().amax(-1)
    # a tensor divisor: CUDA torch turns division by a Python scalar into a multiplication by
    # its (inexact) reciprocal, which is not the IEEE division the kernel does
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, FP8_MAX))
    if round_scale:
        scale = round_scale_up(scale)
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(x.shape), scale


def dequantize(q: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Per-group: ``float(q) * scale`` per 128-channel group, in fp32, rounded once to
    ``dtype``."""
    H = q.shape[-1]
    y = q.float().reshape(*q.shape[:-1], H // FP8_BLOCK, FP8_BLOCK) * scales.unsqueeze(-1)
    return y.reshape(q.shape).to(dtype)


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static: ``x`` (any shape, bf16 / fp16 / fp32) and a one-element float32 ``scale`` ->
    float8_e4m3fn codes of ``x * (1 / scale)`` (see the module doc). Allocates its output."""
    s = scale.reshape(()).float()
    inv = torch.ones_like(s) / s        # a tensor division: IEEE on every device
    return (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)

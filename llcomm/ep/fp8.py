"""FP8 dispatch format of ``EPBuffer.dispatch(..., use_fp8=True)``, in plain torch.

One definition, used by the reference backend and offered to callers (``dequantize`` for
experts that want bf16 back). The peer kernel (``kernels/fp8.py``) evaluates the same arithmetic
in Triton on the sender, so fp8 bytes cross NVLink; the tests hold the two to byte equality.

For each token row and each block of ``FP8_BLOCK`` = 128 consecutive channels, all in fp32 with
IEEE round-to-nearest-even on every operation::

    amax  = max |x[c]|                     over the block (x converted exactly to fp32)
    scale = amax / 448   (1.0 where amax == 0)                      fp32 division, rounded once
    scale = 2 ** ceil(log2(scale))         only with round_scale=True, computed on the bits:
                                           exponent + 1 when the mantissa is not zero (a scale
                                           below 2**-126 becomes 2**-126)
    q[c]  = e4m3(clamp(x[c] / scale, -448, 448))     fp32 division, then round to nearest even
                                                      to float8_e4m3fn (torch's format)

so ``x[c] ~ float(q[c]) * scale`` with a relative error of at most 2**-4 for values near the
block's maximum, and an absolute error of at most ``scale * 2**-10`` for values below
``scale * 2**-6`` (e4m3 subnormals). Inputs must be finite (a NaN or inf makes the block
undefined). ``hidden`` must be a multiple of 128.
"""
from __future__ import annotations

import torch

#: Channels per scale.
FP8_BLOCK = 128
#: Largest finite float8_e4m3fn value; amax maps onto it.
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
    """``x [..., H]`` (bf16, fp16 or fp32, H a multiple of 128) -> ``(q [..., H]
    float8_e4m3fn, scales [..., H // 128] float32)``. Allocates its outputs."""
    H = x.shape[-1]
    if H % FP8_BLOCK:
        raise ValueError(f"llcomm.ep.fp8.quantize: hidden={H} is not a multiple of {FP8_BLOCK}")
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
    """``float(q) * scale`` per 128-channel block, in fp32, rounded once to ``dtype``."""
    H = q.shape[-1]
    y = q.float().reshape(*q.shape[:-1], H // FP8_BLOCK, FP8_BLOCK) * scales.unsqueeze(-1)
    return y.reshape(q.shape).to(dtype)

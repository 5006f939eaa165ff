"""FP8 dispatch format of ``EPBuffer.dispatch(..., use_fp8=True)``: llcomm's per-group FP8
format, defined (in plain torch) in ``llcomm/runtime/fp8.py`` and re-exported here.

The reference backend quantises with ``quantize``; callers use ``dequantize`` for experts that
want bf16 back. The peer kernel (``kernels/fp8.py``) evaluates the same arithmetic in Triton on
the sender, so fp8 bytes cross NVLink; the tests hold the two to byte equality.

For each token row and each block of ``FP8_BLOCK`` = 128 consecutive channels: ``scale = amax /
448`` (1.0 where amax == 0; rounded up to a power of two with ``round_scale=True``) and ``q =
e4m3(clamp(x / scale, -448, 448))``, every operation in fp32 rounded to nearest even (the
runtime module has every step and the error bounds). ``hidden`` must be a multiple of 128.
"""
from ..runtime.fp8 import (FP8_BLOCK, FP8_DTYPE, FP8_MAX, SCALE_DTYPE,  # noqa: F401
                           dequantize, quantize, round_scale_up)

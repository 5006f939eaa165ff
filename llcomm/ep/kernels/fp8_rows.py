"""The FP8 dispatch's token-row quantisers on the device: the arithmetic of
``llcomm/runtime/fp8_format.py`` (scales = amax / 448 per 128-channel block, or rounded up to a
power of two; x / scale clamped to +-448 and rounded to nearest even), byte-equal to torch's
``.to(torch.float8_e4m3fn)``. The e4m3 rounding, the scales and the division are
``llcomm/runtime/kernels/e4m3.py``'s.

Each token row is quantised once, on the sender, and crosses NVLink as ``H`` bytes of e4m3 plus
``H // 128`` fp32 scales. ``_quantize_row`` is the flag dispatch's quantiser, ``_pack_row_fp8``
the LL dispatch's (four e4m3 bytes to an int32 word, as the LL dispatch sends rows).
"""
import triton
import triton.language as tl
from triton import knobs

from .. import layout as EL
from .common import _row_words
# the e4m3 arithmetic is shared with the TP fused norm's FP8 outputs: one definition
from ...runtime.kernels.e4m3 import RCP_MIN_SCALE  # noqa: F401  (tests/test_ep_fp8_quant.py)
from ...runtime.kernels.e4m3 import div_by as _div_by
from ...runtime.kernels.e4m3 import e4m3_bits as _e4m3_bits  # noqa: F401  (tests)
from ...runtime.kernels.e4m3 import e4m3_clamped as _e4m3_clamped
from ...runtime.kernels.e4m3 import fp8_scales as _fp8_scales

FP8_BLOCK = tl.constexpr(EL.FP8_BLOCK)


@triton.constexpr_function
def _ptx_convert():
    """Whether ``_pack_row_fp8`` packs by the GPU's convert (E4M3X4_PTX): compiled for NVIDIA.
    Triton's interpreter (``TRITON_INTERPRET=1``) cannot run inline PTX, and AMD's gfx942
    converts to its own e4m3 (e4m3fnuz, another bias) where the wire format is OCP's e4m3fn:
    there it rounds on the bits instead (the same bytes)."""
    return not knobs.runtime.interpret and not tl.target_info.is_hip()


#: fp32 -> e4m3 by the GPU's convert, round to nearest even, four values to one register (byte
#: i from operand i: ``cvt`` puts its first operand in the high byte of a pair).
E4M3X4_PTX = tl.constexpr("""{
    .reg .b16 lo, hi;
    cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
    cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
    mov.b32 $0, {lo, hi};
}""")


@triton.jit
def _quantize_row(v, HP: tl.constexpr, ROUND: tl.constexpr):
    """fp32 row ``[HP]`` (zeros past H) -> (e4m3 bits as uint8 ``[HP]``, fp32 scales
    ``[HP // 128]``): ``_fp8_scales``, then x / scale (div_rn) clamped to +-448 and rounded on
    the bits (``_e4m3_bits``). The flag dispatch's quantiser."""
    v2 = tl.reshape(v, (HP // FP8_BLOCK, FP8_BLOCK))
    sc = _fp8_scales(v2, ROUND)
    return tl.reshape(_e4m3_clamped(tl.math.div_rn(v2, sc[:, None])), (HP,)).to(tl.uint8), sc


@triton.jit
def _pack_row_fp8(v, HP: tl.constexpr, HPW: tl.constexpr, ROUND: tl.constexpr):
    """LL dispatch, FP8: fp32 row ``v`` ``[HP]`` -> (its e4m3 bytes packed four to an int32 word
    ``[HPW]``, its scales' bits ``[HP // 128]``), both as ``_row_words`` sends them; the
    arithmetic of ``_quantize_row``, with the divisions by ``_div_by`` (the same quotients). The
    GPU's ``cvt.rn.satfinite`` (E4M3X4_PTX) turns four quotients into one word, no clamp (every
    quotient is within an ulp of +-448 at most, and satfinite saturates there as the clamp
    would). Timed alone: bench/results/ab/2026-11-30-ep-fp8-quantiser/."""
    v2 = tl.reshape(v, (HP // FP8_BLOCK, FP8_BLOCK))
    sc = _fp8_scales(v2, ROUND)
    q = _div_by(v2, sc)
    # the four quotients of each word, in byte order, in registers: element 4w + 2j + i is
    # [w, j, i], and a split takes the last axis (i) apart
    even, odd = tl.split(tl.reshape(q, (HPW, 2, 2)))        # [w, j] of i = 0 and i = 1
    e0, e2 = tl.split(even)
    e1, e3 = tl.split(odd)
    words = _e4m3x4(e0, e1, e2, e3, _ptx_convert())
    return _row_words(words), _row_words(sc.to(tl.int32, bitcast=True))


@triton.jit
def _e4m3x4(e0, e1, e2, e3, CONVERT: tl.constexpr):
    """Four fp32 quotients (``|e| <= 448`` to within an ulp) -> one int32 word of their e4m3
    bytes, byte i from ``ei``: by the GPU's convert (CONVERT, NVIDIA) or on the bits, clamped
    (the same bytes: tests/test_amd_compile.py)."""
    if CONVERT:
        return tl.inline_asm_elementwise(E4M3X4_PTX, "=r,f,f,f,f", [e0, e1, e2, e3],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return (_e4m3_clamped(e0) | (_e4m3_clamped(e1) << 8) | (_e4m3_clamped(e2) << 16)
                | (_e4m3_clamped(e3) << 24))

"""The FP8 dispatch's quantiser on the device: the arithmetic of ``llcomm/ep/fp8.py`` (scales =
amax / 448 per 128-channel block, or rounded up to a power of two; x / scale clamped to +-448 and
rounded to nearest even), byte-equal to torch's ``.to(torch.float8_e4m3fn)``.

Each token row is quantised once, on the sender, and crosses NVLink as ``H`` bytes of e4m3 plus
``H // 128`` fp32 scales. ``_quantize_row`` is the flag dispatch's quantiser, ``_pack_row_fp8``
the LL dispatch's (four e4m3 bytes to an int32 word, as the LL dispatch sends rows).
"""
import triton
import triton.language as tl
from triton import knobs

from .. import layout as EL
from .common import _row_words

FP8_BLOCK = tl.constexpr(EL.FP8_BLOCK)
FP8_MAX = tl.constexpr(448.0)           # largest finite float8_e4m3fn (llcomm/ep/fp8.py)
# fp32 bit fields, and e4m3's exponent bias relative to fp32's (127 - 7)
F32_MANT_BITS = tl.constexpr(23)
F32_MANT_MASK = tl.constexpr(0x7FFFFF)
F32_IMPLICIT = tl.constexpr(1 << 23)
E4M3_REBIAS = tl.constexpr(120)
E4M3_REBIAS_BITS = tl.constexpr(120 << 3)   # the rebias, at e4m3's exponent position
E4M3_DROP = tl.constexpr(20)                # fp32 mantissa bits e4m3 drops (23 - 3)
E4M3_HALF = tl.constexpr((1 << 19) - 1)     # round-half-even bias below the kept bits
E4M3_SUB_SHIFT = tl.constexpr(141)          # 150 - 9: fp32 bias + mantissa bits - 2**-9


@triton.jit
def _e4m3_bits(q):
    """float8_e4m3fn bits (int32, low byte) of fp32 ``q`` with ``|q| <= 448``, rounded to nearest
    even: normal results by adding the rounding bias to the fp32 bits (a carry bumps the
    exponent), subnormal ones (``|q| < 2**-6``) by shifting the significand to units of 2**-9.
    Byte-equal to torch's cast on the GPU and under ``TRITON_INTERPRET=1`` (whose own fp8 cast
    does not round to nearest even; Triton's fp8 cast on the GPU differed from torch's too)."""
    u = q.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    e = a >> F32_MANT_BITS
    normal = ((a + E4M3_HALF + ((a >> E4M3_DROP) & 1)) >> E4M3_DROP) - E4M3_REBIAS_BITS
    sig = (a & F32_MANT_MASK) | tl.where(e > 0, F32_IMPLICIT, 0)
    # in units of 2**-9 the value is sig * 2**(e - 141); shifts past 25 give 0 anyway
    sh = tl.minimum(E4M3_SUB_SHIFT - e, 25)
    one = tl.full(sh.shape, 1, tl.int32)
    sub = (sig + (one << (sh - 1)) - 1 + ((sig >> sh) & 1)) >> sh
    return tl.where(e > E4M3_REBIAS, normal, sub) | sign


#: fp32 -> e4m3 by the GPU's convert, round to nearest even, four values to one register (byte
#: i from operand i: ``cvt`` puts its first operand in the high byte of a pair). Triton's
#: interpreter (``TRITON_INTERPRET=1``, read when Triton and this module are imported) cannot
#: run inline PTX: there ``_pack_row_fp8`` rounds on the bits instead (the same bytes).
PTX_CONVERT = tl.constexpr(not knobs.runtime.interpret)
E4M3X4_PTX = tl.constexpr("""{
    .reg .b16 lo, hi;
    cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
    cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
    mov.b32 $0, {lo, hi};
}""")


#: ``_div_by``'s remainder argument needs every scale to be at least this: then an element whose
#: quotient reaches e4m3's rounding range (2**-11 and up) is at least 2**-100, so the remainder
#: ``x - s * q`` is a normal fp32 number and exact; smaller quotients round to 0 in e4m3
#: whatever their last fp32 bits.
RCP_MIN_SCALE = tl.constexpr(2.0 ** -89)
#: A block whose scale is below RCP_MIN_SCALE is divided as ``(x * RCP_LIFT) / (s * RCP_LIFT)``:
#: both products are exact (a power of two; no overflow, since ``|x| <= 448 s``), the quotient
#: is the same, and the lifted scale is above 2**-78: the smallest scale the quantiser makes is
#: the smallest bf16 amax over 448, about 2**-141.8.
RCP_LIFT = tl.constexpr(2.0 ** 64)


@triton.jit
def _div_by(v2, sc):
    """``v2 / sc[:, None]`` rounded once, as IEEE division (div_rn) rounds it, without a
    division per element: ``r = 1 / s`` once per scale (div_rn), ``q = x * r``, then one
    correction by the exact remainder ``fma(-s, q, x)``: ``fma(rem, r, q)`` (the refinement of
    the GPU's own div.rn fast path, with a correctly rounded reciprocal). Blocks with a scale
    below RCP_MIN_SCALE are lifted by RCP_LIFT first, block by block: no branch and no
    reduction across the block's warps."""
    lift = tl.where(sc < RCP_MIN_SCALE, RCP_LIFT, 1.0)
    s = sc * lift
    v = v2 * lift[:, None]
    r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)[:, None]
    q = v * r
    rem = tl.fma(-s[:, None] + tl.zeros_like(q), q, v)
    # an exact q stays as it is: fma(+0, r, -0) would turn a -0 quotient into +0
    return tl.where(rem == 0, q, tl.fma(rem, r, q))


@triton.jit
def _fp8_scales(v2, ROUND: tl.constexpr):
    """Scales of the 128-channel blocks ``v2`` ``[HP // 128, 128]``: amax / 448 (1 where amax
    is 0), ROUND: rounded up to a power of two (on the bits, as llcomm/ep/fp8.py)."""
    amax = tl.max(tl.abs(v2), axis=1)
    sc = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, FP8_MAX))
    if ROUND:
        bits = sc.to(tl.int32, bitcast=True)
        ex = (bits >> F32_MANT_BITS) + ((bits & F32_MANT_MASK) != 0).to(tl.int32)
        sc = (ex << F32_MANT_BITS).to(tl.float32, bitcast=True)
    return sc


@triton.jit
def _e4m3_clamped(q):
    """``_e4m3_bits`` of ``q`` clamped to +-448 (the low byte; the rest zero)."""
    return _e4m3_bits(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)) & 0xFF


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
    if PTX_CONVERT:
        words = tl.inline_asm_elementwise(E4M3X4_PTX, "=r,f,f,f,f", [e0, e1, e2, e3],
                                          dtype=tl.int32, is_pure=True, pack=1)
    else:
        words = (_e4m3_clamped(e0) | (_e4m3_clamped(e1) << 8) | (_e4m3_clamped(e2) << 16)
                 | (_e4m3_clamped(e3) << 24))
    return _row_words(words), _row_words(sc.to(tl.int32, bitcast=True))

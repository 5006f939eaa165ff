"""float8_e4m3fn on the device: the arithmetic of ``llcomm/runtime/fp8_format.py`` in Triton,
byte-equal to torch's ``.to(torch.float8_e4m3fn)``.

Used by the EP dispatch's quantiser (``llcomm/ep/kernels/fp8_rows.py``: one scale per 128-channel
group, scale = amax / 448) and by the TP fused norm's FP8 outputs
(``llcomm/tp/kernels/fused_norm.py``: the same groups, or one static scale per tensor).
"""
import triton
import triton.language as tl

from .. import fp8_format as F8

FP8_MAX = tl.constexpr(F8.FP8_MAX)      # largest finite float8_e4m3fn
FP8_BLOCK = tl.constexpr(F8.FP8_BLOCK)  # channels per scale of the per-group format
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
def e4m3_bits(q):
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
    # tensor first: the interpreter of Triton 3.7 and 3.8 makes ``constexpr - tensor`` a
    # constexpr holding a tensor, which tl.minimum refuses (the compiled code is the same)
    sh = tl.minimum(-e + E4M3_SUB_SHIFT, 25)
    one = tl.full(sh.shape, 1, tl.int32)
    sub = (sig + (one << (sh - 1)) - 1 + ((sig >> sh) & 1)) >> sh
    return tl.where(e > E4M3_REBIAS, normal, sub) | sign


@triton.jit
def e4m3_clamped(q):
    """``e4m3_bits`` of ``q`` clamped to +-448 (the low byte; the rest zero)."""
    return e4m3_bits(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)) & 0xFF


#: ``div_by``'s remainder argument needs every scale to be at least this: then an element whose
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
def div_by(v2, sc):
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
def fp8_scales(v2, ROUND: tl.constexpr):
    """Scales of the 128-channel blocks ``v2`` ``[HP // 128, 128]``: amax / 448 (1 where amax
    is 0), ROUND: rounded up to a power of two (on the bits, as llcomm/runtime/fp8_format.py)."""
    amax = tl.max(tl.abs(v2), axis=1)
    sc = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, FP8_MAX))
    if ROUND:
        bits = sc.to(tl.int32, bitcast=True)
        ex = (bits >> F32_MANT_BITS) + ((bits & F32_MANT_MASK) != 0).to(tl.int32)
        sc = (ex << F32_MANT_BITS).to(tl.float32, bitcast=True)
    return sc


#: e4m3's subnormal unit (2**-9): a code with exponent field 0 is its mantissa times this.
E4M3_SUB_UNIT = tl.constexpr(2.0 ** -9)


@triton.jit
def e4m3_value(bits):
    """fp32 value of float8_e4m3fn bits (an integer tensor, low byte): exact, as every e4m3
    value is an fp32 one; normal codes by moving their fields into fp32's, subnormal ones as
    mantissa times 2**-9. The inverse of ``e4m3_bits`` on the codes it makes (never 0x7F or
    0xFF, e4m3fn's NaNs, which this does not special-case). Decoded on the bits, so the wire
    format is OCP's e4m3fn on every GPU (AMD's gfx942 converts to e4m3fnuz)."""
    b = bits.to(tl.int32) & 0xFF
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + E4M3_REBIAS) << F32_MANT_BITS) | (m << E4M3_DROP)).to(tl.float32,
                                                                           bitcast=True)
    mag = tl.where(e > 0, normal, m.to(tl.float32) * E4M3_SUB_UNIT)
    return tl.where((b & 0x80) != 0, -mag, mag)

"""DeepEP's layouts of the dispatch's outputs, written by the receive stage itself (``DEEP_EP``).

``EPBuffer.dispatch(deep_ep=...)`` (what ``llcomm.deep_ep`` calls) wants, besides the rows, the
tensors DeepEP describes them with (``llcomm/deep_ep/convert.py`` defines them, and its torch
ops are the reference). Both dispatch kernels' receive stages (``dispatch_flag._expand``,
``dispatch_ll._expand_ll``) place the row of pair (s, t) for local expert e at ``flat = e * W * T
+ row`` and know, there, everything DeepEP's layouts need; so with ``DEEP_EP`` they write them
where they learn them, and each output has one writer:

- DeepEP's ``src_info`` (the source token t) of each row, beside ``EPBuffer``'s ``s * T + t``,
  and the row's FP8 scales in DeepEP's column-major storage (``_scales_to_column``) in place of
  ``EPBuffer``'s contiguous ones: by the block that owns the pair, which writes its rows;
- ``layout_range[e, s] = (begin << 32) | count`` (``count[s][e]``, ``begin`` the counts of the
  sources before s) and ``stats[e] += recv_count[e]``: by the last block, which sums the
  per-source counts into ``recv_count`` (``_layout_entry``, ``_deep_ep_totals``). After a failed
  wait it writes -1 over the experts' ``layout_range`` (no begin nor count is negative) and
  leaves the stats alone.

``DEEP_EP`` is 0 for ``EPBuffer``'s own dispatches, whose code then compiles as without it.
"""
from collections import namedtuple

import triton
import triton.language as tl

#: DEEP_EP: off (EPBuffer's layouts), DeepEP's with float32 scales, DeepEP's with UE8M0 scale
#: words (four exponent bytes per int32).
DEEP_EP_OFF, DEEP_EP_FP32, DEEP_EP_UE8M0 = 0, 1, 2
#: DEEP_EP_UE8M0 where the kernels compare DEEP_EP with it.
UE8M0_LAYOUT = tl.constexpr(DEEP_EP_UE8M0)
#: DeepEP's outputs (runtime pointers; None when DEEP_EP is 0): ``src_info [L, W * T]`` int32,
#: ``layout_range [L, W]`` int64, ``stats [L]`` int32 (None: not asked for). The scales go
#: through the dispatch's ``recv_scales``.
DeepOut = namedtuple("DeepOut", ["src", "layout", "stats"])
#: Scales per UE8M0 word.
UE8M0_PER_WORD = tl.constexpr(4)
_EXP_SHIFT = tl.constexpr(23)        # fp32: the exponent byte sits above 23 mantissa bits
_BYTE = tl.constexpr(0xFF)
_BEGIN_SHIFT = tl.constexpr(32)      # layout_range: begin above the count's 32 bits


@triton.jit
def _ue8m0_words(bits, SCALES_P2: tl.constexpr):
    """``[SCALES_P2]`` fp32 scales' bits (positive powers of two) -> ``[SCALES_P2 / 4]`` int32
    words: word w holds the exponent bytes of scales ``4 w .. 4 w + 3``, scale ``4 w + b`` in
    bits ``8 b .. 8 b + 7`` (disjoint bytes, so their sum is their bitwise or)."""
    byte = tl.reshape((bits >> _EXP_SHIFT) & _BYTE, [SCALES_P2 // UE8M0_PER_WORD, UE8M0_PER_WORD])
    return tl.sum(byte << (tl.arange(0, UE8M0_PER_WORD) * 8)[None, :], axis=1)


@triton.jit
def _store_column(dst, row1, val, lanes, lm, G: tl.constexpr, R: tl.constexpr):
    """``val`` (``lanes``, mask ``lm``) into column ``row1 - 1`` (a flat row ``e * R + j``; 0:
    none) of the ``[L, G, R]`` int32 storage ``dst``."""
    r1 = row1.to(tl.int64) + tl.zeros_like(lanes).to(tl.int64)     # a lane tensor: the
    flat = tl.maximum(r1 - 1, 0)                                    # interpreter's masks
    e = flat // R
    tl.store(dst + e * (G * R) + lanes * R + (flat - e * R), val, mask=lm & (r1 > 0))


@triton.jit
def _scales_to_column(dst, row1, bits, R: tl.constexpr, SCALES: tl.constexpr,
                      SCALES_P2: tl.constexpr, UE8M0: tl.constexpr):
    """One row's SCALES FP8 scales (``bits``: ``[SCALES_P2]`` int32, their fp32 bits) into
    column ``row1 - 1`` (flat row + 1; 0: no row) of DeepEP's storage ``dst``: ``[L, SCALES,
    R]`` fp32, or with UE8M0 ``[L, SCALES / 4, R]`` int32 words (``_ue8m0_words``)."""
    dst = dst.to(tl.pointer_type(tl.int32))
    if UE8M0:
        ws = tl.arange(0, SCALES_P2 // UE8M0_PER_WORD)
        _store_column(dst, row1, _ue8m0_words(bits, SCALES_P2), ws,
                      ws < SCALES // UE8M0_PER_WORD, SCALES // UE8M0_PER_WORD, R)
    else:
        ns = tl.arange(0, SCALES_P2)
        _store_column(dst, row1, bits, ns, ns < SCALES, SCALES, R)


@triton.jit
def _layout_entry(layout, ls, lm, s, begin, count, W: tl.constexpr):
    """``layout_range[ls, s] = (begin << 32) | count`` (int32 ``begin``, ``count`` per expert)."""
    tl.store(layout + ls * W + s, (begin.to(tl.int64) << _BEGIN_SHIFT) | count.to(tl.int64),
             mask=lm)


@triton.jit
def _deep_ep_totals(layout, stats, ls, lm, tot, failed, W: tl.constexpr, WP: tl.constexpr):
    """After experts ``ls``' counts (``tot``: their recv_count): ``stats[ls] += tot`` (stats
    None: nothing), or after a failed wait (``failed`` != 0) -1 over their ``layout_range``."""
    if failed != 0:
        ps = tl.arange(0, WP)
        idx = ls[:, None] * W + ps[None, :]
        tl.store(layout + idx, tl.full(idx.shape, -1, tl.int64),
                 mask=lm[:, None] & (ps < W)[None, :])
    elif stats is not None:
        tl.store(stats + ls, tl.load(stats + ls, mask=lm, other=0) + tot, mask=lm)


@triton.jit
def _poison_layout(layout, SIZES, COUNT_CHUNK: tl.constexpr):
    """A failed dispatch's ``layout_range``: -1 for every (local expert, source rank), written by
    the block that writes the counts (the last), as ``recv_count`` gets -1."""
    if tl.program_id(0) == SIZES.NB - 1:
        for l0 in range(0, SIZES.L, COUNT_CHUNK):
            ls = l0 + tl.arange(0, COUNT_CHUNK)
            _deep_ep_totals(layout, None, ls, ls < SIZES.L, ls, 1, SIZES.W, SIZES.WP)

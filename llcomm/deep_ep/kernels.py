"""From ``EPBuffer``'s dispatch outputs to DeepEP's layouts in one launch (``to_deep_ep_kernel``).

``llcomm/deep_ep/convert.py`` describes both layouts and keeps the same conversions as torch ops
(the CPU path and the tests' oracle); this kernel does what they do, launched once after the
dispatch instead of about nine small torch kernels.

One program per local expert ``e`` reads its ``recv_count[e]`` filled rows, sorted by
``EPBuffer``'s ``src_info`` (``source_rank * T + source_token``), in blocks of ``BLOCK`` rows:

- DeepEP's ``src_info``: the source token, ``value % T``;
- the per-rank row ranges: ``begin[s]`` counts the filled rows whose value is below ``s * T``
  (the rows of the ranks before s: the rows are sorted), ``end[s]`` those below ``(s + 1) * T``;
  ``layout_range[e, s] = (begin << 32) | (end - begin)``. A rank that sent nothing (or is
  masked) gets count 0 and begin = the rows before it;
- the FP8 scales, when there are any: row j's ``G`` scales become column j of the expert's
  ``[G, R]`` storage, as fp32 bits or (UE8M0) as the exponent bytes of four consecutive scales
  packed into one int32 word;
- the cumulative stats, when asked for: ``stats[e] += recv_count[e]`` (one program per expert,
  so a plain read and write).

Only the filled rows are read and written: rows past ``recv_count[e]`` of DeepEP's ``src_info``
and scales keep what their tensors held, and the loops run ``ceil(recv_count[e] / BLOCK)``
times, so the cost follows the rows received, not the buffer's ``W * T`` rows per expert.
"""
import triton
import triton.language as tl

#: Scales to convert: none (bf16 dispatch), fp32 column-major, UE8M0 words column-major.
SCALES_NONE, SCALES_FP32, SCALES_UE8M0 = 0, 1, 2
#: Warps per program.
NUM_WARPS = 4
#: Elements of the widest per-block 2-D tile (rows x ranks, rows x scale groups).
_TILE = 8192
_EXP_SHIFT = tl.constexpr(23)        # fp32: the exponent byte sits above 23 mantissa bits


def pow2(n: int) -> int:
    """The smallest power of two at least ``n`` (1 for 0): a tile's width."""
    return triton.next_power_of_2(max(n, 1))


def block_rows(num_ranks: int, scale_groups: int) -> int:
    """Rows per block: a power of two from 16 to 256, so that a block's rows-by-ranks and
    rows-by-scale-groups tiles stay within ``_TILE`` elements."""
    cols = max(pow2(num_ranks), pow2(scale_groups))
    return max(16, min(256, _TILE // cols))


@triton.jit
def _scales_block(src, dst, e, j, ok, R: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                  UE8M0: tl.constexpr):
    """Rows ``j`` (``ok``: filled) of expert e's contiguous scales ``src [L, R, G]`` (int32 bits)
    into column j of ``dst``'s ``[L, G, R]`` storage, or with UE8M0 of its ``[L, G / 4, R]``
    storage: word w holds the exponent bytes of scales ``4 w .. 4 w + 3``, scale ``4 w + b`` in
    bits ``8 b .. 8 b + 7`` (the scales are positive powers of two: sign bit 0)."""
    if UE8M0:
        GW: tl.constexpr = G // 4
        w = tl.arange(0, GP // 4)
        b = tl.arange(0, 4)
        offs = j[:, None, None] * G + w[None, :, None] * 4 + b[None, None, :]
        m = ok[:, None, None] & (w < GW)[None, :, None]
        bits = tl.load(src + e * (R * G) + offs, mask=m, other=0)
        byte = (bits >> _EXP_SHIFT) & 0xFF
        word = tl.sum(byte << (b * 8)[None, None, :], axis=2)   # disjoint bytes: sum = or
        tl.store(dst + e * (R * GW) + w[None, :] * R + j[:, None], word,
                 mask=ok[:, None] & (w < GW)[None, :])
    else:
        g = tl.arange(0, GP)
        m = ok[:, None] & (g < G)[None, :]
        bits = tl.load(src + e * (R * G) + j[:, None] * G + g[None, :], mask=m)
        tl.store(dst + e * (R * G) + g[None, :] * R + j[:, None], bits, mask=m)


@triton.jit
def to_deep_ep_kernel(ep_src, recv_count, src_out, layout_out, stats, ep_scales, scales_out,
                      T: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, G: tl.constexpr,
                      GP: tl.constexpr, SCALES: tl.constexpr, STATS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Grid ``(L,)``. ``ep_src [L, W * T]`` int32 and ``recv_count [L]`` int32: the dispatch's;
    ``src_out [L, W * T]`` int32 and ``layout_out [L, W]`` int64: DeepEP's handle tensors.
    ``SCALES``: ``SCALES_NONE`` (``ep_scales``, ``scales_out`` unused), ``SCALES_FP32`` or
    ``SCALES_UE8M0``, with ``ep_scales`` the dispatch's ``[L, W * T, G]`` scales as int32 bits
    and ``scales_out`` the storage of DeepEP's (``_scales_block``). ``STATS``: add
    ``recv_count`` into the int32 ``stats [L]`` (unused without it). ``WP``, ``GP``: powers of
    two at least ``W``, ``G``; ``BLOCK``: rows per step (``block_rows``)."""
    R: tl.constexpr = W * T
    e = tl.program_id(0)
    n = tl.load(recv_count + e)
    s = tl.arange(0, WP)
    lo = s * T                                   # rank s's first value; past W: above them all
    begin = tl.zeros([WP], dtype=tl.int32)
    end = tl.zeros([WP], dtype=tl.int32)
    rows = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        j = start + rows
        ok = j < n
        v = tl.load(ep_src + e * R + j, mask=ok, other=R)     # R: counted below no boundary
        tl.store(src_out + e * R + j, v % T, mask=ok)
        begin += tl.sum((v[:, None] < lo[None, :]).to(tl.int32), axis=0)
        end += tl.sum((v[:, None] < (lo + T)[None, :]).to(tl.int32), axis=0)
        if SCALES != 0:
            _scales_block(ep_scales, scales_out, e, j, ok, R, G, GP, SCALES == 2)
    packed = (begin.to(tl.int64) << 32) | (end - begin).to(tl.int64)
    tl.store(layout_out + e * W + s, packed, mask=s < W)
    if STATS:
        tl.store(stats + e, tl.load(stats + e) + n)

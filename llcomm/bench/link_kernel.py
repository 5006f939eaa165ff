"""The kernel of ``llcomm bench link``'s SM ways (imported where it runs: it needs Triton)."""
import triton
import triton.language as tl


@triton.jit
def move(src, dst, n, BLOCK: tl.constexpr):
    """int32 words ``[0, n)`` from ``src`` to ``dst``, grid-strided, BLOCK words per step."""
    b = tl.program_id(0)
    nb = tl.num_programs(0)
    src = tl.multiple_of(src, 16)
    dst = tl.multiple_of(dst, 16)
    lanes = tl.arange(0, BLOCK)
    for start in range(b * BLOCK, n, nb * BLOCK):
        offs = start + lanes
        m = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

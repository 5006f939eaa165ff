"""The device-side wait of ``overlap.py``: one program per local expert spins on that expert's
compute signals until each has reached its threshold, bounded by the buffer's timeout.

Program ``e`` waits, in order, on ``signal[e * per_expert + b]`` for ``b < blocks``, where
``blocks = ceil(counts[e] / block_m)`` (``HAS_COUNTS``) or 1; a signal is ready once its value
(unsigned 32-bit where ``UNSIGNED``) is at least ``threshold``. Each poll is a volatile load
(``poll_read``), as the signals are stored by a kernel that runs on another stream meanwhile.
The waits of a program share one bound: past ``timeout_us`` since the program started, it stores
``1 + e * per_expert + b`` of the first signal that was not ready into ``status[0]`` (a
compare-and-swap from 0, so the first report stays) and stops waiting. Launched on the current
stream, so the combine kernels queued after it start only once every program is done.
"""
import triton
import triton.language as tl

from ..runtime.kernels.sync import global_time_ns, poll_read


@triton.jit
def wait_signals(signal, counts, status, per_expert, block_m, threshold, timeout_us,
                 HAS_COUNTS: tl.constexpr, UNSIGNED: tl.constexpr):
    e = tl.program_id(0)
    if HAS_COUNTS:
        blocks = (tl.load(counts + e) + block_m - 1) // block_m
    else:
        blocks = 1
    limit_ns = (tl.full([], 0, tl.int64) + timeout_us) * 1000    # (values of 1 are constexpr)
    t0 = global_time_ns()
    want = tl.full([], 0, tl.int64) + threshold
    late = -1                                       # the first signal not ready in time
    for b in range(0, blocks):
        state = tl.where(late < 0, 0, 1)            # 0: waiting, 1: ready (or given up)
        while state == 0:
            got = poll_read(signal + e * per_expert + b).to(tl.int64)
            if UNSIGNED:
                got = got & tl.full([], 0xFFFFFFFF, tl.int64)
            if got >= want:
                state = 1
            elif global_time_ns() - t0 > limit_ns:
                late = e * per_expert + b
                state = 1
    if late >= 0:
        tl.atomic_cas(status, tl.full([], 0, tl.int64), (late + 1).to(tl.int64),
                      sem="relaxed", scope="gpu")

"""Host-side cost of launching one EP dispatch and one combine on the peer backend, on any
machine (no GPU).

    python tools/ep_host_path.py [--llcomm DIR]

``PeerEP.dispatch`` / ``combine`` run on a shell of the peer backend (CPU tensors for its
symmetric region, counters and handle slots) whose launcher finds every kernel already
compiled and whose kernels' ``run`` does nothing, as ``tools/host_path.py`` does for the TP
ops. What is timed is llcomm's own Python per call before the driver's launch: the handle
slot's views, the argument tuple, the constexprs and the launcher's cache key. Not included:
``EPBuffer``'s argument checks and its handle. The case: a bf16 LL dispatch of 128 tokens,
hidden 7168, 256 experts, top-8, two ranks, and its combine. ``--llcomm DIR`` measures another
checkout's package with this same shell and loop. Prints µs per call: the median and the
fastest of ``host_path.ROUNDS`` rounds of ``host_path.CALLS`` calls.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checkout import argument_parser, use_llcomm_dir  # noqa: E402  (tools/, beside this file)

use_llcomm_dir()

from llcomm import ep as E  # noqa: E402
from llcomm.ep import peer as EP  # noqa: E402
from llcomm.runtime import launch  # noqa: E402
from llcomm.runtime import protocol as P  # noqa: E402
from llcomm.ep.layout import ep_layout  # noqa: E402
from llcomm.ep import kernels as K  # noqa: E402
import host_path  # noqa: E402  (its kernel stand-in and timing loop)

TOKENS, HIDDEN, EXPERTS, TOPK, W, NB = 128, 7168, 256, 8, 2, 128


def shell():
    """A ``PeerEP`` with CPU stand-ins for its device tensors and a do-nothing launch."""
    torch._C._cuda_getCurrentRawStream = lambda index: 0
    torch._C._cuda_getDevice = lambda: 0
    torch.cuda.is_current_stream_capturing = lambda: False
    buf = object.__new__(E.EPBuffer)
    buf.num_ranks, buf.num_local_experts, buf.max_tokens = W, EXPERTS // W, TOKENS
    buf.hidden, buf.dtype = HIDDEN, torch.bfloat16
    pe = object.__new__(EP.PeerEP)
    pe.k = K
    pe.dispatch_kernel = host_path._StandIn(K.ll_dispatch_kernel)
    pe.combine_kernel = host_path._StandIn(K.combine_kernel)
    pe.rank, pe.W, pe.nb, pe.buf, pe.timeout_us = 0, W, NB, buf, 10**6
    pe.layout = lay = ep_layout(TOKENS, HIDDEN, W, EXPERTS, 2, num_blocks=NB, fp8=False)
    pe.tab, pe.ll, pe.masks, pe.profile = torch.zeros(W, dtype=torch.int64), 1, 0, 0
    pe._rows = [EP.ll_row_consts(lay, fp8) for fp8 in range(3)]
    pe.ctrl = torch.zeros((2, NB), dtype=torch.int64)
    pe._ctrl = (pe.ctrl[0], pe.ctrl[1])
    pe.err = torch.zeros(4096, dtype=torch.int64)
    L = EXPERTS // W
    pe._slot_words = (W * TOKENS * EP.MAX_TOPK, L * W * TOKENS, L, W)
    pe.slots = [torch.zeros(sum(pe._slot_words), dtype=torch.int32) for _ in range(2)]
    pe._failure = P.FailureLatch(0, "EPBuffer")
    pe._launch = launch.Launcher(torch.device("cpu"))
    pe._launch.device_index = 0
    pe._call_consts, pe._slot_views, pe._tags = {}, {}, {}
    if not callable(getattr(EP.PeerEP, "_consts", None)):
        pe._consts = {}                     # an older checkout's per-top-k constexpr cache
    pe.num_warps = EP.kernel_consts(lay, 1)[2]
    return pe


def main() -> None:
    argument_parser().parse_args()
    print(f"llcomm from {os.path.dirname(E.__file__)}")
    pe = shell()
    L = EXPERTS // W
    x = torch.randn(TOKENS, HIDDEN).bfloat16()
    idx = torch.zeros(TOKENS, TOPK, dtype=torch.int64)
    w = torch.rand(TOKENS, TOPK)
    recv = torch.empty(L, W * TOKENS, HIDDEN).bfloat16()
    out = torch.empty_like(x)
    calls = [0]

    def dispatch():
        calls[0] += 1
        return pe.dispatch(x, idx, recv, calls[0] % 2)

    _, _, state, _ = dispatch()
    for name, f in (("dispatch", dispatch),
                    ("combine", lambda: pe.combine(recv, idx, w, state, out))):
        med, best = host_path.per_call_us(f)
        print(f"EP {name:8s} (bf16, {TOKENS} tokens, hidden {HIDDEN}, top-{TOPK}): {med:6.1f} us "
              f"per call (fastest round {best:.1f})")


if __name__ == "__main__":
    main()

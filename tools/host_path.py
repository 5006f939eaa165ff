"""Host-side cost of one ``Communicator.all_reduce`` call on the peer backend, on any machine.

    python tools/host_path.py [--llcomm DIR]

``--llcomm DIR`` measures the llcomm package of another checkout (say a ``git worktree`` of an
older commit) with this same stand-in and timing loop, for an A/B on one machine.

The GPU part is stood in for: a peer backend without a workspace, whose launcher finds every
kernel already compiled and whose kernels' ``run`` does nothing. What is left is llcomm's own
Python per call (argument checks, the algorithm lookup, the launch plan, the launcher's cache
key), which an eager decode step pays on top of the driver's launch; the same for the fused
``all_reduce_residual_rmsnorm``. Prints µs per call: the
median and the fastest of ROUNDS rounds of CALLS calls (this development VM's timings wander by
tens of percent from one round to the next).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checkout import argument_parser, use_llcomm_dir  # noqa: E402  (tools/, beside this file)

use_llcomm_dir()

from llcomm.tp import algo_table as T  # noqa: E402
from llcomm.runtime import launch
from llcomm.tp import api as tp, peer  # noqa: E402
from llcomm.runtime import protocol as P  # noqa: E402
from llcomm.runtime.settings import LAMPORT_CHUNK_BYTES, NUM_BLOCKS  # noqa: E402
from llcomm.tp.kernels import all_reduce as K, lamport as LK  # noqa: E402
from llcomm.tp.kernels import fused_norm as F  # noqa: E402

CALLS, WARMUP, ROUNDS = 5000, 2000, 9


class _Kernel:
    function = packed_metadata = None

    def run(self, *args):
        pass


class _StandIn:
    """``fn[grid](...)`` returns a kernel whose launch does nothing."""

    def __init__(self, fn):
        self.arg_names = fn.arg_names

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _Kernel()


def shell() -> tp.Communicator:
    import triton.language as tl
    torch._C._cuda_getCurrentRawStream = lambda index: 0
    torch.cuda.is_current_stream_capturing = lambda: False
    c = object.__new__(tp.Communicator)
    c.device, c.max_bytes, c.backend, c.deterministic = torch.device("cpu"), 16 << 20, "peer", False
    c.world_size, c.rank, c._closed, c._hot_ar, c._hot_fused = 2, 0, False, {}, {}
    pb = object.__new__(peer.PeerBackend)
    pb.nb, pb.world_size, pb.WP, pb.rank = NUM_BLOCKS, 2, 2, 0
    pb.cap_bytes = pb.lamport_bytes = pb.rs_lamport_bytes = 16 << 20
    pb.lamport_chunk = LAMPORT_CHUNK_BYTES
    pb.timeout_us = 10**6
    pb.tabs = {k: torch.zeros(2, dtype=torch.int64)
               for k in ("lamport", "lamport_tags", "stage", "flags", "gather")}
    pb.ctrl = pb.err = pb.flags = torch.zeros(4, dtype=torch.int64)
    pb._err_np, pb._failure = [0], P.FailureLatch(0, "communicator")
    pb._tl_float = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                    torch.float32: tl.float32}
    pb._k_ar = type("Kernels", (), {n: _StandIn(getattr(K, n)) for n in
                                     ("one_shot_kernel", "two_shot_kernel")})
    pb._k_lam = type("Kernels", (), {"lamport_kernel": _StandIn(LK.lamport_kernel)})
    pb._k_lam.ALL_STAGES = LK.ALL_STAGES
    pb._k_fn = type("Kernels", (), {n: _StandIn(getattr(F, n)) for n in
                                     ("lamport_norm_kernel", "one_shot_norm_kernel")})
    pb._k_fn.ALL_STAGES = F.ALL_STAGES
    pb._plans, pb._launch = {}, launch.Launcher(torch.device("cpu"))
    pb._launch.device_index = 0             # as on a GPU: each launch asks for the current device
    torch._C._cuda_getDevice = lambda: 0
    c._impl = pb
    c._auto = T.compile_rows([(8 << 20, "lamport")], "two_shot", "rule")
    return c


def per_call_us(f) -> tuple[float, float]:
    """(median, fastest) over ROUNDS rounds of µs per call of ``f``."""
    for _ in range(WARMUP):
        f()
    rounds = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        for _ in range(CALLS):
            f()
        rounds.append((time.perf_counter() - t) / CALLS * 1e6)
    return statistics.median(rounds), min(rounds)


def measure(nbytes: int = 8 << 10, algo: str = "auto") -> float:
    """Median µs per call of a bf16 all_reduce of ``nbytes`` on the stand-in (patches torch's
    stream and capture queries for the rest of the process: call it last)."""
    return _measure(nbytes, algo)[0]


def _measure(nbytes: int, algo: str) -> tuple[float, float]:
    c = shell()
    x = torch.randn(nbytes // 2).bfloat16()
    out = torch.empty_like(x)
    return per_call_us(lambda: c.all_reduce(x, out=out, algo=algo))


def _measure_fused(tokens: int, hidden: int = 8192) -> tuple[float, float]:
    """all_reduce_residual_rmsnorm of bf16 [tokens, hidden], residual updated in place."""
    c = shell()
    x, res = torch.randn(tokens, hidden).bfloat16(), torch.randn(tokens, hidden).bfloat16()
    w, out = torch.ones(hidden).bfloat16(), torch.empty(tokens, hidden).bfloat16()
    return per_call_us(lambda: c.all_reduce_residual_rmsnorm(x, res, w, 1e-6, out=out,
                                                             residual_out=res))


def main() -> None:
    argument_parser().parse_args()
    import llcomm
    print(f"llcomm from {os.path.dirname(llcomm.__file__)}")
    for nbytes in (8 << 10, 1 << 20):
        for algo in ("auto", "lamport", "one_shot"):
            med, best = _measure(nbytes, algo)
            print(f"all_reduce {nbytes >> 10:5d} KiB bf16 algo={algo:8s} {med:6.2f} us per call "
                  f"(fastest round {best:.2f})")
    for tokens in (1, 128):
        med, best = _measure_fused(tokens)
        print(f"all_reduce_residual_rmsnorm [{tokens}, 8192] bf16 {med:6.2f} us per call "
              f"(fastest round {best:.2f})")


if __name__ == "__main__":
    main()

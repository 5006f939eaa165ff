"""What one eager launch costs on this machine's host, on one GPU: the floor under an eager join.

    python tools/eager_floor.py [--calls 5000] [--json PATH]

Times back-to-back calls (the GPU work of each is a few µs at most, so the host is what is
measured), µs per call, median of 5 rounds:

- ``torch add_``: ``x.add_(1)`` on 8 KiB, torch's C++ launch path (the reference floor).
- ``triton jit``: a trivial Triton kernel through ``kernel[grid](...)`` (Triton's binder).
- ``llcomm launcher``: a kernel shaped like llcomm's (two operands, four workspace tensors)
  through ``llcomm.launch.Launcher``, the cached kernel's ``run``: with its six pointers
  passed as tensors (the unplanned path: the C launcher calls ``data_ptr`` and the driver's
  ``cuPointerGetAttribute`` for each) and by a ``launch.Plan`` (pointers passed as ints, what
  all_reduce and reduce_scatter pay), with and without PDL.
- ``llcomm host path``: ``tools/host_path.py``'s stand-in all_reduce (llcomm's Python per
  call, no launch), for the split.

An eager llcomm op costs about its host path plus one launcher call; the rest of an eager
benchmark row is the GPU and the wait for the peer.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llcomm.runtime import launch  # noqa: E402
from llcomm.runtime.kernels.sync import after_previous_kernel  # noqa: E402

ROUNDS = 5


@triton.jit
def _touch(x, n, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    after_previous_kernel(PDL)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x + offs, tl.load(x + offs, mask=m) + 1, mask=m)


@triton.jit
def _touch6(x, out, n, a, b, c, d, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    """x + 1 into out; a-d stand for the workspace tables and counters a real op takes."""
    after_previous_kernel(PDL)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out + offs, tl.load(x + offs, mask=m) + 1, mask=m)


def per_call_us(fn, calls: int) -> float:
    """Median over ROUNDS of the wall time per call of ``calls`` calls, synchronised at the end."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    x = torch.zeros(4096, dtype=torch.bfloat16, device=dev)
    rows = {"torch add_": per_call_us(lambda: x.add_(1), a.calls),
            "triton jit": per_call_us(lambda: _touch[(1,)](x, 4096, BLOCK=4096), a.calls)}
    y = torch.zeros_like(x)
    tabs = [torch.zeros(2, dtype=torch.int64, device=dev) for _ in range(4)]
    for pdl in (0, 1):
        lau = launch.Launcher(dev)
        lau.pdl = bool(pdl) and lau.pdl
        rows[f"llcomm launcher, tensors (PDL {int(lau.pdl)})"] = per_call_us(
            lambda: lau(_touch6, 1, (x, y, 4096, *tabs), 4, BLOCK=4096), a.calls)
        plan = launch.Plan(_touch6, 1, (4096, *tabs), 4, {"BLOCK": 4096}, (None, None))
        rows[f"llcomm plan, int pointers (PDL {int(lau.pdl)})"] = per_call_us(
            lambda: lau.run(plan, x, y), a.calls)
    import host_path  # noqa: E402  (tools/, beside this file)
    rows["llcomm host path (no launch)"] = host_path.measure()
    for k, v in rows.items():
        print(f"{k:34s} {v:6.2f} µs per call")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                       "triton": triton.__version__, "commit": os.environ.get("LLCOMM_COMMIT"),
                       "us_per_call": rows}, f, indent=1)


if __name__ == "__main__":
    main()

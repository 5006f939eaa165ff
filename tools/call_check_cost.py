"""What the reference backend's call check (``check_calls``) costs per call on gloo.

    python tools/call_check_cost.py [--ranks 2] [--rounds 15] [--calls 200] [--llcomm DIR]

Starts ``--ranks`` CPU processes on one gloo group. Each holds a ``Communicator`` and an
``EPBuffer`` with the check on and another pair with it off, and times the same calls on both in
alternating rounds (``--rounds`` rounds of ``--calls`` calls each, so drift of a shared machine
hits both alike): ``all_reduce`` of 1 element (once, and twice in a row as a yardstick: what
one more small collective costs) and of 4096 float32 elements, and one EP dispatch + combine (8
experts, hidden 128, bf16, 4 tokens, top-2). Prints rank 0's median µs per call with the check
off and on and the difference, which is the cost of the header exchange.
"""
from __future__ import annotations

import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checkout import argument_parser, use_llcomm_dir

use_llcomm_dir()


def _cases(rank, ws):
    """name -> function(comm, buf) making one call."""
    small, big = torch.ones(1), torch.ones(4096)
    E, T, H, K = 8, 4, 128, 2
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    topk = torch.randint(0, E, (T, K), generator=g)
    w = torch.rand(T, K, generator=g)

    def ep(comm, buf):
        rx, _, handle = buf.dispatch(x, topk)
        buf.combine(rx, topk, w, handle)
    return {"all_reduce 1 x fp32": lambda comm, buf: comm.all_reduce(small),
            "two such all_reduce": lambda comm, buf: (comm.all_reduce(small),
                                                      comm.all_reduce(small)),
            "all_reduce 4096 x fp32": lambda comm, buf: comm.all_reduce(big),
            "EP dispatch + combine": ep}, dict(num_experts=E, hidden=H,
                                               num_max_dispatch_tokens_per_rank=T)


def _worker(rank, ws, port, rounds, calls, out):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ws)
    import llcomm
    cases, ep_args = _cases(rank, ws)
    objs = {on: (llcomm.Communicator(backend="reference", check_calls=on),
                 llcomm.EPBuffer(backend="reference", check_calls=on, **ep_args))
            for on in (False, True)}
    times = {(name, on): [] for name in cases for on in (False, True)}
    for name, fn in cases.items():
        for on in (False, True):        # warm-up
            for _ in range(calls // 4):
                fn(*objs[on])
        for r in range(rounds):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn(*objs[on])
                times[(name, on)].append((time.perf_counter() - t0) / calls * 1e6)
    if rank == 0:
        out.put({k: statistics.median(v) for k, v in times.items()})
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argument_parser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, a.ranks, store.port, a.rounds, a.calls, out))
             for r in range(a.ranks)]
    for p in procs:
        p.start()
    med = out.get(timeout=1800)
    for p in procs:
        p.join()
    print(f"gloo, {a.ranks} CPU processes, median of {a.rounds} rounds x {a.calls} calls "
          f"(µs per call, rank 0), torch {torch.__version__}")
    print(f"{'call':<24} {'check off':>10} {'check on':>10} {'cost':>8}")
    for name in dict.fromkeys(k for k, _ in med):
        off, on = med[(name, False)], med[(name, True)]
        print(f"{name:<24} {off:>10.1f} {on:>10.1f} {on - off:>+8.1f}")


if __name__ == "__main__":
    main()

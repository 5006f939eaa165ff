"""Benchmark EP dispatch / combine: llcomm's peer kernels against the reference backend on NCCL.

    python tools/bench_ep.py                                  # 128 tokens/rank, DeepSeek-V3 MoE
    python tools/bench_ep.py --tokens 1,32,128,256,512 --json bench/results/h200x2-ep.json

Every rank gets its own GPU (``--ranks``, default: all visible GPUs). Uniform random routing
(distinct experts per token), bf16. For each op and backend: a CUDA graph of ``--ops``
back-to-back calls, replayed ``--replays`` times, ranks lined up by a barrier before each
replay, the slowest rank's time per call, median (p10 / p90 too); eager mode is the same loop
without the graph. ``bytes`` is the payload one rank sends: dispatch, one row per (token,
destination rank); combine, one partial per (token, rank that holds one of its experts).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}


def _routing(n, E, topk, seed, device):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    scores = torch.rand(n, E, generator=g, device=device)
    idx = scores.topk(topk, dim=1).indices.to(torch.int64).contiguous()
    w = torch.rand(n, topk, generator=g, device=device).contiguous()
    return idx, w


def _time(fn, ops, replays, graph):
    """Per-call µs of ``fn`` on every replay (this rank), ranks lined up before each replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()                           # compile and warm up outside any capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(ops):
                fn()
        run = g.replay
    else:
        def run():
            for _ in range(ops):
                fn()
    run()                                  # warm-up replay
    times = []
    line_up = torch.zeros(1, device="cuda")
    for _ in range(replays):
        dist.all_reduce(line_up)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / ops)
    return torch.tensor(times, device="cuda")


def _stats(t):
    q = torch.quantile(t.double().cpu(), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    return [round(float(v), 2) for v in q]


def _body(rank, world, port, args, out_q):
    os.environ.update(GPU_ENV)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    try:
        import llcomm.ep as ep
        E, H, K = args.experts, args.hidden, args.topk
        L = E // world
        sizes = [int(s) for s in args.tokens.split(",")]
        T = max(sizes)
        bufs = {"llcomm": ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                                      backend="peer"),
                "reference": ep.EPBuffer(num_experts=E, hidden=H,
                                         num_max_dispatch_tokens_per_rank=T, backend="reference")}
        rows = []
        for n in sizes:
            x = torch.randn(n, H, device="cuda").to(torch.bfloat16)
            idx, w = _routing(n, E, K, 1234 + rank * 7919 + n, "cuda")
            dests = torch.zeros(n, world, dtype=torch.bool, device="cuda")
            dests.scatter_(1, idx // L, True)
            payload = int(dests.sum()) * H * 2
            recv = torch.empty(L, world * T, H, dtype=torch.bfloat16, device="cuda")
            y = torch.empty(n, H, dtype=torch.bfloat16, device="cuda")
            for impl, buf in bufs.items():
                for mode in ("graph", "eager"):
                    for op in ("dispatch", "combine"):
                        # a fresh dispatch for the combine to use (handles live two dispatches)
                        rx, rc, h = buf.dispatch(x, idx, out=recv)
                        eo = rx.clone()
                        if op == "dispatch":
                            def fn():
                                buf.dispatch(x, idx, out=recv)
                        else:
                            def fn():
                                buf.combine(eo, idx, w, h, out=y)
                        t = _time(fn, args.ops, args.replays, mode == "graph")
                        dist.all_reduce(t, op=dist.ReduceOp.MAX)   # slowest rank per replay
                        p10, med, p90 = _stats(t)
                        rows.append({"op": op, "impl": impl, "algo": "ll", "mode": mode,
                                     "dtype": "bfloat16", "world_size": world, "bytes": payload,
                                     "tokens_per_rank": n, "hidden": H, "num_experts": E,
                                     "topk": K, "fp8": False, "median_us": med, "p10_us": p10,
                                     "p90_us": p90, "wrong": 0,
                                     "gbps": round(payload / med / 1e3, 1) if med else None})
            torch.cuda.synchronize()
        bufs["llcomm"].check()
        bufs["llcomm"].close()
        if rank == 0:
            out_q.put(rows)
    finally:
        dist.destroy_process_group()


def _print(rows):
    print(f"{'op':9s} {'tokens':>6s} {'impl':10s} {'mode':6s} {'median us':>10s} {'p10':>8s} "
          f"{'p90':>8s} {'MB sent':>8s} {'GB/s':>7s}")
    for r in rows:
        print(f"{r['op']:9s} {r['tokens_per_rank']:6d} {r['impl']:10s} {r['mode']:6s} "
              f"{r['median_us']:10.2f} {r['p10_us']:8.2f} {r['p90_us']:8.2f} "
              f"{r['bytes'] / 1e6:8.2f} {r['gbps'] or 0:7.1f}")
    for n in sorted({r["tokens_per_rank"] for r in rows}):
        for op in ("dispatch", "combine"):
            got = {r["impl"]: r["median_us"] for r in rows
                   if r["tokens_per_rank"] == n and r["op"] == op and r["mode"] == "graph"}
            if "llcomm" in got and "reference" in got and got["llcomm"]:
                print(f"{op} @ {n} tokens: llcomm {got['llcomm']:.1f} us, reference "
                      f"{got['reference']:.1f} us ({got['reference'] / got['llcomm']:.1f}x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="128", help="tokens per rank, comma-separated")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=None)
    ap.add_argument("--ops", type=int, default=20, help="calls per graph replay")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--json", default=None, help="write the rows (DESIGN.md format) here")
    args = ap.parse_args()
    world = args.ranks or torch.cuda.device_count()
    if world < 2:
        raise SystemExit("tools/bench_ep.py: needs at least 2 GPUs")
    os.environ.update(GPU_ENV)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_body, args=(r, world, port, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    rows = q.get(timeout=1800)
    for p in procs:
        p.join()
    _print(rows)
    if args.json:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
        except OSError:
            commit = "?"
        import triton
        doc = {"commit": commit, "machine": f"{world}x{torch.cuda.get_device_name(0)}",
               "date": datetime.date.today().isoformat(),
               "versions": {"torch": torch.__version__, "triton": triton.__version__,
                            "nccl": ".".join(map(str, torch.cuda.nccl.version()))},
               "rows": rows}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

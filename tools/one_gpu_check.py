"""A functional check of the peer kernels with two ranks sharing ONE GPU (a development aid).

    python tools/one_gpu_check.py [--json PATH]

For sessions that are lent a one-GPU machine only. Two processes (a gloo group) both use
cuda:0; ``llcomm.tp.peer_support`` is overridden, since the library refuses this setup on
purpose (two contexts on one device are time-sliced, not concurrent, and a store between them
is not a supported peer path). PyTorch's symmetric memory refuses two ranks on one device too
("allocations from overlapping devices"), so the workspace here is a plain allocation mapped
into the other process with CUDA IPC (``_ipc_workspace``). So this proves nothing about speed or about NVLink ordering;
it does run the real Triton kernels, the launch path (plans, int pointers, hot paths) and the
EP host side on the machine's own torch and Triton, against exact oracles computed on the CPU:

- all_reduce (every algorithm, bf16 and fp32, three sizes, three rounds: the hot path),
  broadcast, all_gather, all_gather_2d, reduce_scatter: bit for bit;
- the fused join: residual_out bit for bit, out within one bf16 step of the unfused math;
- all_reduce captured in a CUDA graph, replayed with fresh inputs;
- EP dispatch (bf16 and FP8) byte for byte against ``test_ep_oracle``, combine bit for bit
  against its ordered fp32 oracle, over alternating buffer sets and fresh routings.

Prints one line per check and a summary; exits 1 if any check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

WORLD = 2
#: Device-side wait bound: time-slicing between the two contexts stretches every wait.
TIMEOUT_MS = 30_000
SIZES = (8192, 262144, 1 << 20)          # bytes per all_reduce input
ROUNDS = 3
EP_SHAPES = {"small": dict(E=16, H=512, T=24, topk=4), "deepseek": dict(E=256, H=7168, T=128, topk=8)}


def _inputs(seed: int, n: int, dtype: torch.dtype):
    """Every rank's input for one call (each rank builds all of them: the oracle is local)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype) for _ in range(WORLD)]


def _sum(xs):
    """The documented all_reduce: fp32, rank order, rounded once."""
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return acc.to(xs[0].dtype)


def _tp_checks(rank, comm, record):
    import llcomm.tp as tp
    seed = 1000
    for algo in tp.ALGOS:
        for dtype in (torch.bfloat16, torch.float32):
            for nbytes in SIZES:
                n = nbytes // dtype.itemsize
                bad = 0
                for _ in range(ROUNDS):
                    seed += 1
                    xs = _inputs(seed, n, dtype)
                    got = comm.all_reduce(xs[rank].cuda(), algo=algo).cpu()
                    bad += int(not torch.equal(got, _sum(xs)))
                record(f"all_reduce {algo} {str(dtype)[6:]} {nbytes} B", bad == 0,
                       f"{bad}/{ROUNDS} rounds differ")
    n = 4096
    for src in range(WORLD):
        seed += 1
        xs = _inputs(seed, n, torch.bfloat16)
        got = comm.broadcast(xs[rank].cuda(), src).cpu()
        record(f"broadcast src {src}", torch.equal(got, xs[src]), "")
    seed += 1
    xs = _inputs(seed, n, torch.bfloat16)
    out = torch.full((WORLD * n,), float("nan"), dtype=torch.bfloat16, device="cuda")
    record("all_gather", torch.equal(comm.all_gather(xs[rank].cuda(), out=out).cpu(),
                                     torch.cat(xs)), "")
    tokens, part = 16, 256
    x2 = [x.view(tokens, part) for x in xs]
    got = comm.all_gather_2d(x2[rank].cuda()).cpu()
    record("all_gather_2d", torch.equal(got, torch.cat(x2, dim=1)), "")
    for nbytes in (8192, 4 << 20):
        seed += 1
        xs = _inputs(seed, nbytes // 2, torch.bfloat16)
        got = comm.reduce_scatter(xs[rank].cuda()).cpu()
        want = _sum(xs).view(WORLD, -1)[rank]
        record(f"reduce_scatter {nbytes} B", torch.equal(got, want), "")


def _fused_checks(rank, comm, record):
    import llcomm.tp as tp
    hidden, eps = 8192, 1e-6
    for algo in tp.FUSED_ALGOS:
        for tokens in (1, 16, 128):
            g = torch.Generator().manual_seed(7000 + tokens)
            xs = [torch.randn(tokens, hidden, generator=g).to(torch.bfloat16) for _ in range(WORLD)]
            res = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
            w = (torch.rand(hidden, generator=g) + 0.5).to(torch.bfloat16)
            y, h = comm.all_reduce_residual_rmsnorm(xs[rank].cuda(), res.cuda(), w.cuda(), eps,
                                                    algo=algo)
            h_want = (_sum(xs).float() + res.float()).to(torch.bfloat16)
            hf = h_want.float()
            y_want = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w.float())
            step = y_want.abs().clamp_min(1e-3) * 2 ** -7      # one bf16 step, relative
            ok_y = bool(((y.cpu().float() - y_want).abs() <= step).all())
            record(f"fused {algo} tokens {tokens}", torch.equal(h.cpu(), h_want) and ok_y,
                   f"residual_out bitwise {torch.equal(h.cpu(), h_want)}, out within a step {ok_y}")


def _graph_check(rank, comm, record):
    from llcomm.bench.common import capture
    n = 4096
    static = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    outs = {}
    graph = capture(lambda: outs.__setitem__("y", comm.all_reduce(static)), 1)
    bad = 0
    for i in range(5):
        xs = _inputs(9000 + i, n, torch.bfloat16)
        static.copy_(xs[rank])
        graph.replay()
        bad += int(not torch.equal(outs["y"].cpu(), _sum(xs)))
        eager = comm.all_reduce(xs[rank].cuda()).cpu()      # eager calls mix with replays
        bad += int(not torch.equal(eager, _sum(xs)))
    record("all_reduce graph replay + eager, 5 rounds", bad == 0, f"{bad} mismatches")


def _ep_checks(rank, record):
    import llcomm.ep as ep
    from test_ep_oracle import (expert_fn, make_case, oracle_combine, oracle_dispatch,
                                oracle_dispatch_fp8)
    for name, s in EP_SHAPES.items():
        E, H, T, topk = s["E"], s["H"], s["T"], s["topk"]
        buf = ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                          backend="peer", timeout_ms=TIMEOUT_MS)
        for i, kind in enumerate(("random", "sparse", "zero_and_max", "random")):
            fp8 = i == 3 and H % 128 == 0
            xs, topks, ws = make_case(WORLD, E, T, H, topk, 300 + i, kind)
            x, idx, w = xs[rank].cuda(), topks[rank].cuda(), ws[rank].cuda()
            recv, count, handle = buf.dispatch(x, idx, use_fp8=fp8)
            if fp8:
                codes, scales, want_count, _ = oracle_dispatch_fp8(xs, topks, WORLD, E, T, False)[rank]
                got_x, got_s = recv[0].view(torch.uint8).cpu(), recv[1].cpu()
                ok = torch.equal(count.cpu(), want_count) and all(
                    torch.equal(got_x[e, :c], codes[e, :c]) and torch.equal(got_s[e, :c], scales[e, :c])
                    for e, c in enumerate(want_count.tolist()))
                record(f"EP {name} fp8 dispatch", ok, "codes, scales and counts")
                continue
            want = oracle_dispatch(xs, topks, WORLD, E, T)
            want_x, want_count, _ = want[rank]
            got_x = recv.cpu()
            ok = torch.equal(count.cpu(), want_count) and all(
                torch.equal(got_x[e, :c], want_x[e, :c]) for e, c in enumerate(want_count.tolist()))
            record(f"EP {name} {kind} dispatch", ok, "rows and counts")
            outs = [expert_fn(want[r][0], want[r][1], r) for r in range(WORLD)]
            got = buf.combine(expert_fn(recv, count, rank), idx, w, handle).cpu()
            ref = oracle_combine(outs, topks, ws, WORLD, E, torch.bfloat16)[rank]
            record(f"EP {name} {kind} combine", torch.equal(got, ref),
                   f"max diff {(got.float() - ref.float()).abs().max().item() if got.numel() else 0}")
        buf.close()


class _IpcHandle:
    """What llcomm's workspace reads from a symmetric-memory handle: rank, world size, and every
    rank's base address, here from CUDA IPC (the peers' tensors are kept alive with it)."""

    def __init__(self, buffer):
        import torch.distributed as dist
        from torch.multiprocessing.reductions import reduce_tensor
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        shared = [None] * self.world_size
        dist.all_gather_object(shared, reduce_tensor(buffer))
        self._peers = [buffer if r == self.rank else fn(*args) for r, (fn, args) in enumerate(shared)]
        self.buffer_ptrs = [t.data_ptr() for t in self._peers]


def _ipc_workspace():
    """Point llcomm's workspace at plain allocations shared by CUDA IPC (one group: the world)."""
    import torch.distributed._symmetric_memory as symm_mem
    symm_mem.empty = lambda n, dtype, device: torch.empty(n, dtype=dtype, device=device)
    symm_mem.rendezvous = lambda buffer, group_name: _IpcHandle(buffer)


def _body(rank, world_size):
    import llcomm.tp as tp
    torch.cuda.set_device(0)
    tp.peer_support = lambda group: (True, "tools/one_gpu_check.py: two ranks on one GPU")
    _ipc_workspace()
    results = []

    def record(name, ok, detail):
        results.append((name, bool(ok), detail))

    t0 = time.time()
    comm = tp.Communicator(backend="peer", timeout_ms=TIMEOUT_MS, max_bytes=8 << 20)
    for part in (_tp_checks, _fused_checks, _graph_check):
        try:
            part(rank, comm, record)
        except Exception as e:  # noqa: BLE001  (report and go on to the next part)
            record(part.__name__, False, f"{type(e).__name__}: {e}")
    comm.close()
    try:
        _ep_checks(rank, record)
    except Exception as e:  # noqa: BLE001
        record("_ep_checks", False, f"{type(e).__name__}: {e}")
    return results, time.time() - t0


def main():
    from _dist import run_distributed
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    per_rank = run_distributed(_body, WORLD, backend="gloo", timeout=900)
    failed = 0
    for rank, (results, secs) in enumerate(per_rank):
        for name, ok, detail in results:
            failed += not ok
            print(f"rank {rank} {'ok  ' if ok else 'FAIL'} {name}  {detail}")
        print(f"rank {rank}: {sum(ok for _, ok, _ in results)}/{len(results)} ok in {secs:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"commit": os.environ.get("LLCOMM_COMMIT"), "torch": torch.__version__,
                       "machine": torch.cuda.get_device_name(0),
                       "ranks": [r for r, _ in per_rank]}, f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

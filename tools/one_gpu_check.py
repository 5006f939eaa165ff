"""A functional check of the peer kernels with two ranks sharing ONE GPU (a development aid).

    python tools/one_gpu_check.py [--json PATH] [--sequences N]
    python tools/one_gpu_check.py --pytest tests/test_deep_ep_gpu.py [more pytest arguments]

For a host with one GPU (a multi-GPU host runs the GPU suite instead). Two processes (a gloo group)
both use cuda:0; ``tools/_one_gpu.py`` lifts the library's refusal of that setup (two contexts on
one device are time-sliced, not concurrent) and shares the workspaces by CUDA IPC. This proves
nothing about speed or NVLink ordering. It does run the real Triton kernels, the launch path
(plans, int pointers, hot paths) and the host code on the machine's own torch and Triton.

``--pytest`` runs the named ``gpu`` tests that way: each 2-rank NCCL run becomes a gloo run on
cuda:0. What needs two devices (NCCL itself, torch's symmetric-memory ops, true concurrency:
a peer that must make progress while another spins) can fail there without a fault in llcomm;
read the failures. Without ``--pytest``, the built-in checks run against exact oracles computed
on the CPU:

- all_reduce (every algorithm, bf16 and fp32, three sizes, three rounds: the hot path),
  broadcast, all_gather, all_gather_2d, reduce_scatter: bit for bit;
- the fused join: residual_out bit for bit, out within one bf16 step of the unfused math;
- all_reduce captured in a CUDA graph, replayed with fresh inputs between eager calls;
- EP at two shapes (DeepSeek-V3's included), ten rounds in one buffer over alternating
  buffer sets with fresh routings, top-k 8 and 2, FP8, carried weights and receive hooks:
  dispatch byte for byte against ``test_ep_oracle``, combine bit for bit against its ordered
  fp32 oracle; then a captured dispatch + combine replayed with four routings;
- the combine after every dispatch format, through ``EPBuffer`` (bf16, FP8, FP8 round_scale)
  and ``llcomm.deep_ep`` (the same and UE8M0; each handle combined twice, the second time
  zero-copy), checked by ``llcomm.bench.ep_seqrun`` against its oracle;
- with ``--sequences N``: N random legal call sequences (``llcomm.bench.ep_sequences``) per API
  (EPBuffer and deep_ep), with random sleeps on one rank, every dispatch and combine checked.
  It prints ``sequences: <api> N run, D dispatches, C combines, F failed`` per API.

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
EP_SHAPES = {"small": dict(E=16, H=512, T=24, topk=4),
             "deepseek": dict(E=256, H=7168, T=128, topk=8)}


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
    import llcomm.tp.api as tp
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
    from llcomm.tp.fused import FUSED_ALGOS
    hidden, eps = 8192, 1e-6
    for algo in FUSED_ALGOS:
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
    from llcomm.bench.timing import capture
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


def _ep_case(E, H, T, topk, seed, kind, rank):
    from test_ep_oracle import make_case
    xs, topks, ws = make_case(WORLD, E, T, H, topk, seed, kind)
    return xs, topks, ws, (xs[rank].cuda(), topks[rank].cuda(), ws[rank].cuda())


def _ep_round(buf, rank, s, seed, kind, *, fp8=False, carry=False, hook=False, topk=None):
    """One dispatch + combine against the oracles: (dispatch ok, combine ok or None, detail)."""
    from test_ep_oracle import expert_fn, oracle_combine, oracle_dispatch, oracle_dispatch_fp8
    E, H, T = s["E"], s["H"], s["T"]
    xs, topks, ws, (x, idx, w) = _ep_case(E, H, T, topk or s["topk"], seed, kind, rank)
    got = buf.dispatch(x, idx, use_fp8=fp8, return_recv_hook=hook,
                       topk_weights=w if carry else None)
    if hook:
        x.fill_(float("nan"))           # the send half has the rows: x may be reused
        got[3]()
    recv, count, handle = got[:3]
    if fp8:
        codes, scales, want_count, _ = oracle_dispatch_fp8(xs, topks, WORLD, E, T, False)[rank]
        got_x, got_s = recv[0].view(torch.uint8).cpu(), recv[1].cpu()
        ok = torch.equal(count.cpu(), want_count) and all(
            torch.equal(got_x[e, :c], codes[e, :c]) and torch.equal(got_s[e, :c], scales[e, :c])
            for e, c in enumerate(want_count.tolist()))
        return ok, None, "codes, scales and counts"
    want = oracle_dispatch(xs, topks, WORLD, E, T)
    want_x, want_count, _ = want[rank]
    got_x = recv.cpu()
    ok = torch.equal(count.cpu(), want_count) and all(
        torch.equal(got_x[e, :c], want_x[e, :c]) for e, c in enumerate(want_count.tolist()))
    outs = [expert_fn(want[r][0], want[r][1], r) for r in range(WORLD)]
    res = buf.combine(expert_fn(recv, count, rank), idx, None if carry else w, handle,
                      return_recv_hook=hook)
    if hook:
        res[1]()
        res = res[0]
    ref = oracle_combine(outs, topks, ws, WORLD, E, torch.bfloat16)[rank]
    got = res.cpu()
    diff = (got.float() - ref.float()).abs().max().item() if got.numel() else 0.0
    return ok, torch.equal(got, ref), f"combine max diff {diff}"


def _ep_checks(rank, record):
    for name, s in EP_SHAPES.items():
        try:
            _ep_shape_checks(rank, name, s, record)
        except Exception as e:  # noqa: BLE001  (report and go on to the next shape)
            record(f"EP {name}", False, f"{type(e).__name__}: {e}")


def _ep_shape_checks(rank, name, s, record):
    """Ten rounds in one buffer, then a graph, at one shape."""
    import llcomm.ep as ep
    buf = ep.EPBuffer(num_experts=s["E"], hidden=s["H"], num_max_dispatch_tokens_per_rank=s["T"],
                      backend="peer", timeout_ms=TIMEOUT_MS)
    # Fresh routings over alternating buffer sets; modes and top-k change between calls, so
    # the launch side's per-(slot, top-k, mode) views and constexprs are all exercised.
    rounds = [("random", {}), ("sparse", {}), ("zero_and_max", {}), ("random", {"fp8": True}),
              ("random", {"carry": True}), ("dups", {"topk": 2}), ("random", {"hook": True}),
              ("random", {"carry": True, "hook": True}), ("random", {"topk": 2, "carry": True}),
              ("random", {})]
    for i, (kind, mode) in enumerate(rounds):
        ok_d, ok_c, detail = _ep_round(buf, rank, s, 300 + i, kind, **mode)
        label = f"EP {name} round {i} {kind} {' '.join(mode) or 'plain'}"
        record(f"{label} dispatch", ok_d, "rows and counts")
        if ok_c is not None:
            record(f"{label} combine", ok_c, detail)
    _ep_graph_check(buf, rank, s, name, record)
    buf.close()


def _ep_graph_check(buf, rank, s, name, record):
    """dispatch + combine captured once, replayed with fresh routings copied into the statics."""
    from llcomm.bench.timing import capture
    from test_ep_oracle import expert_fn, expert_fn_all_rows, oracle_combine, oracle_dispatch
    E, H, T, K = s["E"], s["H"], s["T"], s["topk"]
    sx = torch.zeros(T, H, dtype=torch.bfloat16, device="cuda")
    sidx = torch.full((T, K), -1, dtype=torch.int64, device="cuda")
    sw = torch.zeros(T, K, dtype=torch.float32, device="cuda")
    got = {}

    def step():
        recv, count, handle = buf.dispatch(sx, sidx)
        got["count"], got["recv"] = count, recv
        got["y"] = buf.combine(expert_fn_all_rows(recv, rank), sidx, sw, handle)

    graph = capture(step, 1)
    bad = 0
    for i in range(4):
        xs, topks, ws, (x, idx, w) = _ep_case(E, H, T, K, 3 * (500 + i), "random", rank)  # n = T
        sx.copy_(x), sidx.copy_(idx), sw.copy_(w)
        graph.replay()
        want = oracle_dispatch(xs, topks, WORLD, E, T)
        outs = [expert_fn(want[r][0], want[r][1], r) for r in range(WORLD)]
        ref = oracle_combine(outs, topks, ws, WORLD, E, torch.bfloat16)[rank]
        bad += int(not torch.equal(got["count"].cpu(), want[rank][1]))
        bad += int(not torch.equal(got["y"].cpu(), ref))
    record(f"EP {name} graph replay, 4 routings", bad == 0, f"{bad} mismatches")


#: Shape of the format and sequence checks (hidden a multiple of 512: UE8M0).
SEQ_SHAPE = dict(E=16, H=512, T=24)
#: Largest sleep injected into the slow rank of a random sequence (s).
SEQ_MAX_DELAY_S = 0.05
#: Largest top-k of a random sequence: each top-k is a kernel variant to compile.
SEQ_MAX_TOPK = 4


def _seq_buffers(api):
    import llcomm.deep_ep as deep_ep
    import llcomm.ep as ep
    s = SEQ_SHAPE
    if api == "ep":
        return ep.EPBuffer(num_experts=s["E"], hidden=s["H"],
                           num_max_dispatch_tokens_per_rank=s["T"], backend="peer",
                           timeout_ms=TIMEOUT_MS)
    return deep_ep.Buffer(None, backend="peer", timeout_ms=TIMEOUT_MS)


def _close(buf):
    (buf.close if hasattr(buf, "close") else buf.destroy)()


def _format_checks(rank, record):
    """Dispatch then combine in every format of each API (deep_ep: combined twice, the second
    time zero-copy), with and without hooks."""
    from llcomm.bench import ep_sequences as S
    from llcomm.bench.ep_seqrun import SequenceRunner
    s = SEQ_SHAPE
    for api in S.APIS:
        buf = _seq_buffers(api)
        run = SequenceRunner(buf, rank, WORLD, num_experts=s["E"], dtype=torch.bfloat16,
                             device="cuda")
        for i, fmt in enumerate(S.formats(api, s["H"])):
            for hook in (False, True):
                h = 2 * i + hook
                d = S.Dispatch(handle=0, seed=4000 + h, tokens=(s["T"], s["T"] // 3), topk=4,
                               fmt=fmt, carry=False, hook=hook, defer_hook=False)
                steps = [d, S.Combine(0, 5000 + h, zero_copy=False, hook=hook)]
                if api == "deep_ep":
                    steps.append(S.Combine(0, 6000 + h, zero_copy=True, hook=not hook))
                seq = S.Sequence(h, api, WORLD, s["T"], s["H"], slow_rank=1, steps=steps)
                fails = run.run(seq)
                record(f"EP formats {api} {fmt}{' hook' if hook else ''}: dispatch + "
                       f"{len(steps) - 1} combine(s)", not fails, "; ".join(fails[:3]))
        _close(buf)


def _sequence_checks(rank, record, count):
    """``count`` random sequences per API on one buffer each."""
    from llcomm.bench import ep_sequences as S
    from llcomm.bench.ep_seqrun import SequenceRunner
    s = SEQ_SHAPE
    for api in S.APIS:
        buf = _seq_buffers(api)
        run = SequenceRunner(buf, rank, WORLD, num_experts=s["E"], dtype=torch.bfloat16,
                             device="cuda")
        failed = 0
        first = ""
        for seed in range(count):
            seq = S.generate(seed, api=api, world=WORLD, max_tokens=s["T"], hidden=s["H"],
                             num_experts=s["E"], max_topk=SEQ_MAX_TOPK,
                             max_delay_s=SEQ_MAX_DELAY_S)
            fails = run.run(seq)
            failed += bool(fails)
            first = first or "; ".join(fails[:2])
        print(f"rank {rank} sequences: {api} {count} run, {run.dispatches} dispatches, "
              f"{run.combines} combines, {failed} failed", flush=True)
        record(f"EP random sequences {api} x{count}", failed == 0,
               f"{failed} failed; first: {first}" if failed else
               f"{run.dispatches} dispatches, {run.combines} combines")
        _close(buf)


def _body(rank, world_size, sequences=0):
    import llcomm.tp.api as tp
    from _one_gpu import patch_process
    patch_process()
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
    parts = [(_ep_checks, ()), (_format_checks, ())]
    if sequences:
        parts.append((_sequence_checks, (sequences,)))
    for part, args in parts:
        try:
            part(rank, record, *args)
        except Exception as e:  # noqa: BLE001  (report; a broken buffer ends its part)
            record(part.__name__, False, f"{type(e).__name__}: {e}")
    return results, time.time() - t0


def main():
    from _dist import run_distributed
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--sequences", type=int, default=0, metavar="N",
                    help="also run N random EP call sequences per API (EPBuffer, deep_ep)")
    ap.add_argument("--pytest", nargs=argparse.REMAINDER, default=None,
                    help="run these pytest arguments' gpu tests with two ranks on cuda:0")
    a = ap.parse_args()
    if a.pytest is not None:
        import pytest

        from _one_gpu import PytestPlugin
        sys.exit(pytest.main(["-m", "gpu", "-p", "no:cacheprovider", *a.pytest],
                             plugins=[PytestPlugin()]))
    per_rank = run_distributed(_body, WORLD, a.sequences, backend="gloo",
                               timeout=900 + 10 * a.sequences)
    failed = 0
    for rank, (results, secs) in enumerate(per_rank):
        for name, ok, detail in results:
            failed += not ok
            print(f"rank {rank} {'ok  ' if ok else 'FAIL'} {name}  {detail}")
        print(f"rank {rank}: {sum(ok for _, ok, _ in results)}/{len(results)} ok in {secs:.0f} s")
    total = sum(len(results) for results, _ in per_rank)
    print(f"# one_gpu_check: {total - failed} of {total} checks ok"
          + (f"; {failed} FAILED" if failed else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"commit": os.environ.get("LLCOMM_COMMIT"), "torch": torch.__version__,
                       "machine": torch.cuda.get_device_name(0),
                       "ranks": [r for r, _ in per_rank]}, f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

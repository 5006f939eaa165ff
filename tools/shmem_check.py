"""The two-level EP kernels on SHMEM, several PEs on one GPU (a development aid).

    python tools/shmem_check.py [--pes 2] [--ranks-per-host 1] [--json PATH]
    python tools/shmem_check.py --remote ibrc|ibgda [--hca mlx5_0:1] [--pes 2] [--json PATH]

Starts ``--pes`` processes (a gloo group) that all use cuda:0, declared as hosts of
``--ranks-per-host`` ranks, and runs ``HostsPeerEP`` on one heap from torch's symmetric memory
with its NVSHMEM backend: with one rank per host every exchange is an NVSHMEM put and signal.
NVSHMEM runs several PEs on one GPU only under CUDA MPS (start ``nvidia-cuda-mps-control -d``
first and export ``NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1``; docs/development.md).
Its timings are not speed figures: the PEs share one GPU.

``--remote ibrc`` / ``--remote ibgda`` force NVSHMEM's remote transport between the PEs: each
gets ``NVSHMEM_DISABLE_P2P=1``, ``NVSHMEM_REMOTE_TRANSPORT=ibrc``, ``NVSHMEM_HCA_LIST`` (``--hca``,
default the first active RDMA port) with ``NVSHMEM_ENABLE_NIC_PE_MAPPING=1`` (recent releases
read the list only then), for ``ibgda`` also ``NVSHMEM_IB_ENABLE_IBGDA=1``, and
``NVSHMEM_INFO=1`` plus, unless ``NVSHMEM_DEBUG`` is set, ``NVSHMEM_DEBUG=INFO`` for init and
transport messages, so NVSHMEM prints its settings and the transport it initialised. Every PE
must be its own declared host (``--ranks-per-host 1``): with P2P disabled NVSHMEM gives no peer
addresses. The tool first prints the transport facts (``llcomm/ep/hosts/transport.py``) and
exits 2 where no RDMA port is active. All PEs share one NIC under MPS, a loopback NVSHMEM does
not document: a pass shows the kernels' remote path works over this NIC, not its speed.

Checks, per PE, against the CPU oracles of ``tests/test_ep_oracle.py`` and
``tests/test_ep_hosts.py`` (outputs poisoned first):

- dispatch (bf16, FP8, FP8 with power-of-two scales) byte for byte, combine bit for bit in
  the documented order, over several calls in one heap (the buffer sets alternate), with the
  split halves (``return_recv_hook``) once;
- the bytes each PE put on the inter-host path against their formula
  (``wire_formula`` of ``tests/test_ep_hosts_kernels_cpu.py``: messages, flags and bytes per
  destination);
- a dispatch + combine captured in a CUDA graph (after one launch outside the capture) and
  replayed with fresh inputs;
- wait statistics: the last PE starts a dispatch late; the PEs that poll it directly (its rail
  and its host) must count most of the delay at its rank, the others nothing;
- rank masks (a second heap, ``MASKS`` = 1): every PE masks the last one by hand, and the
  others' dispatch and combine must match the oracle without it (``tests/
  test_ep_hosts_masks_cpu.py``); then the mask is cleared and the last PE stays away from one
  dispatch + combine: no other PE may fail, each whose rail or host wait polls it must mask
  it, and none may mask another PE;
- a bounded wait: the last PE stays away from one dispatch, and every other PE must raise
  ``CommTimeoutError`` from it, none hang.

Prints one line per check and a summary; exits 1 if any check failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

E, T, H, K = 32, 16, 1024, 4
#: blocks per kernel: every PE's blocks must be resident at once on the one GPU
BLOCKS = 8
TIMEOUT_MS = 60_000
#: the bounded-wait check's bound
SHORT_TIMEOUT_MS = 2_000
#: how late the last PE starts the wait-statistics dispatch
STATS_DELAY_S = 0.3
#: ``--progress``: a PE still running this long after its report prints its Python stacks
EXIT_WATCH_S = 30


def _buf(rank, W, R, fp8, masks=False):
    import torch.distributed as dist

    from llcomm.runtime.hosts import Hosts
    return types.SimpleNamespace(
        group=dist.group.WORLD, rank=rank, num_ranks=W, hosts=Hosts(W // R, R, "declared"),
        max_tokens=T, hidden=H, num_experts=E, num_local_experts=E // W, dtype=torch.bfloat16,
        fp8=fp8, timeout_ms=TIMEOUT_MS, enable_masks=masks)


#: Set for the PEs by ``--progress``.
PROGRESS_ENV = "LLCOMM_SHMEM_CHECK_PROGRESS"


def _rank_body(rank, W, R):
    import torch.distributed as dist

    from llcomm.ep.hosts.layout import row_bytes
    from llcomm.ep.hosts.peer import HostsPeerEP
    from llcomm.errors import CommTimeoutError
    from llcomm.runtime.fp8_format import dequantize
    from test_ep_hosts import oracle_combine_hosts
    from test_ep_hosts_kernels_cpu import wire_formula
    from test_ep_oracle import expert_fn, make_case, oracle_dispatch, oracle_dispatch_fp8

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    L = E // W
    lines, fails = [], 0
    t0 = time.monotonic()
    progress = os.environ.get(PROGRESS_ENV) == "1"

    def report(name, ok, extra=""):
        nonlocal fails
        fails += not ok
        lines.append(f"rank {rank} {'ok  ' if ok else 'FAIL'} {name} {extra}")
        if progress:        # as it happens: a run stopped from outside still shows how far
            print(f"# +{time.monotonic() - t0:.0f} s {lines[-1]}", file=sys.stderr, flush=True)

    ep = HostsPeerEP(_buf(rank, W, R, False), num_blocks=BLOCKS)
    bf = torch.bfloat16
    # (seed, routing, FP8 mode, weights carried by the dispatch)
    calls = ((1, "random", 0, False), (2, "dups", 0, True), (3, "random", 1, False),
             (4, "sparse", 2, True), (5, "zero_and_max", 0, False), (6, "random", 0, True))
    for i, (seed, kind, fp8, carry) in enumerate(calls):
        if progress:
            print(f"# +{time.monotonic() - t0:.0f} s rank {rank} call {i} begins", file=sys.stderr,
                  flush=True)
        xs, topks, weights = make_case(W, E, T, H, K, seed, kind, bf)
        x, idx, w = xs[rank].to(dev), topks[rank].to(dev), weights[rank].to(dev)
        if fp8:
            recv = torch.full((L, W * T, H), 0x7F, dtype=torch.uint8, device=dev)
        else:
            recv = torch.full((L, W * T, H), float("nan"), dtype=bf, device=dev)
        scales = torch.full((L, W * T, H // 128), float("nan"), device=dev)
        split = i == 1
        cnt, src, state, rest = ep.dispatch(x, idx, recv, i % 2, fp8, scales, split=split,
                                            topk_weights=w if carry else None)
        if rest is not None:
            rest()
        torch.cuda.synchronize()
        ep.precheck()
        name = (f"call {i} dispatch {kind} fp8={fp8}{' split' if split else ''}"
                f"{' carried weights' if carry else ''}")
        if fp8:
            codes, sc, ec, es = [t.to(dev) for t in
                                 oracle_dispatch_fp8(xs, topks, W, E, T, fp8 == 2)[rank]]
            ok = torch.equal(cnt, ec) and all(
                torch.equal(recv[e, :c], codes[e, :c]) and torch.equal(scales[e, :c], sc[e, :c])
                and torch.equal(src[e, :c], es[e, :c]) for e, c in enumerate(ec.tolist()))
            recv = dequantize(recv.view(torch.float8_e4m3fn), scales, bf)
            all_recv = [dequantize(a.view(torch.float8_e4m3fn), b, bf)
                        for a, b, _, _ in oracle_dispatch_fp8(xs, topks, W, E, T, fp8 == 2)]
            all_cnt = [c for _, _, c, _ in oracle_dispatch_fp8(xs, topks, W, E, T, fp8 == 2)]
        else:
            ex, ec, es = [t.to(dev) for t in oracle_dispatch(xs, topks, W, E, T)[rank]]
            ok = torch.equal(cnt, ec) and all(
                torch.equal(recv[e, :c].view(torch.int16), ex[e, :c].view(torch.int16))
                and torch.equal(src[e, :c], es[e, :c]) for e, c in enumerate(ec.tolist()))
            all_recv = [a for a, _, _ in oracle_dispatch(xs, topks, W, E, T)]
            all_cnt = [c for _, c, _ in oracle_dispatch(xs, topks, W, E, T)]
        report(name, ok)
        outs_e = [expert_fn(all_recv[q], all_cnt[q], q) for q in range(W)]
        mine = expert_fn(recv.cpu(), cnt.cpu(), rank).to(dev)
        out = torch.full((x.shape[0], H), float("nan"), dtype=bf, device=dev)
        cw = None if carry else w
        if split:
            ep.combine_send(mine, idx, cw, state, out)()
        else:
            ep.combine(mine, idx, cw, state, out)
        torch.cuda.synchronize()
        ep.precheck()
        want = oracle_combine_hosts(outs_e, topks, weights, W, E, R, bf)[rank]
        report(f"call {i} combine", torch.equal(out.cpu().view(torch.int16),
                                                  want.view(torch.int16)))
        got_w = (ep.wire_ledger(0), ep.wire_ledger(1))
        want_w = wire_formula(topks, W, E, R, rank, row_bytes(H, 2, bool(fp8)), H, 2, K, carry)
        report(f"call {i} wire ledger", got_w == want_w, f"{got_w} (formula {want_w})")

    # a CUDA graph: one launch outside the capture first (module loading is not capturable)
    xs, topks, weights = make_case(W, E, T, H, K, 7, "random", bf)
    n = T
    sx = torch.zeros(n, H, dtype=bf, device=dev)
    sidx = torch.full((n, K), -1, dtype=torch.int64, device=dev)
    sw = torch.zeros(n, K, dtype=torch.float32, device=dev)
    recv = torch.zeros((L, W * T, H), dtype=bf, device=dev)
    out = torch.zeros(n, H, dtype=bf, device=dev)
    eo = torch.zeros_like(recv)

    def step():
        cnt_, src_, state_, _ = ep.dispatch(sx, sidx, recv, 0, 0, None, topk_weights=sw)
        eo.copy_(recv * 2)
        ep.combine(eo, sidx, None, state_, out)       # the weights came with the dispatch
        return cnt_
    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cnt = step()
    for seed in (8, 9):
        xs, topks, weights = make_case(W, E, T, H, K, seed, "random", bf)
        m = xs[rank].shape[0]
        sx.zero_()
        sidx.fill_(-1)
        sw.zero_()
        # every rank sends T rows slots; the ones past its count route nowhere
        sx[:m], sidx[:m], sw[:m] = xs[rank].to(dev), topks[rank].to(dev), weights[rank].to(dev)
        g.replay()
        torch.cuda.synchronize()
        ep.precheck()
        pad = [torch.cat([t, torch.full((T - t.shape[0], K), -1, dtype=t.dtype)]) for t in topks]
        padx = [torch.cat([t, torch.zeros(T - t.shape[0], H, dtype=bf)]) for t in xs]
        padw = [torch.cat([t, torch.zeros(T - t.shape[0], K)]) for t in weights]
        ex, ec, _ = oracle_dispatch(padx, pad, W, E, T)[rank]
        outs_e = [(a.float() * 2).to(bf) for a, _, _ in oracle_dispatch(padx, pad, W, E, T)]
        want = oracle_combine_hosts(outs_e, pad, padw, W, E, R, bf)[rank]
        report(f"graph replay seed {seed}", torch.equal(cnt.cpu(), ec) and
               torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)))

    # wait statistics: the last PE starts one dispatch late; the PEs that poll it directly
    # (its rail, its host) count the delay at its rank, the others nothing there
    xs, topks, _ = make_case(W, E, T, H, K, 13, "random", bf)
    stats = torch.zeros(W, dtype=torch.int64, device=dev)
    x, idx = xs[rank].to(dev), topks[rank].to(dev)
    ep.dispatch(x, idx, recv, 1, 0, None, wait_stats=stats)    # compiles and loads the variant
    torch.cuda.synchronize()
    stats.zero_()
    dist.barrier()
    if rank == W - 1:
        time.sleep(STATS_DELAY_S)
    ep.dispatch(x, idx, recv, 0, 0, None, wait_stats=stats)
    torch.cuda.synchronize()
    ep.precheck()
    if rank != W - 1:
        polls = rank % R == (W - 1) % R or rank // R == (W - 1) // R
        got = stats.tolist()
        ok = got[W - 1] > STATS_DELAY_S * 0.5e9 if polls else got[W - 1] == 0
        report("wait statistics", ok, f"{got} ns (polls the late PE: {polls})")
    _mask_checks(rank, W, R, dev, report)

    # a bounded wait: the last PE stays away from one dispatch
    dist.barrier()
    ep.timeout_us = SHORT_TIMEOUT_MS * 1000
    if rank != W - 1:
        xs, topks, _ = make_case(W, E, T, H, K, 10, "random", bf)
        t0 = time.monotonic()
        try:
            ep.dispatch(xs[rank].to(dev), topks[rank].to(dev), recv, 1, 0, None)
            torch.cuda.synchronize()
            ep.precheck()
            report("absent PE: CommTimeoutError", False, "returned normally")
        except CommTimeoutError as e:
            report("absent PE: CommTimeoutError", True,
                   f"after {time.monotonic() - t0:.1f} s: {str(e)[:80]}")
    dist.barrier()
    if progress:    # a PE still alive this long after its report shows where it is stuck
        faulthandler.dump_traceback_later(EXIT_WATCH_S, exit=False)
    return {"rank": rank, "lines": lines, "failed": fails}


def _mask_checks(rank, W, R, dev, report):
    """Rank masks on a second heap (module doc)."""
    import torch.distributed as dist

    from llcomm.ep.hosts.peer import HostsPeerEP
    from test_ep_hosts import oracle_combine_hosts
    from test_ep_hosts_masks_cpu import cut_topks, masked_dispatch_oracle
    from test_ep_oracle import expert_fn, make_case

    bf, L, last = torch.bfloat16, E // W, W - 1
    mep = HostsPeerEP(_buf(rank, W, R, False, masks=True), num_blocks=BLOCKS)
    xs, topks, weights = make_case(W, E, T, H, K, 11, "random", bf)
    x, idx, w = xs[rank].to(dev), topks[rank].to(dev), weights[rank].to(dev)
    recv = torch.full((L, W * T, H), float("nan"), dtype=bf, device=dev)
    out = torch.full((x.shape[0], H), float("nan"), dtype=bf, device=dev)
    M = [last]
    mep.set_mask(last, True)
    cnt, src, state, _ = mep.dispatch(x, idx, recv, 0)
    mine = expert_fn(recv.cpu(), cnt.cpu(), rank).to(dev)
    mep.combine(mine, idx, w, state, out)
    torch.cuda.synchronize()
    mep.precheck()
    if rank != last:
        (ex, ec, es), want_ntok = masked_dispatch_oracle(xs, topks, W, E, T, R, M, rank)
        ok = (cnt.cpu().tolist() == ec.tolist() and state[1].cpu().tolist() == want_ntok
              and all(torch.equal(recv[e, :c].cpu().view(torch.int16), ex[e, :c].view(torch.int16))
                      and torch.equal(src[e, :c].cpu(), es[e, :c])
                      for e, c in enumerate(ec.tolist())))
        report(f"masked by hand {M}: dispatch", ok)
        outs_e = [expert_fn(*masked_dispatch_oracle(xs, topks, W, E, T, R, M, q)[0][:2], q)
                  for q in range(W)]
        want = oracle_combine_hosts(outs_e, cut_topks(topks, W, E, R, M), weights, W, E, R,
                                    bf)[rank]
        report(f"masked by hand {M}: combine",
               torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)))
    # the mask cleared; the last PE stays away from one dispatch + combine
    mep.clean_mask()
    dist.barrier()
    mep.timeout_us = SHORT_TIMEOUT_MS * 1000
    if rank != last:
        xs, topks, weights = make_case(W, E, T, H, K, 12, "random", bf)
        x, idx, w = xs[rank].to(dev), topks[rank].to(dev), weights[rank].to(dev)
        cnt, src, state, _ = mep.dispatch(x, idx, recv, 1)
        mep.combine(recv, idx, w, state, out[:x.shape[0]])
        torch.cuda.synchronize()
        mep.precheck()
        mask = mep.query_mask().cpu().tolist()
        polls = rank % R == last % R or rank // R == last // R   # its rail, or its host
        want = [int(q == last and polls) for q in range(W)]
        ok = mask == want and int(mep.err[0]) == 0
        report("absent PE with masks: masked, no error", ok, f"mask {mask}, expected {want}")
    dist.barrier()


#: ``--remote``: the transports the tool can force between the PEs (module doc)
REMOTE = ("ibrc", "ibgda")


def remote_env(kind: str, hca: str, env=os.environ) -> dict[str, str]:
    """The NVSHMEM settings every PE gets with ``--remote kind`` over the port ``hca``."""
    out = {"NVSHMEM_DISABLE_P2P": "1", "NVSHMEM_REMOTE_TRANSPORT": "ibrc",
           "NVSHMEM_HCA_LIST": hca, "NVSHMEM_ENABLE_NIC_PE_MAPPING": "1", "NVSHMEM_INFO": "1"}
    if kind == "ibgda":
        out["NVSHMEM_IB_ENABLE_IBGDA"] = "1"
    if "NVSHMEM_DEBUG" not in env:
        out.update(NVSHMEM_DEBUG="INFO", NVSHMEM_DEBUG_SUBSYS="INIT,TRANSPORT")
    return out


def remote_preflight(a, ap) -> dict[str, str]:
    """``--remote``: refuse what cannot work, print the transport facts and what NVSHMEM
    should pick; the PEs' settings. Exits 2 where no RDMA port is active."""
    from llcomm.ep.hosts import transport
    if a.ranks_per_host != 1:
        ap.error(f"--remote {a.remote} needs --ranks-per-host 1, got {a.ranks_per_host}: with "
                 "P2P disabled NVSHMEM gives no peer addresses, so every PE must be its own "
                 "declared host")
    facts = transport.gather()
    print("\n".join(transport.report_lines(facts)))
    active = [p.name for p in facts.ports if p.active]
    if not active:
        print("shmem_check: no RDMA device: cannot force the remote transport (no active port "
              f"under /{transport.SYS_INFINIBAND})", file=sys.stderr)
        sys.exit(2)
    if a.hca and a.hca.partition(":")[0] not in {p.device for p in facts.ports}:
        ap.error(f"--hca {a.hca}: no such RDMA device here (active ports: {', '.join(active)})")
    env = remote_env(a.remote, a.hca or active[0])
    forced = dataclasses.replace(facts, settings=tuple({**dict(facts.settings), **env}.items()))
    print(f"# shmem_check --remote {a.remote}: " + " ".join(f"{k}={v}" for k, v in env.items()))
    print("# expected " + transport.verdict_line(transport.predict(forced), forced))
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pes", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--progress", action="store_true",
                    help="each PE also prints every check as it ends, with the seconds since "
                    "its start, to stderr")
    ap.add_argument("--exit", choices=("interpreter", "hard"), default="interpreter",
                    help="how a PE leaves once it reported: through the interpreter's "
                    "finalization (default), or at once with os._exit as llcomm.multiproc's "
                    "other callers do")
    ap.add_argument("--remote", choices=REMOTE,
                    help="force NVSHMEM's remote transport between the PEs (module doc)")
    ap.add_argument("--hca", help="with --remote: the RDMA port, NAME:PORT (default: the first "
                    "active one)")
    a = ap.parse_args(argv)
    if a.hca and not a.remote:
        ap.error("--hca goes with --remote")
    env = remote_preflight(a, ap) if a.remote else {}
    if a.progress:
        env = dict(env, **{PROGRESS_ENV: "1"})
    from llcomm.multiproc import run
    t0 = time.monotonic()
    results = run(_rank_body, a.pes, a.ranks_per_host, backend="gloo", timeout=600, env=env,
                  interpreter_exit=a.exit == "interpreter")
    failed = sum(r["failed"] for r in results)
    for r in results:
        print("\n".join(r["lines"]))
    checks = sum(len(r["lines"]) for r in results)
    print(f"# shmem_check: {a.pes} PEs as {a.pes // a.ranks_per_host} hosts of "
          f"{a.ranks_per_host}" + (f" over {a.remote}" if a.remote else "") + f": "
          f"{checks - failed} of {checks} checks ok in "
          f"{time.monotonic() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"pes": a.pes, "ranks_per_host": a.ranks_per_host, "remote": a.remote,
                       "env": env, "results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # not sys.exit: at exit multiprocessing joins its daemonic children without a bound, and a
    # PE that does not end would hold this process after its verdict is printed
    os._exit(rc)

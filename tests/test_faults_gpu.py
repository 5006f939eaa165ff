"""Never hang, never corrupt: faults on the peer backend (2 GPUs, NCCL group).

(a) a peer process killed in the middle of a loop of ops: the survivor raises CommTimeoutError
    within timeout + 1 s and exits cleanly; fresh processes can then use both GPUs;
(b) after a timeout every later call raises CommBrokenError at once; a new communicator works,
    and nothing the failed round left behind satisfies a later wait;
(c) ranks that disagree about the op, the size or the dtype of a round: every rank raises
    (CommMismatchError or CommTimeoutError, at least one mismatch; Lamport against Lamport:
    a mismatch on both), no rank returns a result;
(d) 200 Communicators and 200 EPBuffers created and destroyed: device memory and open file
    descriptors stay flat (the numbers are printed);
and the peer backend refuses bad input with the same exception and message as the reference.

Run on a 2-GPU host: ``python -m pytest tests/test_faults_gpu.py -m gpu -x -q -s`` (about 3 to 5
minutes, most of it in (d)).
"""
from __future__ import annotations

import gc
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

from _dist import run_distributed

pytestmark = pytest.mark.gpu

TIMEOUT_MS = 300
#: What a survivor may take beyond TIMEOUT_MS to raise (the brief: timeout + 1 s).
SLACK_S = 1.0
MAX_BYTES = 1 << 20
N = 4096  # elements per rank of the loop ops (bf16: 8 KiB)
KINDS = ("one_shot", "two_shot", "lamport", "broadcast", "all_gather", "all_gather_2d",
         "reduce_scatter")
EXIT_CODE = 17


def _comm(**kw):
    import llcomm
    return llcomm.Communicator(max_bytes=kw.pop("max_bytes", MAX_BYTES), backend="peer", **kw)


def _input(i: int, r: int, n: int = N, dtype=torch.bfloat16) -> torch.Tensor:
    """Rank r's operand of step i: any rank can rebuild any rank's (no collective needed, so the
    oracle still works after a peer died)."""
    g = torch.Generator(device="cuda")
    g.manual_seed(1_000_003 * i + r)
    return torch.randn(n, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _rank_sum(xs):
    acc = torch.zeros_like(xs[0], dtype=torch.float32)
    for x in xs:
        acc += x.float()
    return acc.to(xs[0].dtype)


def _launch(comm, kind: str, i: int, rank: int, ws: int, n: int = N):
    """Launch op ``kind`` of step i (no sync); returns (output, expected)."""
    xs = [_input(i, r, n) for r in range(ws)]
    x = xs[rank]
    if kind in ("one_shot", "two_shot", "lamport"):
        out = torch.full_like(x, float("nan"))
        return comm.all_reduce(x, out=out, algo=kind), _rank_sum(xs)
    if kind == "broadcast":
        src = i % ws
        y = x.clone() if rank == src else torch.full_like(x, float("nan"))
        return comm.broadcast(y, src), xs[src]
    if kind == "all_gather":
        return comm.all_gather(x), torch.cat(xs)
    if kind == "all_gather_2d":
        rows = 16
        return (comm.all_gather_2d(x.view(rows, -1)),
                torch.cat([t.view(rows, -1) for t in xs], 1))
    return comm.reduce_scatter(x), _rank_sum(xs).view(ws, -1)[rank]


# -- (a) a peer killed mid-loop -----------------------------------------------------------------
LOOP = 140
DIE_AT = 77


def _killed_body(rank, ws, how):
    import llcomm
    comm = _comm(timeout_ms=TIMEOUT_MS)
    victim = 1
    done = 0
    err = None
    for i in range(LOOP):
        kind = KINDS[i % len(KINDS)]
        if rank == victim and i == DIE_AT:
            _launch(comm, kind, i, rank, ws)  # dies with its kernel queued, maybe half done
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(EXIT_CODE)
        t0 = time.monotonic()
        try:
            got, want = _launch(comm, kind, i, rank, ws)
            comm.check()
        except llcomm.CommTimeoutError as e:
            err, elapsed = e, time.monotonic() - t0
            break
        # every result before the fault is right (the victim's last op may complete too)
        assert torch.equal(_bits(got), _bits(want)), (rank, kind, i)
        done += 1
    if rank == victim:
        raise AssertionError("the victim should have died")
    assert err is not None, "the survivor ran every op although its peer died"
    assert DIE_AT - 1 <= done <= DIE_AT + 1, done
    assert elapsed < TIMEOUT_MS / 1000 + SLACK_S, elapsed
    assert err.ranks == (victim,), err
    t0 = time.monotonic()
    with pytest.raises(llcomm.CommBrokenError, match="destroy it and create a new one"):
        _launch(comm, "one_shot", LOOP, rank, ws)
    assert time.monotonic() - t0 < 0.1
    # no comm.close(): it is a collective and the peer is gone; the process exit frees it
    return done, round(elapsed, 3), str(err)


def _fresh_body(rank, ws):
    comm = _comm()
    for i, kind in enumerate(KINDS):
        got, want = _launch(comm, kind, 10_000 + i, rank, ws)
        comm.check()
        assert torch.equal(_bits(got), _bits(want)), kind
    comm.close()


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_killed_peer(how):
    code = -signal.SIGKILL if how == "sigkill" else EXIT_CODE
    got = run_distributed(_killed_body, 2, how, backend="nccl", expect_exit={1: code},
                          timeout=300)
    done, elapsed, msg = got[0]
    print(f"\n[{how}] survivor: {done} ops right, then CommTimeoutError after {elapsed}s: {msg}")
    # both GPUs are usable by new processes
    run_distributed(_fresh_body, 2, backend="nccl", timeout=300)


# -- (b) broken after a timeout, a new communicator works ----------------------------------------
def _broken_then_new_body(rank, ws, algo):
    import llcomm
    a = _comm(timeout_ms=TIMEOUT_MS)
    for i in range(50):  # epochs well past 1, so a stale flag would look like "a later epoch"
        _launch(a, KINDS[i % len(KINDS)], i, rank, ws)
    a.check()
    dist.barrier()
    if rank == 0:
        _launch(a, algo, 50, rank, ws)
        with pytest.raises(llcomm.CommTimeoutError):
            a.check()
        t0 = time.monotonic()
        for kind in KINDS:
            with pytest.raises(llcomm.CommBrokenError,
                               match=r"failed earlier.*destroy it and create a new one"):
                _launch(a, kind, 51, rank, ws)
        with pytest.raises(llcomm.CommBrokenError):
            a.check()
        broken_s = time.monotonic() - t0
        assert broken_s < 0.2, broken_s  # at once: no wait, no launch
    torch.cuda.synchronize()
    dist.barrier()
    a.close()
    # A new communicator of the same size (the allocator may hand back the same memory). Rank 1
    # comes late to every op; rank 0's waits must hold until rank 1's data is there.
    b = _comm(timeout_ms=5000)
    for i, kind in enumerate(KINDS * 3):
        dist.barrier()
        if rank == 1:
            time.sleep(0.05)
        got, want = _launch(b, kind, 100 + i, rank, ws)
        b.check()
        assert torch.equal(_bits(got), _bits(want)), (kind, i)
    b.close()
    return None


@pytest.mark.parametrize("algo", ["one_shot", "two_shot", "lamport", "broadcast"])
def test_broken_then_new_communicator(algo):
    run_distributed(_broken_then_new_body, 2, algo, backend="nccl", timeout=300)


# -- (c) mismatched calls ---------------------------------------------------------------------
def _call(comm, spec):
    """spec = (kind, numel or shape, dtype name); launches it with a fresh operand. An ``ll_``
    kind is the op itself on a communicator made with the LL kernels on, ``lamport_`` with the
    Lamport reduce_scatter on."""
    kind, n, dt = spec
    kind = kind.removeprefix("ll_").removeprefix("lamport_")
    x = torch.randn(n, device="cuda").to(getattr(torch, dt))
    if kind in ("one_shot", "two_shot", "lamport"):
        return comm.all_reduce(x, algo=kind)
    if kind == "fused_lamport":  # x: [tokens, hidden]
        w = torch.ones(x.shape[1], device="cuda", dtype=x.dtype)
        return comm.all_reduce_residual_rmsnorm(x, torch.zeros_like(x), w, algo="lamport")
    if kind == "broadcast":
        return comm.broadcast(x, 0)
    if kind == "all_gather":
        return comm.all_gather(x)
    if kind == "all_gather_2d":
        return comm.all_gather_2d(x.view(8, -1))
    return comm.reduce_scatter(x)


def _mismatch_round(rank, name):
    """One round in which rank r calls ``MISMATCHES[name][r]``, on a fresh communicator; what it
    raised. Cases named ``ll_...`` run with the LL movement kernels (the default up to 64 KiB),
    the others with them off, so the flagged movement kernels meet each other; likewise the
    Lamport reduce_scatter runs only where a spec says ``lamport_reduce_scatter``."""
    import llcomm
    specs = MISMATCHES[name]
    comm = _comm(timeout_ms=TIMEOUT_MS)
    if not name.startswith("ll_"):
        comm._impl.ll_bytes = 0             # the flagged movement kernels at every size
    if not any(kind == "lamport_reduce_scatter" for kind, _, _ in specs):
        comm._impl.rs_lamport_bytes = 0     # the flag reduce_scatter at every size
    # good rounds of both calls first: a kernel's first launch waits up to 60 s for a peer that
    # may still be compiling (llcomm/runtime/launch.py), which would outlast the test's timeout
    for spec in specs:
        _call(comm, spec)
    comm.check()
    dist.barrier()
    try:
        _call(comm, specs[rank])
        comm.check()
    except (llcomm.CommMismatchError, llcomm.CommTimeoutError) as e:
        outcome = type(e).__name__
    else:
        outcome = "returned a result"
    torch.cuda.synchronize()
    dist.barrier()
    comm.close()
    return outcome


def _mismatch_cases_body(rank, ws, names):
    """Every named case in one process pair (a pair costs ~15 s to start on the GPU host)."""
    return {name: _mismatch_round(rank, name) for name in names}


BF, F16, F32 = "bfloat16", "float16", "float32"
MISMATCHES = {
    # different ops in the same round
    "one_shot-vs-broadcast": (("one_shot", 4096, BF), ("broadcast", 4096, BF)),
    "one_shot-vs-two_shot": (("one_shot", 4096, BF), ("two_shot", 4096, BF)),
    "all_gather-vs-reduce_scatter": (("all_gather", 4096, BF), ("reduce_scatter", 4096, BF)),
    "all_gather-vs-all_gather_2d": (("all_gather", 4096, BF), ("all_gather_2d", 4096, BF)),
    "lamport-vs-one_shot": (("lamport", 4096, BF), ("one_shot", 4096, BF)),
    # same op, different sizes
    "one_shot-sizes": (("one_shot", 4096, BF), ("one_shot", 8192, BF)),
    "two_shot-sizes": (("two_shot", 4096, BF), ("two_shot", 4104, BF)),
    "broadcast-sizes": (("broadcast", 4096, BF), ("broadcast", 2048, BF)),
    "all_gather-sizes": (("all_gather", 4096, BF), ("all_gather", 4097, BF)),
    "all_gather_2d-rows": (("all_gather_2d", 4096, BF), ("all_gather_2d", 4096 + 8, BF)),
    "reduce_scatter-sizes": (("reduce_scatter", 4096, BF), ("reduce_scatter", 8192, BF)),
    "lamport-sizes": (("lamport", 4096, BF), ("lamport", 8192, BF)),
    "lamport-vs-fused": (("lamport", 4096, BF), ("fused_lamport", (8, 512), BF)),
    "fused_lamport-rows": (("fused_lamport", (8, 512), BF), ("fused_lamport", (16, 256), BF)),
    # same op and size, different dtypes
    "one_shot-dtypes": (("one_shot", 4096, BF), ("one_shot", 4096, F16)),
    "two_shot-dtypes": (("two_shot", 4096, F16), ("two_shot", 4096, F32)),
    "reduce_scatter-dtypes": (("reduce_scatter", 4096, BF), ("reduce_scatter", 4096, F32)),
    "lamport-dtypes": (("lamport", 4096, BF), ("lamport", 4096, F16)),
    "lamport-dtype-widths": (("lamport", 4096, BF), ("lamport", 4096, F32)),
    # the LL movement kernels (kernels/ll.py) share the Lamport tag words
    "ll_broadcast-vs-ll_all_gather": (("ll_broadcast", 4096, BF), ("ll_all_gather", 4096, BF)),
    "ll_broadcast-sizes": (("ll_broadcast", 4096, BF), ("ll_broadcast", 2048, BF)),
    "ll_all_gather-vs-ll_all_gather_2d": (("ll_all_gather", 4096, BF),
                                          ("ll_all_gather_2d", 4096, BF)),
    "ll_all_gather-dtypes": (("ll_all_gather", 4096, BF), ("ll_all_gather", 2048, F32)),
    "ll_all_gather-vs-lamport": (("ll_all_gather", 4096, BF), ("lamport", 4096, BF)),
    "ll_broadcast-vs-one_shot": (("ll_broadcast", 4096, BF), ("one_shot", 4096, BF)),
    # the Lamport reduce_scatter shares the Lamport tag words
    "lamport_reduce_scatter-sizes": (("lamport_reduce_scatter", 4096, BF),
                                     ("lamport_reduce_scatter", 8192, BF)),
    "lamport_reduce_scatter-dtypes": (("lamport_reduce_scatter", 4096, BF),
                                      ("lamport_reduce_scatter", 4096, F32)),
    "lamport_reduce_scatter-vs-lamport": (("lamport_reduce_scatter", 4096, BF),
                                          ("lamport", 2048, BF)),
}
#: Pairs where neither side carries a flag the other can compare: both time out, no mismatch.
TIMEOUT_ONLY = {"lamport-vs-one_shot", "ll_broadcast-vs-one_shot"}
#: Lamport-tagged against Lamport-tagged (Lamport, fused Lamport, LL): every block of either
#: side writes its tag to the other, so both ranks see the other's tag and both report the
#: mismatch (no timeout on either side).
BOTH_MISMATCH = {"lamport-sizes", "lamport-vs-fused", "fused_lamport-rows", "lamport-dtypes",
                 "lamport-dtype-widths", "ll_broadcast-vs-ll_all_gather", "ll_broadcast-sizes",
                 "ll_all_gather-vs-ll_all_gather_2d", "ll_all_gather-dtypes",
                 "ll_all_gather-vs-lamport", "lamport_reduce_scatter-sizes",
                 "lamport_reduce_scatter-dtypes", "lamport_reduce_scatter-vs-lamport"}


def _outcome_problem(name, outcomes):
    if "returned a result" in outcomes:
        return f"{name}: a rank returned a result {outcomes}"
    if name in BOTH_MISMATCH and outcomes != ["CommMismatchError"] * 2:
        return f"{name}: expected a mismatch on both ranks {outcomes}"
    if name not in TIMEOUT_ONLY and "CommMismatchError" not in outcomes:
        return f"{name}: no rank saw a mismatch {outcomes}"
    return None


def test_mismatch_raises_on_every_rank():
    names = list(MISMATCHES)
    per_rank = run_distributed(_mismatch_cases_body, 2, names, backend="nccl", timeout=300)
    problems = []
    for name in names:
        outcomes = [r[name] for r in per_rank]
        print(f"\n{name}: {outcomes}")
        problems.append(_outcome_problem(name, outcomes))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


# -- (d) resources ----------------------------------------------------------------------------
CYCLES = 200
WARM = 5


def _live_cuda_tensors() -> dict:
    """Python-visible CUDA tensors by (shape, dtype): says whether growth is ours or torch's."""
    seen = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.is_cuda:
            key = f"{tuple(o.shape)}:{o.dtype}"
            seen[key] = seen.get(key, 0) + 1
    return seen


def _usage():
    gc.collect()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"used_mib": (total - free) / 2**20,
            "allocated_mib": torch.cuda.memory_allocated() / 2**20,
            "fds": len(os.listdir("/proc/self/fd")),
            "live_tensors": _live_cuda_tensors()}


def _resources_body(rank, ws, what):
    import llcomm.ep as ep
    seen = []
    for i in range(CYCLES + WARM):
        if i == WARM:
            start = _usage()
        if what == "communicator":
            c = _comm(max_bytes=64 << 10)
            got, want = _launch(c, "one_shot" if i % 2 else "lamport", i, rank, ws, n=1024)
            c.check()
            assert torch.equal(_bits(got), _bits(want))
        else:
            c = ep.EPBuffer(num_experts=8, hidden=256, num_max_dispatch_tokens_per_rank=8,
                            backend="peer")
            x = torch.ones(4, 256, dtype=torch.bfloat16, device="cuda")
            idx = torch.tensor([[0, 7], [1, 2], [3, 4], [5, 6]], device="cuda")
            rx, rc, h = c.dispatch(x, idx)
            c.combine(rx, idx, torch.ones(4, 2, device="cuda"), h)
            c.check()
        c.close()
        del c
        if i in (WARM + CYCLES // 2, WARM + CYCLES - 1):
            seen.append(_usage())
    end = _usage()
    return start, seen, end


#: Growth allowed over CYCLES create/destroy cycles: allocator slack, not a per-cycle leak (a
#: 64 KiB-max_bytes workspace maps at least 2 MiB, so leaking one per cycle would be >= 400 MiB).
MAX_USED_GROWTH_MIB = 64
MAX_ALLOCATED_GROWTH_MIB = 8
MAX_FD_GROWTH = 16


@pytest.mark.parametrize("what", ["communicator", "epbuffer"])
def test_create_destroy_does_not_leak(what):
    got = run_distributed(_resources_body, 2, what, backend="nccl", timeout=600)
    for rank, (start, seen, end) in enumerate(got):
        tensors = [u.pop("live_tensors") for u in (start, *seen, end)]
        grown = {k: (tensors[0].get(k, 0), n) for k, n in tensors[-1].items()
                 if n > tensors[0].get(k, 0)}
        print(f"\n[{what}] rank {rank}: after {WARM} warm-up cycles {start}; "
              f"midway {seen[0]}; after {CYCLES} more {end}; live CUDA tensors that grew "
              f"(start, end): {grown or 'none'}")
        assert end["used_mib"] - start["used_mib"] <= MAX_USED_GROWTH_MIB, (start, end)
        assert end["allocated_mib"] - start["allocated_mib"] <= MAX_ALLOCATED_GROWTH_MIB
        assert end["fds"] - start["fds"] <= MAX_FD_GROWTH, (start, end)


# -- bad input: the peer backend refuses exactly like the reference -----------------------------
def _same_refusals_body(rank, ws):
    import llcomm
    from test_validation import CASES, CASES_MAX_BYTES, CASES_MULTI_RANK, SMALL_MAX_BYTES
    pairs = [(_comm(), llcomm.Communicator(backend="reference"), CASES + CASES_MULTI_RANK),
             (_comm(max_bytes=SMALL_MAX_BYTES),
              llcomm.Communicator(backend="reference", max_bytes=SMALL_MAX_BYTES),
              CASES_MAX_BYTES)]
    diffs = []
    with torch.device("cuda"):  # the cases' tensors are made on this rank's GPU
        for peer, ref, cases in pairs:
            assert peer.backend == "peer" and ref.backend == "reference"
            for name, call, exc, pattern in cases:
                seen = []
                for comm in (peer, ref):
                    try:
                        call(comm, ws)
                        seen.append(("no error", ""))
                    except Exception as e:  # noqa: BLE001  (both backends' errors compared)
                        seen.append((type(e).__name__, str(e)))
                if seen[0] != seen[1] or seen[0][0] != exc.__name__ or \
                        not re.search(pattern.replace("expected cpu", "expected cuda"), seen[0][1]):
                    diffs.append(f"{name}: peer {seen[0]}, reference {seen[1]}")
    peer.check()
    return diffs


def test_peer_refuses_like_reference():
    diffs = [d for r in run_distributed(_same_refusals_body, 2, backend="nccl") for d in r]
    assert not diffs, "\n".join(diffs)

"""Faults on the reference backend (gloo, CPU): a peer process that dies in the middle of a loop,
or one that stays alive but never arrives, must make the other ranks raise ``CommTimeoutError``
naming the op within the timeout plus a little, never hang; every later call of the same object
raises ``CommBrokenError`` at once. Results before the fault are checked exactly (small-integer
payloads), so a fault can never pass as a wrong answer. The GPU counterparts are in
tests/test_faults_gpu.py."""
from __future__ import annotations

import os
import time

import pytest
import torch

from _dist import run_distributed

#: Bound of every wait in these tests (ms), and what a survivor may take beyond it (s): process
#: scheduling on a loaded CI runner, not llcomm.
TIMEOUT_MS = 300
SLACK_S = 2.0
#: The victim leaves before op DIE_AT of LOOP_OPS; exit code it leaves with.
LOOP_OPS = 60
DIE_AT = 25
EXIT_CODE = 17
#: The longest a straggler stays alive without calling, waiting for the others to have raised
#: (far past TIMEOUT_MS + SLACK_S: a wait that is not bounded by timeout_ms cannot end in time).
STRAGGLE_MAX_S = 20.0

OPS = ("all_reduce", "broadcast", "all_gather", "all_gather_2d", "reduce_scatter")


def _payload(rank: int, i: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + 1000.0 * rank + i


def _run_tp_op(comm, op: str, rank: int, ws: int, i: int) -> None:
    """Op ``op`` of loop step i, checked exactly against what every rank sent."""
    n = 8 * ws
    x = _payload(rank, i, n)
    every = [_payload(r, i, n) for r in range(ws)]
    if op == "all_reduce":
        got, want = comm.all_reduce(x), sum(every)
    elif op == "broadcast":
        src = i % ws
        got = x.clone() if rank == src else torch.full_like(x, float("nan"))
        comm.broadcast(got, src)
        want = every[src]
    elif op == "all_gather":
        got, want = comm.all_gather(x), torch.cat(every)
    elif op == "all_gather_2d":
        got = comm.all_gather_2d(x.view(ws, 8))
        want = torch.cat([e.view(ws, 8) for e in every], 1)
    else:
        got, want = comm.reduce_scatter(x), sum(every).view(ws, -1)[rank]
    assert torch.equal(got, want), f"rank {rank}: {op} at step {i} is wrong"


def _tp_dies_body(rank, ws, victim, how, released=None):
    """``how="exit"``: the victim's process leaves. ``"sleep"``: it stays alive without calling
    until ``released`` (an Event) is set by the others once they have raised, or STRAGGLE_MAX_S
    has passed, then returns whether it was released."""
    import llcomm
    comm = llcomm.Communicator(backend="reference", timeout_ms=TIMEOUT_MS)
    for i in range(LOOP_OPS):
        op = OPS[i % len(OPS)]
        if rank == victim and i == DIE_AT:
            if how == "exit":
                os._exit(EXIT_CODE)
            return released.wait(STRAGGLE_MAX_S)    # alive, but never makes this call
        t0 = time.monotonic()
        try:
            _run_tp_op(comm, op, rank, ws, i)
        except llcomm.CommTimeoutError as caught:
            err, elapsed = caught, time.monotonic() - t0
            if released is not None:
                released.set()
            break
    else:
        raise AssertionError(f"rank {rank}: {LOOP_OPS} ops ran although rank {victim} left")
    assert i >= DIE_AT - 1, f"rank {rank}: failed at step {i}, before the victim left"
    assert elapsed < TIMEOUT_MS / 1000 + SLACK_S, elapsed
    assert err.op == op and op in str(err) and "destroy it" in str(err), err
    # broken for good: at once, with the recovery hint, without touching the group
    t0 = time.monotonic()
    for later in OPS:
        with pytest.raises(llcomm.CommBrokenError, match="failed earlier.*create a new one"):
            _run_tp_op(comm, later, rank, ws, i + 1)
    with pytest.raises(llcomm.CommBrokenError):
        comm.check()
    assert time.monotonic() - t0 < 0.5
    return op, i, elapsed, str(err)


@pytest.mark.parametrize("ws,victim", [(2, 1), (2, 0), (3, 2)], ids=["w2-last", "w2-first", "w3"])
def test_killed_peer_raises_timeout(ws, victim):
    t0 = time.monotonic()
    got = run_distributed(_tp_dies_body, ws, victim, "exit", expect_exit={victim: EXIT_CODE},
                          timeout=60)
    assert got[victim] is None
    for r, res in enumerate(got):
        if r != victim:
            op, step, elapsed, _ = res
            print(f"rank {r}: {op} at step {step} raised CommTimeoutError after {elapsed:.3f}s")
    assert time.monotonic() - t0 < 45


def test_straggler_raises_timeout():
    """Rank 1 stays alive but does not make a call: rank 0 gives up after timeout_ms (not later,
    not when rank 1 leaves: rank 1 is still there, waiting, when rank 0 raises)."""
    import torch.multiprocessing as mp
    released = mp.get_context("spawn").Event()
    got = run_distributed(_tp_dies_body, 2, 1, "sleep", released, timeout=60)
    op, step, elapsed, msg = got[0]
    assert got[1] is True, "the straggler was not released: rank 0 did not raise while it waited"
    assert step == DIE_AT, step
    assert TIMEOUT_MS / 1000 * 0.9 <= elapsed < TIMEOUT_MS / 1000 + SLACK_S, elapsed
    assert f"{op} (reference backend, gloo)" in msg and "timeout_ms=300" in msg, msg


E, T, H, K = 8, 4, 16, 2


def _ep_dies_body(rank, ws, victim):
    import llcomm
    import llcomm.ep as ep
    from test_ep_oracle import expert_fn, make_case
    buf = ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                      backend="reference", timeout_ms=TIMEOUT_MS)
    failed = None
    for i in range(LOOP_OPS // 2):
        xs, topks, weights = make_case(ws, E, T, H, K, 100 + i, "random")
        if rank == victim and i == DIE_AT // 2:
            os._exit(EXIT_CODE)
        t0 = time.monotonic()
        try:
            rx, rc, handle = buf.dispatch(xs[rank], topks[rank])
            y = buf.combine(expert_fn(rx, rc, rank), topks[rank], weights[rank], handle)
            assert y.shape == (xs[rank].shape[0], H)
        except llcomm.CommTimeoutError as e:
            failed = (e, i, time.monotonic() - t0)
            break
    assert failed is not None, f"rank {rank}: the loop ran although rank {victim} left"
    e, i, elapsed = failed
    assert i >= DIE_AT // 2 - 1 and elapsed < TIMEOUT_MS / 1000 + SLACK_S, (i, elapsed)
    assert e.op in ("dispatch", "combine") and "EPBuffer is now broken" in str(e), e
    xs, topks, _ = make_case(ws, E, T, H, K, 1, "random")
    with pytest.raises(llcomm.CommBrokenError, match="EPBuffer failed earlier"):
        buf.dispatch(xs[rank], topks[rank])
    with pytest.raises(llcomm.CommBrokenError):
        buf.check()
    return e.op, i, elapsed


def test_ep_killed_peer_raises_timeout():
    got = run_distributed(_ep_dies_body, 2, 1, expect_exit={1: EXIT_CODE}, timeout=60)
    op, step, elapsed = got[0]
    print(f"rank 0: {op} at step {step} raised CommTimeoutError after {elapsed:.3f}s")


# -- the spawn helper's support for a rank that is meant to die -------------------------------
def _dies_unplanned(rank, ws):
    if rank == 1:
        os._exit(3)
    return rank


def test_expect_exit_wrong_code_still_fails():
    from _dist import RankFailed
    with pytest.raises(RankFailed, match=r"rank 1 died with exit code 3.*expected exit code 4"):
        run_distributed(_dies_unplanned, 2, expect_exit={1: 4}, timeout=60)


def test_expect_exit_rank_that_survives_fails():
    from _dist import RankFailed
    with pytest.raises(RankFailed, match="rank 0 was expected to die"):
        run_distributed(_dies_unplanned, 2, expect_exit={0: 3}, timeout=60)


# -- the spawn helper's retry when the process group does not form ---------------------------
def _count_runs(rank, ws, path):
    with open(path, "a") as f:
        f.write(f"{rank}\n")
    raise RuntimeError("fn itself failed")


def test_group_that_never_forms_is_retried_then_reported(monkeypatch):
    import _dist
    runs = []
    once = _dist._run_once

    def counted(*args, **kwargs):
        runs.append(1)
        return once(*args, **kwargs)

    monkeypatch.setattr(_dist, "_run_once", counted)
    monkeypatch.setattr(_dist, "FAILURE_GRACE_S", 1.0)
    with pytest.raises(_dist.RankFailed, match="the process group did not form") as info:
        run_distributed(_count_runs, 2, "unused", backend="no-such-backend", timeout=60)
    assert "no-such-backend" in str(info.value)
    assert len(runs) == _dist.INIT_ATTEMPTS


def test_failure_inside_fn_is_not_retried(tmp_path):
    import _dist
    path = tmp_path / "runs.txt"
    with pytest.raises(_dist.RankFailed, match="fn itself failed") as info:
        run_distributed(_count_runs, 2, str(path), timeout=60)
    assert "did not form" not in str(info.value)
    assert sorted(path.read_text().split()) == ["0", "1"]     # one run, not INIT_ATTEMPTS


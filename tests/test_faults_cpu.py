"""Faults on the reference backend (gloo, CPU): a peer process that dies in the middle of a loop,
or one that stays alive but never arrives, must make the other ranks raise ``CommTimeoutError``
naming the op and the bound it waited for, never hang; every later call of the same object
raises ``CommBrokenError`` without issuing a collective. Results before the fault are checked
exactly (small-integer payloads), so a fault can never pass as a wrong answer. No test reads a
clock: that every wait is handed ``timeout_ms`` is checked on a collective that never completes
(``test_every_wait_is_handed_timeout_ms``), and a run that hangs is ended by the spawn helper's
timeout. The GPU counterparts are in tests/test_faults_gpu.py."""
from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from _dist import run_distributed

#: Bound of every wait in these tests (ms).
TIMEOUT_MS = 300
#: The victim leaves before op DIE_AT of LOOP_OPS; exit code it leaves with.
LOOP_OPS = 60
DIE_AT = 25
EXIT_CODE = 17
#: The longest a straggler stays alive without calling, waiting for the others to have raised
#: (far past TIMEOUT_MS: a wait that is not bounded by timeout_ms does not end while it waits).
STRAGGLE_MAX_S = 20.0

OPS = ("all_reduce", "broadcast", "all_gather", "all_gather_2d", "reduce_scatter")
#: torch.distributed's calls that move data; a broken object must make none of them.
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "reduce_scatter_tensor", "all_to_all_single", "barrier", "send", "recv", "isend",
               "irecv")


class _refuse_collectives:
    """Within the block, every call in COLLECTIVES raises (and is counted in ``issued``)."""

    def __enter__(self):
        self.issued, self._saved = [], {n: getattr(dist, n) for n in COLLECTIVES
                                        if hasattr(dist, n)}

        def refuse(name):
            def call(*args, **kwargs):
                self.issued.append(name)
                raise AssertionError(f"torch.distributed.{name} called by a broken object")
            return call
        for name in self._saved:
            setattr(dist, name, refuse(name))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _timed_out(err, op: str) -> bool:
    """A CommTimeoutError of the reference backend's bounded wait for ``op``, naming the bound."""
    return (err.op, err.phase) == (op, "collective") and op in str(err) \
        and f"timeout_ms={TIMEOUT_MS}" in str(err) and "destroy it" in str(err)


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
        try:
            _run_tp_op(comm, op, rank, ws, i)
        except llcomm.CommTimeoutError as caught:
            err = caught
            if released is not None:
                released.set()
            break
    else:
        raise AssertionError(f"rank {rank}: {LOOP_OPS} ops ran although rank {victim} left")
    assert i >= DIE_AT - 1, f"rank {rank}: failed at step {i}, before the victim left"
    assert _timed_out(err, op), err
    # broken for good: with the recovery hint, without touching the group
    with _refuse_collectives() as group:
        for later in OPS:
            with pytest.raises(llcomm.CommBrokenError, match="failed earlier.*create a new one"):
                _run_tp_op(comm, later, rank, ws, i + 1)
        with pytest.raises(llcomm.CommBrokenError):
            comm.check()
    assert not group.issued, group.issued
    return op, i, str(err)


@pytest.mark.parametrize("ws,victim", [(2, 1), (2, 0), (3, 2)], ids=["w2-last", "w2-first", "w3"])
def test_killed_peer_raises_timeout(ws, victim):
    got = run_distributed(_tp_dies_body, ws, victim, "exit", expect_exit={victim: EXIT_CODE},
                          timeout=60)
    assert got[victim] is None
    for r, res in enumerate(got):
        if r != victim:
            op, step, _ = res
            print(f"rank {r}: {op} at step {step} raised CommTimeoutError")


def test_straggler_raises_timeout():
    """Rank 1 stays alive but does not make a call: rank 0 gives up on its bound, not when rank
    1 leaves (rank 1 is still there, waiting to be released, when rank 0 raises)."""
    import torch.multiprocessing as mp
    released = mp.get_context("spawn").Event()
    got = run_distributed(_tp_dies_body, 2, 1, "sleep", released, timeout=60)
    op, step, msg = got[0]
    assert got[1] is True, "the straggler was not released: rank 0 did not raise while it waited"
    assert step == DIE_AT, step
    assert f"{op} (reference backend, gloo)" in msg and f"timeout_ms={TIMEOUT_MS}" in msg, msg


class _NeverDone:
    """A collective that never completes: ``wait`` records the bound it is handed and fails as
    gloo's wait does when that bound runs out."""

    def __init__(self):
        self.bounds = []

    def wait(self, timeout=None):
        self.bounds.append(timeout)
        raise RuntimeError("Operation timed out!")


def test_every_wait_is_handed_timeout_ms():
    """The reference backend's wait is gloo's, bounded by what it is handed: timeout_ms, on every
    call (run, and start's split-phase wait); a wait that runs out is CommTimeoutError naming the
    op and the bound, and later calls raise CommBrokenError without issuing anything."""
    import llcomm
    from llcomm.runtime.bounded import BoundedCalls
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        bound = datetime.timedelta(milliseconds=TIMEOUT_MS)
        for how in ("run", "start"):
            calls = BoundedCalls(dist.group.WORLD, TIMEOUT_MS, "communicator",
                                 device=torch.device("cpu"), checked=False)
            work, issued = _NeverDone(), []
            with pytest.raises(llcomm.CommTimeoutError) as info:
                if how == "run":
                    calls.run("all_reduce", lambda async_op: issued.append(async_op) or work)
                else:
                    calls.start("all_reduce", lambda async_op: issued.append(async_op) or work)()
            assert issued == [True] and work.bounds == [bound], (how, issued, work.bounds)
            assert _timed_out(info.value, "all_reduce"), info.value
            with pytest.raises(llcomm.CommBrokenError, match="failed earlier"):
                calls.run("broadcast", lambda async_op: issued.append(async_op) or work)
            assert issued == [True], "a broken object issued a collective"
    finally:
        dist.destroy_process_group()


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
        try:
            rx, rc, handle = buf.dispatch(xs[rank], topks[rank])
            y = buf.combine(expert_fn(rx, rc, rank), topks[rank], weights[rank], handle)
            assert y.shape == (xs[rank].shape[0], H)
        except llcomm.CommTimeoutError as e:
            failed = (e, i)
            break
    assert failed is not None, f"rank {rank}: the loop ran although rank {victim} left"
    e, i = failed
    assert i >= DIE_AT // 2 - 1, f"rank {rank}: failed at step {i}, before the victim left"
    assert e.op in ("dispatch", "combine") and _timed_out(e, e.op), e
    assert "EPBuffer is now broken" in str(e), e
    xs, topks, _ = make_case(ws, E, T, H, K, 1, "random")
    with _refuse_collectives() as group:
        with pytest.raises(llcomm.CommBrokenError, match="EPBuffer failed earlier"):
            buf.dispatch(xs[rank], topks[rank])
        with pytest.raises(llcomm.CommBrokenError):
            buf.check()
    assert not group.issued, group.issued
    return e.op, i


def test_ep_killed_peer_raises_timeout():
    got = run_distributed(_ep_dies_body, 2, 1, expect_exit={1: EXIT_CODE}, timeout=60)
    op, step = got[0]
    print(f"rank 0: {op} at step {step} raised CommTimeoutError")


# -- mismatched calls: CommMismatchError on every rank, no process aborts ---------------------
#: A mismatch is caught by the call check, never by waiting out the bound: the error's phase is
#: "call check" (a wait that ran out is CommTimeoutError, phase "collective").
MISMATCH_TIMEOUT_MS = 10_000
MT, MH = 4, 128     # EP cases: tokens per rank, hidden (FP8 wants 128); 4 experts per rank

#: case -> what must appear in every rank's message: each side's call, as the check prints it
MISMATCH_CASES = {
    "all_reduce-size": ("all_reduce(numel=8, dtype=float32)",
                        "all_reduce(numel=16, dtype=float32)"),
    "all_reduce-dtype": ("all_reduce(numel=8, dtype=float32)",
                         "all_reduce(numel=8, dtype=bfloat16)"),
    "all_reduce-vs-all_gather": ("all_reduce(numel=8, dtype=float32)",
                                 "all_gather(numel=8, dtype=float32)"),
    "broadcast-src": ("broadcast(numel=8, src=0, dtype=float32)",
                      "broadcast(numel=8, src=1, dtype=float32)"),
    "all_gather_2d-shape": ("all_gather_2d(tokens=2, part=8, dtype=float32)",
                            "all_gather_2d(tokens=4, part=4, dtype=float32)"),
    "dispatch-topk": ("dispatch(topk=2, fp8=0,", "dispatch(topk=3, fp8=0,"),
    "dispatch-fp8": ("dispatch(topk=2, fp8=0,", "dispatch(topk=2, fp8=1,"),
    "dispatch-vs-combine": ("dispatch(topk=2,", "combine(topk=2,"),
    "dispatch-hidden": ("hidden=128,", "hidden=256,"),
}


def _matched_tp(comm, rank, ws):
    """One matched call, checked exactly: the check lets it through and the sum is right."""
    x = torch.arange(8, dtype=torch.float32) + 100.0 * rank
    want = sum(torch.arange(8, dtype=torch.float32) + 100.0 * r for r in range(ws))
    assert torch.equal(comm.all_reduce(x), want), f"rank {rank}: matched all_reduce is wrong"


def _mismatched(case, rank, ws, odd):
    """Objects for ``case`` and the call this rank makes (rank ``odd`` differs from the rest):
    ``(obj, op, call, matched)``; ``matched(obj)`` is one matched call before it, or None."""
    import llcomm
    from test_ep_reference import _check_one
    me = rank == odd
    ME = 4 * ws
    if case.startswith("dispatch"):
        hidden = 256 if case == "dispatch-hidden" and me else MH
        buf = llcomm.EPBuffer(num_experts=ME, hidden=hidden, num_max_dispatch_tokens_per_rank=MT,
                              backend="reference", timeout_ms=MISMATCH_TIMEOUT_MS)
        x = torch.ones(MT, hidden, dtype=torch.bfloat16)
        topk = torch.zeros(MT, 3 if case == "dispatch-topk" and me else 2, dtype=torch.int64)
        handle = []         # dispatch-vs-combine: the odd rank combines this dispatch's

        def matched(b):
            fails = _check_one(b, rank, ws, ME, MT, MH, 2, 7, "random", torch.bfloat16)
            assert not fails, fails
            handle.append(b.dispatch(x, topk[:, :2].contiguous())[2])
        if case == "dispatch-vs-combine" and me:
            return buf, "combine", lambda: buf.combine(
                torch.zeros(ME // ws, ws * MT, MH, dtype=torch.bfloat16), topk,
                torch.ones(MT, 2), handle[0]), matched
        return buf, "dispatch", lambda: buf.dispatch(
            x, topk, use_fp8=case == "dispatch-fp8" and me), \
            None if case == "dispatch-hidden" else matched
    comm = llcomm.Communicator(backend="reference", timeout_ms=MISMATCH_TIMEOUT_MS)

    def matched(c):
        return _matched_tp(c, rank, ws)

    if case == "all_reduce-size":
        return comm, "all_reduce", lambda: comm.all_reduce(torch.ones(16 if me else 8)), matched
    if case == "all_reduce-dtype":
        return comm, "all_reduce", lambda: comm.all_reduce(
            torch.ones(8, dtype=torch.bfloat16 if me else torch.float32)), matched
    if case == "all_reduce-vs-all_gather":
        if me:
            return comm, "all_gather", lambda: comm.all_gather(torch.ones(8)), matched
        return comm, "all_reduce", lambda: comm.all_reduce(torch.ones(8)), matched
    if case == "broadcast-src":
        return comm, "broadcast", lambda: comm.broadcast(torch.ones(8), 1 if me else 0), matched
    assert case == "all_gather_2d-shape", case
    return comm, "all_gather_2d", lambda: comm.all_gather_2d(
        torch.ones((4, 4) if me else (2, 8))), matched


def _mismatch_body(rank, ws):
    """Every case of MISMATCH_CASES on fresh objects, the last rank the odd one; per case what
    this rank saw. The group itself must stay usable (a barrier after each case)."""
    import llcomm
    odd = ws - 1
    seen = {}
    for case in MISMATCH_CASES:
        obj, op, call, matched = _mismatched(case, rank, ws, odd)
        if matched is not None:
            matched(obj)
        dist.barrier()      # one rank's oracle work before the call is not part of the test
        try:
            call()
            seen[case] = dict(type="returned")
        except llcomm.LLCommError as e:
            seen[case] = dict(type=type(e).__name__, op=getattr(e, "op", None),
                              phase=getattr(e, "phase", None), ranks=getattr(e, "ranks", None),
                              msg=str(e))
        seen[case].update(called=op)
        # broken for good, at once: the same call, a check
        broken = []
        for again in (call, obj.check):
            try:
                again()
                broken.append("returned")
            except llcomm.CommBrokenError as e:
                broken.append("broken" if "failed earlier" in str(e) else str(e))
            except Exception as e:  # noqa: BLE001  (reported, the test names it)
                broken.append(f"{type(e).__name__}: {e}")
        seen[case]["broken"] = broken
        dist.barrier()
    # ranks that resolve check_calls differently are refused at construction, on every rank
    try:
        llcomm.Communicator(backend="reference", check_calls=rank != odd)
        seen["check_calls"] = "accepted"
    except llcomm.UnsupportedConfigError as e:
        seen["check_calls"] = str(e)
    dist.barrier()
    return seen


@pytest.mark.parametrize("ws", [2, 3])
def test_mismatched_calls_raise_on_every_rank(ws):
    """Ranks that disagree about the op, a size, the dtype, broadcast's src, EP's topk, FP8 mode
    or hidden, or dispatch against combine: CommMismatchError at once on EVERY rank (naming the
    op and every rank's call), then CommBrokenError; no process aborts (gloo would: SIGABRT on a
    size mismatch), every rank exits with code 0."""
    got = run_distributed(_mismatch_body, ws, timeout=120, clean_exit=True)
    odd = ws - 1
    fails = []
    for case, sides in MISMATCH_CASES.items():
        for rank, seen in enumerate(got):
            r, tag = seen[case], f"{case}, rank {rank}"
            if r["type"] != "CommMismatchError":
                fails.append(f"{tag}: {r['type']} {r.get('msg', '')}")
                continue
            want_ranks = tuple(range(odd)) if rank == odd else (odd,)
            if (r["op"], r["phase"], r["ranks"]) != (r["called"], "call check", want_ranks):
                fails.append(f"{tag}: op/phase/ranks {r['op']!r}, {r['phase']!r}, {r['ranks']} "
                             f"!= {r['called']!r}, 'call check', {want_ranks}")
            if not all(s in r["msg"] for s in sides) or f"rank {odd}: " not in r["msg"]:
                fails.append(f"{tag}: the message does not show every rank's call {sides}: "
                             f"{r['msg']}")
            if r["broken"] != ["broken", "broken"]:
                fails.append(f"{tag}: afterwards the call / check() gave {r['broken']}, not "
                             "CommBrokenError")
    for rank, seen in enumerate(got):
        if "check_calls differs between ranks" not in seen["check_calls"]:
            fails.append(f"check_calls True on some ranks, False on others, rank {rank}: "
                         f"{seen['check_calls']}")
    assert not fails, "\n".join(fails)


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

    from llcomm import multiproc
    runs = []
    once = multiproc._run_once

    def counted(*args, **kwargs):
        runs.append(1)
        return once(*args, **kwargs)

    monkeypatch.setattr(multiproc, "_run_once", counted)
    monkeypatch.setattr(multiproc, "FAILURE_GRACE_S", 1.0)
    with pytest.raises(_dist.RankFailed, match="the process group did not form") as info:
        run_distributed(_count_runs, 2, "unused", backend="no-such-backend", timeout=60)
    assert "no-such-backend" in str(info.value)
    assert len(runs) == multiproc.INIT_ATTEMPTS


def test_failure_inside_fn_is_not_retried(tmp_path):
    import _dist
    path = tmp_path / "runs.txt"
    with pytest.raises(_dist.RankFailed, match="fn itself failed") as info:
        run_distributed(_count_runs, 2, str(path), timeout=60)
    assert "did not form" not in str(info.value)
    assert sorted(path.read_text().split()) == ["0", "1"]     # one run, not INIT_ATTEMPTS


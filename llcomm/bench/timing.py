"""How the benchmarks time (docs/performance.md#how-we-measure)::

    warm-up -> synchronize -> barrier (ranks lined up) -> iters x [event, work, event] -> sync
    per-iteration times -> all_reduce MAX over ranks (the slowest rank of each iteration)
    -> median, p10, p90 over iterations; every time is divided by the ops per iteration.

A graph iteration is one replay of a CUDA graph holding ``ops`` back-to-back calls; an eager
iteration is the same ``ops`` calls launched from Python. On CPU an iteration is timed with
``time.perf_counter`` after a barrier. ``time_impl`` times one implementation in each of its
modes, checking its results around the timed loop.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from .spawn import any_rank, attempt, barrier, short_error, sum_over_ranks

#: Ops captured back to back in one CUDA graph; one replay is one timed iteration.
GRAPH_OPS = 20


@dataclass
class Timing:
    """How to time: ``iters`` timed iterations after ``warmup`` of ``ops`` calls each."""
    device: torch.device
    iters: int
    warmup: int
    ops: int = GRAPH_OPS


@dataclass
class Stats:
    median_us: float
    p10_us: float
    p90_us: float


def stats_of(per_iter_us) -> Stats:
    """Median / p10 / p90 of one process's iteration times."""
    a = np.asarray(per_iter_us, dtype=np.float64)
    return Stats(float(np.median(a)), float(np.percentile(a, 10)), float(np.percentile(a, 90)))


def slowest_rank_stats(per_iter_us: list[float], device: torch.device) -> Stats:
    """Max over ranks of each iteration's time, then median / p10 / p90. A collective."""
    t = torch.tensor(per_iter_us, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return stats_of(t.cpu().numpy())


def time_eager(fn: Callable[[], object], t: Timing) -> Stats:
    """Per-op time of ``fn`` launched from Python, ``t.ops`` calls per iteration. A collective."""
    for _ in range(t.warmup * t.ops):
        fn()
    barrier(t.device)
    per: list[float] = []
    if t.device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(t.iters)]
        for start, end in events:
            start.record()
            for _ in range(t.ops):
                fn()
            end.record()
        torch.cuda.synchronize(t.device)
        per = [s.elapsed_time(e) * 1e3 / t.ops for s, e in events]
    else:
        for _ in range(t.iters):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(t.ops):
                fn()
            per.append((time.perf_counter() - t0) * 1e6 / t.ops)
    return slowest_rank_stats(per, t.device)


def capture(fn: Callable[[], object], ops: int, *, warm: bool = True) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``ops`` back-to-back calls of ``fn``, warmed up on a side stream first
    (so no compilation or lazy initialisation happens inside the capture). Not a collective by
    itself, but ``fn`` is: every rank calls it once here. ``warm=False``: no warm-up call, for
    a caller that has run ``fn``'s kernels already and must not run them once more (the graph's
    effects are counted)."""
    if warm:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops):
            fn()
    torch.cuda.synchronize()
    return graph


def replay_us(graph: "torch.cuda.CUDAGraph", t: Timing,
              before: Callable[[], object] = lambda: None) -> list[float]:
    """Per-op µs of each of ``t.iters`` replays of ``graph`` (which holds ``t.ops`` ops), after
    ``t.warmup`` replays and then ``before()``. This process only."""
    for _ in range(t.warmup):
        graph.replay()
    before()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(t.iters)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize(t.device)
    return [s.elapsed_time(e) * 1e3 / t.ops for s, e in events]


def time_graph(graph: "torch.cuda.CUDAGraph", t: Timing) -> Stats:
    """Per-op time of replays of ``graph`` (which holds ``t.ops`` ops). A collective."""
    return slowest_rank_stats(replay_us(graph, t, lambda: barrier(t.device)), t.device)


# -- one thing to time, in each of its modes -----------------------------------------------------
@dataclass
class Impl:
    """One implementation to time in one case. ``fn`` runs it once (a collective: every rank
    calls it; one op, or one whole decode step)."""
    impl: str                                    # llcomm, reference, nccl, torch_one_shot, ...
    algo: str                                    # the algorithm that runs
    fn: Callable[[], object] | None
    reset: Callable[[], object] | None = None    # restore inputs, poison outputs
    check: Callable[[], int] | None = None       # wrong elements in the current result
    raise_errors: Callable[[], object] | None = None  # raise what the device reported (.check())
    modes: tuple = ("graph", "eager")
    error: str | None = None                     # set: not runnable here, report why
    extra: dict = field(default_factory=dict)    # keys added to every row of this impl


def time_impl(impl: Impl, row: dict, t: Timing) -> list[dict]:
    """Time ``impl`` in each of its modes (graph only on GPUs); one result row per mode: ``row``
    plus impl, algo, mode, median_us / p10_us / p90_us, ``wrong`` (summed over ranks; None
    without a check) and ``error`` where it failed. A collective.

    Per mode: reset, one call, check -> (graph: capture ``t.ops`` calls) -> reset, timed loop,
    check. Every step is agreed between ranks, so one rank's failure ends the mode on all.
    """
    rows = []
    for mode in impl.modes:
        if mode == "graph" and t.device.type != "cuda":
            continue
        r = {**row, "impl": impl.impl, "algo": impl.algo, "mode": mode, "median_us": None,
             "p10_us": None, "p90_us": None, "wrong": None, **impl.extra}
        rows.append(r)
        if impl.fn is None:
            r["error"] = impl.error
            continue
        err, wrong, state = [None], [0], {}

        def checked():
            if impl.raise_errors:
                impl.raise_errors()
            if impl.check:
                wrong[0] += impl.check()

        def first_call():
            if impl.reset:
                impl.reset()
            impl.fn()
            checked()

        def capture_it():
            state["graph"] = capture(impl.fn, t.ops)

        def timed():
            if impl.reset:
                impl.reset()
            state["stats"] = (time_graph(state["graph"], t) if mode == "graph"
                              else time_eager(impl.fn, t))
            checked()

        ok = attempt(first_call, err, t.device)
        if ok and mode == "graph":
            ok = attempt(capture_it, err, t.device)
        if ok:
            ok = attempt(timed, err, t.device)
        state.pop("graph", None)
        if impl.check:
            r["wrong"] = sum_over_ranks(wrong[0], t.device)
        if ok:
            s = state["stats"]
            r.update(median_us=s.median_us, p10_us=s.p10_us, p90_us=s.p90_us)
        else:
            r["error"] = err[0]
    return rows


# -- torch symmetric memory as a peer to time against --------------------------------------------
def torch_symm_buffer(count: int, dtype: torch.dtype, device: torch.device):
    """A torch symmetric-memory buffer of ``count`` elements for torch's all-reduce ops
    (``symm_mem.empty`` + ``rendezvous`` on the world group; a collective).

    Returns ``(buffer, group_name, None)``, or ``(None, None, why)`` where this torch or any rank
    cannot make one (the caller reports it in place of the torch rows).
    """
    buf, name, why = None, None, None
    try:
        import torch.distributed._symmetric_memory as symm_mem
        name = dist.group.WORLD.group_name
        buf = symm_mem.empty(count, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, name)
        for op in ("one_shot_all_reduce", "two_shot_all_reduce_"):
            getattr(torch.ops.symm_mem, op)  # raises where this torch lacks the op
    except Exception as e:  # noqa: BLE001 - reported as a row note, not fatal
        buf, why = None, short_error(e)
    if any_rank(buf is None, device):
        return None, None, why or "failed on another rank"
    return buf, name, None

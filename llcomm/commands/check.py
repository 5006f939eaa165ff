"""``llcomm check``: a correctness self-test of every TP op, the fused all-reduce + RMSNorm joins
(``check_fused``) and EP dispatch / combine (``EPBuffer`` and ``llcomm.deep_ep``, every variant
and a random call sequence: ``check_ep``) on this host, with the auto backend.

Spawned like the benchmarks (one process per GPU, else two gloo processes). The oracle is
independent of torch.distributed: every rank regenerates every rank's input from a seed and
computes the expected result locally (sums in fp32 in rank order, rounded once). The peer
backend must match bit for bit; the reference backend (NCCL's or gloo's own summation order)
within a summation-error bound; movement ops byte for byte (the fused joins: ``check_fused``,
which also compares the ranks' bytes). On GPUs every op is also captured in a
CUDA graph and replayed several times. Outputs are poisoned with NaN before every run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..bench import options, result_files, spawn, timing, verify
from . import check_ep, check_fused

#: Elements per rank: a single element, an odd small count, an odd count of about 0.5 MiB (bf16).
COUNTS = (1, 4099, 262147)
DTYPES = ("bfloat16", "float16", "float32")
EXPLICIT_ALGOS = ("one_shot", "two_shot", "lamport")
#: all_gather_2d rows have this many elements (odd, so rows are not 16-byte aligned).
PART_2D = 131
#: Replays of each captured graph before its output is checked.
REPLAYS = 3
#: Offset of the fused joins' seeds from the other ops'.
FUSED_SEED = 5000


@dataclass
class CheckConfig:
    backend: str = "auto"
    seed: int = 20261130
    counts: tuple = COUNTS
    dtypes: tuple = DTYPES


def _cases(comm, rank: int, world: int, dtype, count: int, device, seed: int, exact: bool):
    """(label, fn, out, expected, bound, reset) for every op at ``count`` elements per rank."""
    def reduced(stack):
        if exact:
            return verify.rank_order_sum(stack, dtype), None
        return stack.double().sum(0), verify.sum_bound(stack, dtype)

    stack = verify.all_inputs(world, count, dtype, device, seed)
    x = stack[rank].clone()
    nbytes = count * x.element_size()
    algos = ["auto"]
    if comm.backend == "peer":
        algos += [a for a in EXPLICIT_ALGOS if a != "lamport" or nbytes <= comm.lamport_bytes]
    expected, bound = reduced(stack)
    for algo in algos:
        out = torch.empty_like(x)
        yield (f"all_reduce[{algo}]", lambda out=out, algo=algo: comm.all_reduce(
            x, out=out, algo=algo), out, expected, bound, None)
    for src in sorted({0, world - 1}):
        buf = torch.empty_like(x)

        def reset(buf=buf, src=src):
            if rank == src:
                buf.copy_(x)
            else:
                verify.poison_(buf)
        yield (f"broadcast[src={src}]", lambda buf=buf, src=src: comm.broadcast(buf, src), buf,
               stack[src], None, reset)
    out = torch.empty(world * count, dtype=dtype, device=device)
    yield "all_gather", lambda: comm.all_gather(x, out=out), out, stack.reshape(-1), None, None
    tokens, part = (1, 1) if count < PART_2D else (count // PART_2D, PART_2D)
    x2 = x[:tokens * part].view(tokens, part)
    out2 = torch.empty(tokens, world * part, dtype=dtype, device=device)
    exp2 = stack[:, :tokens * part].reshape(world, tokens, part).transpose(0, 1).reshape(
        tokens, world * part)
    yield ("all_gather_2d", lambda: comm.all_gather_2d(x2, out=out2), out2, exp2, None, None)
    stack_rs = verify.all_inputs(world, world * count, dtype, device, seed + 1)
    xrs = stack_rs[rank].clone()
    outrs = torch.empty(count, dtype=dtype, device=device)
    exp_rs, bound_rs = reduced(stack_rs[:, rank * count:(rank + 1) * count])
    yield ("reduce_scatter", lambda: comm.reduce_scatter(xrs, out=outrs), outrs, exp_rs,
           bound_rs, None)


def _run_case(comm, mode: str, fn, reset, wrong, same=()) -> tuple[int, str | None]:
    """(wrong elements on this rank, error or None). ``reset`` poisons the outputs, ``wrong()``
    counts wrong elements; bytes of ``same`` that differ from rank 0's count too (a collective,
    so it runs whatever happened before)."""
    n, err = 0, None
    try:
        reset()
        if mode == "graph":
            graph = timing.capture(fn, 1)
            reset()
            for _ in range(REPLAYS):
                graph.replay()
        else:
            fn()
            reset()
            fn()  # a repeat call: what the first call leaves behind must not break the next
        comm.check()
        n = wrong()
    except Exception as e:  # noqa: BLE001 - reported as FAIL
        err = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    if same:
        n += verify.rank_differences(same)
    return n, err


def _result(comm, device, mode: str, fn, reset, wrong, same=(), **row) -> dict:
    """One check run on every rank, as a result row (``row``: op, count, dtype, ...)."""
    n, err = _run_case(comm, mode, fn, reset, wrong, same)
    if spawn.any_rank(err is not None, device) and err is None:
        err = "failed on another rank"
    return {**row, "mode": mode, "wrong": spawn.sum_over_ranks(n, device), "error": err}


def rank_main(rank: int, world: int, cfg: CheckConfig):
    import torch.distributed as dist

    from llcomm import Communicator

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtypes = [options.parse_dtype(d) for d in cfg.dtypes]
    largest = max(max(world * c for c in cfg.counts) * max(d.itemsize for d in dtypes),
                  check_fused.max_bytes(dtypes))
    comm = Communicator(max_bytes=largest, backend=cfg.backend)
    exact = comm.backend == "peer"
    results = []
    modes = ("eager", "graph") if cuda else ("eager",)
    for di, (dname, dtype) in enumerate(zip(cfg.dtypes, dtypes)):
        for ci, count in enumerate(cfg.counts):
            seed = cfg.seed + 100 * di + 10 * ci
            for label, fn, out, exp, bound, reset in _cases(comm, rank, world, dtype, count,
                                                             device, seed, exact):
                for mode in modes:
                    results.append(_result(
                        comm, device, mode, fn, reset or (lambda out=out: verify.poison_(out)),
                        lambda out=out, exp=exp, bound=bound: verify.count_wrong(out, exp, bound),
                        op=label, count=count, dtype=dname, exact=bound is None))
    for di, (dname, dtype) in enumerate(zip(cfg.dtypes, dtypes)):
        seed = cfg.seed + FUSED_SEED + 100 * di
        for c in check_fused.cases(comm, rank, world, dtype, device, seed, exact):
            for mode in modes:
                results.append(_result(comm, device, mode, c.fn, c.reset, c.wrong, c.same,
                                       op=c.label, count=c.shape, unit="tokens x hidden",
                                       dtype=dname, exact=exact))
    backend, why = comm.backend, comm.backend_reason
    comm.close()
    results += check_ep.ep_results(rank, world, cfg.backend, device, cfg.seed)
    return {"backend": backend, "reason": why, "world_size": world, "results": results,
            "machine": result_files.machine_string(world, device)} if rank == 0 else None


def summarize(res: dict) -> tuple[list[str], int]:
    """Lines 'PASS/FAIL op count' (dtypes and modes folded in) and the number of failures."""
    lines, failures = [], 0
    groups: dict = {}
    for r in res["results"]:
        groups.setdefault((r["op"], r["count"]), []).append(r)
    width = max((len(op) for op, _ in groups), default=0)
    for (op, count), rs in groups.items():
        bad = [r for r in rs if r["error"] or r["wrong"]]
        failures += len(bad)
        dtypes = "/".join(dict.fromkeys(r["dtype"] for r in rs))
        modes = "+".join(dict.fromkeys(r["mode"] for r in rs))
        unit = rs[0].get("unit") or (
            "tokens/rank" if op.startswith(("ep ", "deep_ep ")) else "elems/rank")
        lines.append(f"{'FAIL' if bad else 'PASS'}  {op:<{width}} {count:>8} {unit}  "
                     f"{dtypes}, {modes}")
        for r in bad:
            what = r["error"] or f"{r['wrong']} wrong elements (summed over ranks)"
            if r["error"] and r["wrong"]:
                what += f" ({r['wrong']} failed checks summed over ranks)"
            lines.append(f"      {r['dtype']} {r['mode']}: {what}")
    return lines, failures


def run(args) -> int:
    cfg = CheckConfig(backend=args.backend)
    res = spawn.launch(rank_main, cfg, force_cpu=args.cpu,
                       multicast_off=args.no_multicast)
    print(f"# llcomm check: {res['machine']}, world size {res['world_size']}, backend "
          f"{res['backend']} ({res['reason']})")
    lines, failures = summarize(res)
    print("\n".join(lines))
    total = len(res["results"])
    print(f"# {total - failures} of {total} checks passed" + ("" if not failures else
                                                               f"; {failures} FAILED"))
    return 1 if failures else 0

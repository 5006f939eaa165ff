"""``llcomm bench tp``: the TP joins of a decode step, timed against NCCL and torch symmetric
memory in the same run, on the same input data, with every llcomm result checked.

Per op and size, on GPUs (one process per GPU, NCCL):

- llcomm (the ``Communicator``; impl ``reference`` where it fell back to its reference backend):
  CUDA-graph mode and eager mode, algo ``auto`` (plus ``one_shot``, ``two_shot``, ``lamport``
  with ``--algos all``; lamport only up to 1 MiB);
- NCCL through torch.distributed, graph and eager;
- all_reduce only: torch symmetric memory ``one_shot_all_reduce`` / ``two_shot_all_reduce_`` on a
  buffer from ``symm_mem.empty`` + ``rendezvous``, graph mode.

On CPU (two gloo processes) only the llcomm row runs, eagerly, timed with ``perf_counter``.

Sizes follow nccl-tests: ``bytes`` is the whole buffer, i.e. the input of all_reduce, broadcast and
reduce_scatter and the output of all_gather (each rank contributes ``bytes / world_size``).
Bus bandwidth uses nccl-tests' factors: all_reduce ``2(n-1)/n``, all_gather and reduce_scatter
``(n-1)/n``, broadcast 1.

Correctness: fresh random inputs per size; the expected result comes from an all_gather of every
rank's input. Sums are taken in fp32 in rank order and rounded once, which the peer backend must
match bit for bit; the reference backend (NCCL's or gloo's own order) must be within a
summation-error bound. Movement ops must be byte-exact. Outputs are poisoned with NaN before the
first call and before the timed loop, and checked after both (after the replays in graph mode).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import console, options, result_files, spawn, timing, verify
from .timing import Impl
from .tp_report import print_result

OPS = ("all_reduce", "broadcast", "all_gather", "all_gather_2d", "reduce_scatter")
EXPLICIT_ALGOS = ("one_shot", "two_shot", "lamport")
DEFAULT_ITERS = 100
DEFAULT_WARMUP = 10
#: all_gather_2d input is [tokens, part] with part = gcd(per-rank elements, this).
GATHER_2D_MAX_PART = 1024
#: Rank whose buffer broadcast sends.
BROADCAST_SRC = 0
# torch >= 2.12 renamed the single-tensor collectives (the old names still work but warn).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Config:
    sizes: list[int]
    dtype: str = "bfloat16"
    iters: int = DEFAULT_ITERS
    warmup: int = DEFAULT_WARMUP
    graph_ops: int = timing.GRAPH_OPS
    algos: str = "auto"
    ops: tuple = ("all_reduce",)
    backend: str = "auto"
    seed: int = 0
    progress: bool = True


class Rank:
    """Per-rank state of a run: device, communicator, generator, torch's symmetric buffer."""

    def __init__(self, rank: int, world: int, cfg: Config):
        from llcomm import Communicator

        self.rank, self.world, self.cfg = rank, world, cfg
        self.cuda = dist.get_backend() == "nccl"
        self.device = torch.device("cuda", rank) if self.cuda else torch.device("cpu")
        self.dtype = options.parse_dtype(cfg.dtype)
        self.itemsize = self.dtype.itemsize
        self.comm = Communicator(max_bytes=max(cfg.sizes), backend=cfg.backend)
        self.llcomm_name = "llcomm" if self.comm.backend == "peer" else "reference"
        self.exact = self.comm.backend == "peer"
        self.timing = timing.Timing(self.device, cfg.iters, cfg.warmup,
                               cfg.graph_ops if self.cuda else 1)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(cfg.seed * 1_000_003 + rank)
        self.symm, self.group_name, self.symm_error = None, None, None
        if self.cuda and "all_reduce" in cfg.ops:
            self.symm, self.group_name, self.symm_error = timing.torch_symm_buffer(
                max(cfg.sizes) // self.itemsize, self.dtype, self.device)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=self.dtype, device=self.device, generator=self.gen)

    def reduced(self, stack: torch.Tensor):
        """(expected, bound) of a sum over dim 0 of ``stack`` for this run's backend."""
        if self.exact:
            return verify.rank_order_sum(stack, self.dtype), None
        return stack.double().sum(0), verify.sum_bound(stack, self.dtype)

    def llcomm_impl(self, algo: str, fn, out: torch.Tensor, expected, bound=None,
                    requested: str | None = None, reset=None) -> Impl:
        return Impl(self.llcomm_name, algo, fn, reset=reset or (lambda: verify.poison_(out)),
                    check=lambda: verify.count_wrong(out, expected, bound),
                    raise_errors=self.comm.check,
                    extra={"requested_algo": requested or "auto", "backend": self.comm.backend})


# -- one builder per op: inputs, expected result, and the impls to time ------------------------
def _all_reduce(R: Rank, count: int) -> list[Impl]:
    x = R.rand(count)
    expected, bound = R.reduced(verify.gather_inputs(x))
    nbytes = count * R.itemsize
    requested = ["auto"]
    if R.cfg.algos == "all" and R.comm.backend == "peer":
        requested += [a for a in EXPLICIT_ALGOS if a != "lamport" or nbytes <= R.comm.lamport_bytes]
    impls = []
    for req in requested:
        out = torch.empty_like(x)
        algo = (R.comm.choose_algo(nbytes) if req == "auto" else req) \
            if R.comm.backend == "peer" else "reference"
        impls.append(R.llcomm_impl(algo, lambda out=out, req=req: R.comm.all_reduce(
            x, out=out, algo=req), out, expected, bound, requested=req))
    if not R.cuda:
        return impls
    nb = x.clone()
    impls.append(Impl("nccl", "nccl", lambda: dist.all_reduce(nb), reset=lambda: nb.copy_(x)))
    if R.symm is None:
        for name in ("torch_one_shot", "torch_two_shot"):
            impls.append(Impl(name, name[6:], None, modes=("graph",), error=R.symm_error))
        return impls
    view, gname = R.symm[:count], R.group_name
    impls.append(Impl("torch_one_shot", "one_shot", modes=("graph",), reset=lambda: view.copy_(x),
                      fn=lambda: torch.ops.symm_mem.one_shot_all_reduce(view, "sum", gname)))
    impls.append(Impl("torch_two_shot", "two_shot", modes=("graph",), reset=lambda: view.copy_(x),
                      fn=lambda: torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", gname)))
    return impls


def _broadcast(R: Rank, count: int) -> list[Impl]:
    x = R.rand(count)
    expected = verify.gather_inputs(x)[BROADCAST_SRC]
    buf = torch.empty_like(x)

    def reset():
        if R.rank == BROADCAST_SRC:
            buf.copy_(x)
        else:
            verify.poison_(buf)
    impls = [R.llcomm_impl(R.comm.backend, lambda: R.comm.broadcast(buf, BROADCAST_SRC), buf,
                           expected, reset=reset)]
    if R.cuda:
        nb = x.clone()
        impls.append(Impl("nccl", "nccl", lambda: dist.broadcast(nb, BROADCAST_SRC)))
    return impls


def _all_gather(R: Rank, count: int) -> list[Impl]:
    x = R.rand(count // R.world)
    expected = verify.gather_inputs(x).reshape(-1)
    out = torch.empty(count, dtype=R.dtype, device=R.device)
    impls = [R.llcomm_impl(R.comm.backend, lambda: R.comm.all_gather(x, out=out), out, expected)]
    if R.cuda:
        o2 = torch.empty_like(out)
        impls.append(Impl("nccl", "nccl", lambda: _all_gather_flat(o2, x)))
    return impls


def _all_gather_2d(R: Rank, count: int) -> list[Impl]:
    per = count // R.world
    part = math.gcd(per, GATHER_2D_MAX_PART)
    tokens = per // part
    x = R.rand(tokens, part)
    expected = verify.gather_inputs(x).transpose(0, 1).reshape(tokens, R.world * part)
    out = torch.empty(tokens, R.world * part, dtype=R.dtype, device=R.device)
    impls = [R.llcomm_impl(R.comm.backend, lambda: R.comm.all_gather_2d(x, out=out), out,
                           expected)]
    impls[0].extra.update(tokens=tokens, part=part)
    if R.cuda:  # NCCL has no strided gather: gather rank-major, then permute (what engines do)
        stacked = torch.empty(R.world, tokens, part, dtype=R.dtype, device=R.device)
        o2 = torch.empty_like(out)

        def nccl_2d():
            _all_gather_flat(stacked.view(-1), x.view(-1))
            o2.view(tokens, R.world, part).copy_(stacked.transpose(0, 1))
        impls.append(Impl("nccl", "gather+permute", nccl_2d,
                          extra={"tokens": tokens, "part": part}))
    return impls


def _reduce_scatter(R: Rank, count: int) -> list[Impl]:
    m = count // R.world
    x = R.rand(count)
    stack = verify.gather_inputs(x)[:, R.rank * m:(R.rank + 1) * m]
    expected, bound = R.reduced(stack)
    out = torch.empty(m, dtype=R.dtype, device=R.device)
    impls = [R.llcomm_impl(R.comm.backend, lambda: R.comm.reduce_scatter(x, out=out), out,
                           expected, bound)]
    if R.cuda:
        o2 = torch.empty_like(out)
        impls.append(Impl("nccl", "nccl", lambda: _reduce_scatter_flat(o2, x)))
    return impls


BUILDERS = {"all_reduce": _all_reduce, "broadcast": _broadcast, "all_gather": _all_gather,
            "all_gather_2d": _all_gather_2d, "reduce_scatter": _reduce_scatter}


def skip_reason(op: str, nbytes: int, itemsize: int, world: int) -> str | None:
    if nbytes % itemsize:
        return f"{nbytes} B is not a whole number of {itemsize}-byte elements"
    if op in ("all_gather", "all_gather_2d", "reduce_scatter") and (nbytes // itemsize) % world:
        return f"{nbytes // itemsize} elements do not split into {world} equal parts"
    return None


# -- running one impl ---------------------------------------------------------------------------
def run_impl(R: Rank, op: str, nbytes: int, impl: Impl) -> list[dict]:
    """Time ``impl`` in each of its modes (graph only on GPUs); one result row per mode."""
    row = {"op": op, "dtype": options.dtype_name(R.dtype), "world_size": R.world,
           "bytes": nbytes, "count": nbytes // R.itemsize}
    return timing.time_impl(impl, row, R.timing)


def rank_main(rank: int, world: int, cfg: Config):
    """One rank of ``llcomm bench tp``: rank 0 returns the result (header, rows, notes)."""
    R = Rank(rank, world, cfg)
    rows, notes = [], []
    with console.progress(len(cfg.ops) * len(cfg.sizes), "bench tp",
                    enabled=rank == 0 and cfg.progress) as bar:
        for op in cfg.ops:
            for nbytes in cfg.sizes:
                why = skip_reason(op, nbytes, R.itemsize, world)
                if why:
                    notes.append(f"{op} {console.fmt_bytes(nbytes)}: skipped, {why}")
                else:
                    for impl in BUILDERS[op](R, nbytes // R.itemsize):
                        rows += run_impl(R, op, nbytes, impl)
                bar.advance(f"{op} {console.fmt_bytes(nbytes)}")
    backend, reason = R.comm.backend, R.comm.backend_reason
    R.comm.close()
    if rank != 0:
        return None
    header = result_files.result_header(world, R.device)
    return {**header, "bench": "tp", "backend": backend, "backend_reason": reason,
            "iters": cfg.iters, "warmup": cfg.warmup,
            "graph_ops": R.timing.ops if R.cuda else None, "rows": rows, "notes": notes}


# -- command line -------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--sizes", help="comma list of byte sizes with K/M suffixes "
                   "(default: every power of two from 8 B to 16 MiB)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16, float32")
    options.add_graph_ops_argument(p)
    p.add_argument("--algos", choices=("auto", "all"), default="auto",
                   help="llcomm all_reduce algorithms: auto only, or also each one explicitly")
    p.add_argument("--ops", default="all_reduce",
                   help=f"comma list of {', '.join(OPS)}, or 'all' (default all_reduce)")
    p.add_argument("--backend", choices=("auto", "peer", "reference"), default="auto",
                   help="llcomm Communicator backend (default auto)")
    options.add_run_arguments(p, iters=DEFAULT_ITERS, warmup=DEFAULT_WARMUP)


def config_from_args(a) -> Config:
    """Validate every argument; raise one ValueError naming each problem."""
    problems = []
    sizes, ops = [], ()
    try:
        sizes = options.parse_sizes(a.sizes)
    except ValueError as e:
        problems.append(str(e))
    try:
        options.parse_dtype(a.dtype)
    except ValueError as e:
        problems.append(str(e))
    if a.ops.strip() == "all":
        ops = OPS
    else:
        ops = tuple(o.strip() for o in a.ops.split(",") if o.strip())
        bad = [o for o in ops if o not in OPS]
        if bad or not ops:
            problems.append(f"--ops {a.ops!r}: expected 'all' or a comma list of {', '.join(OPS)}")
    if a.graph_ops < 1:
        problems.append("--graph-ops must be at least 1")
    options.check_run_arguments(a, problems)
    if problems:
        raise ValueError("; ".join(problems))
    dtype = options.dtype_name(options.parse_dtype(a.dtype))
    return Config(sizes=sizes, dtype=dtype, iters=a.iters,
                  warmup=a.warmup, graph_ops=a.graph_ops, algos=a.algos, ops=ops,
                  backend=a.backend, seed=a.seed, progress=not a.no_progress)


def run(a) -> int:
    """``llcomm bench tp``: returns the exit status (1 if any llcomm result was wrong or failed)."""
    try:
        cfg = config_from_args(a)
    except ValueError as e:
        print(f"llcomm bench tp: {e}")
        return 2
    result = spawn.launch(rank_main, cfg, force_cpu=a.cpu,
                          multicast_off=a.no_multicast)
    print_result(result)
    result_files.write_outputs(result, a)
    bad = [r for r in result["rows"] if r["impl"] in ("llcomm", "reference")
           and (r.get("error") or (r["wrong"] or 0) > 0)]
    if bad:
        print(f"llcomm bench tp: {len(bad)} llcomm result rows are wrong or failed")
    return 1 if bad else 0

"""``llcomm tune``: measure which all-reduce algorithm is fastest at each size on this host, and
write the table that ``Communicator`` then uses for ``all_reduce(algo="auto")``.

    llcomm tune [--sizes 8,64K,1M] [--out PATH]          # measure (one process per GPU)
    llcomm tune --from-bench RESULT.json [--out PATH]    # derive from a `bench tp --algos all` run

Measuring: one process per GPU (``spawn.launch``), the peer backend, and for every size each of
one_shot, two_shot and lamport (Lamport only up to its 1 MiB buffer) timed exactly as
``llcomm bench tp`` times them (``bench.tp.run_impl``: CUDA-graph replays, slowest rank per
iteration, median; every result checked bit for bit). A result that is wrong or failed does not
compete. Per size the fastest wins; adjacent sizes with the same winner merge into one row.

The table goes to ``--out``, else to ``llcomm.tp.algo_table.user_table_path`` (``LLCOMM_TUNE_TABLE``
or ``~/.cache/llcomm/tune-<gpu>-w<W>.json``), which is where Communicator looks first. Format:
``llcomm/tp/algo_table.py``.
"""
from __future__ import annotations

import datetime
import json
import re

from llcomm.runtime import settings
from llcomm.tp import algo_table as T

from ..bench import console, options, result_files, spawn, timing, verify
from ..bench import tp as B

#: Sizes tuned by default: every power of two from 8 B up to this (the default max_bytes).
DEFAULT_MAX_BYTES = 16 << 20
#: One line for ``llcomm tune --help``.
SUMMARY = ("Measure the fastest all_reduce algorithm at each size on this host (peer backend, "
           "one process per GPU) and write the table all_reduce(algo='auto') uses.")
#: The only op a table covers.
OP = "all_reduce"


# -- deriving a table from a `llcomm bench tp --algos all` result file -----------------------
def times_from_bench(result: dict, dtype: str = "bfloat16") -> dict[int, dict[str, float]]:
    """{bytes: {algo: median µs}} of the explicit-algorithm llcomm all_reduce rows in graph
    mode of a bench tp result (rows that were wrong or failed are left out)."""
    times: dict[int, dict[str, float]] = {}
    for r in result.get("rows", []):
        if (r.get("op") == OP and r.get("impl") == "llcomm" and r.get("mode") == "graph"
                and r.get("dtype") == dtype and r.get("requested_algo") in T.TABLE_ALGOS
                and r.get("median_us") is not None and not r.get("error")
                and (r.get("wrong") or 0) == 0):
            times.setdefault(r["bytes"], {})[r["requested_algo"]] = r["median_us"]
    return times


def device_from_machine(machine: str) -> str:
    """'2xH200 NV18' -> 'H200': the GPU model of a bench result's machine string (the first
    word after the count; pass --device where the model name has spaces)."""
    m = re.match(r"\s*\d+x(\S+)", machine or "")
    if not m:
        raise ValueError(f"cannot read a GPU name from machine={machine!r}; pass --device")
    return m.group(1)


def table_from_bench(result: dict, *, source: str, device: str | None = None,
                     dtype: str = "bfloat16") -> dict:
    """The table document (algo_table.FORMAT) a bench tp result file implies."""
    if result.get("backend") not in (None, "peer"):
        raise ValueError(f"{source}: measured the {result.get('backend')} backend; a table "
                         "needs the peer backend's algorithms")
    times = times_from_bench(result, dtype)
    if not times:
        raise ValueError(f"{source}: no {dtype} llcomm all_reduce rows per algorithm in graph "
                         "mode; produce it with `llcomm bench tp --algos all --json FILE`")
    device = device or result.get("device") or device_from_machine(result.get("machine", ""))
    return T.document(device, int(result["world_size"]), times, dtype=dtype,
                      commit=result.get("commit"), date=result.get("date"),
                      versions={k: result.get("versions", {}).get(k) for k in ("torch", "triton")},
                      source=f"llcomm tune --from-bench {source}")


# -- measuring ---------------------------------------------------------------------------------
def rank_main(rank: int, world: int, cfg: B.Config):
    """One rank of ``llcomm tune``: time every algorithm at every size; rank 0 returns them."""
    import torch

    R = B.Rank(rank, world, cfg)  # cfg.ops is empty: no torch symmetric-memory buffer
    times: dict[int, dict[str, float | None]] = {}
    failures: list[str] = []
    with console.progress(len(cfg.sizes), "tune", enabled=rank == 0 and cfg.progress) as bar:
        for nbytes in cfg.sizes:
            times[nbytes] = {}
            why = B.skip_reason(OP, nbytes, R.itemsize, world)
            if why:
                failures.append(f"{console.fmt_bytes(nbytes)}: skipped, {why}")
                bar.advance(console.fmt_bytes(nbytes))
                continue
            x = R.rand(nbytes // R.itemsize)
            expected, bound = R.reduced(verify.gather_inputs(x))
            for algo in T.TABLE_ALGOS:
                if algo == "lamport" and nbytes > R.comm.lamport_bytes:
                    continue
                out = torch.empty_like(x)
                impl = R.llcomm_impl(algo, lambda out=out, algo=algo: R.comm.all_reduce(
                    x, out=out, algo=algo), out, expected, bound, requested=algo)
                impl.modes = ("graph",)
                row, = B.run_impl(R, OP, nbytes, impl)
                bad = row.get("error") or (row["wrong"] or 0) > 0
                times[nbytes][algo] = None if bad else row["median_us"]
                if bad:
                    failures.append(f"{console.fmt_bytes(nbytes)} {algo}: "
                                    f"{row.get('error') or str(row['wrong']) + ' wrong'}")
            bar.advance(console.fmt_bytes(nbytes))
    device = torch.cuda.get_device_name(R.device)
    R.comm.close()
    if rank != 0:
        return None
    commit, dirty = result_files.git_state()
    return {"device": device, "world_size": world, "dtype": cfg.dtype, "commit": commit,
            "dirty": dirty, "machine": result_files.machine_string(world, R.device),
            "versions": {k: v for k, v in result_files.versions().items()
                         if k in ("torch", "triton")},
            "iters": cfg.iters, "graph_ops": cfg.graph_ops, "times": times,
            "failures": failures}


# -- command line ------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--sizes", help="comma list of byte sizes with K/M suffixes (default: every "
                   "power of two from 8 B to --max-bytes)")
    p.add_argument("--max-bytes", type=options.parse_size, default=DEFAULT_MAX_BYTES,
                   help="largest size of the default sweep (default 16M)")
    p.add_argument("--out", metavar="PATH", help="table to write (default: $LLCOMM_TUNE_TABLE, "
                   "else ~/.cache/llcomm/tune-<gpu>-w<W>.json, where Communicator looks first)")
    p.add_argument("--dtype", default="bfloat16", help="dtype measured (default bfloat16)")
    p.add_argument("--iters", type=int, default=B.DEFAULT_ITERS,
                   help=f"graph replays timed per case (default {B.DEFAULT_ITERS})")
    p.add_argument("--warmup", type=int, default=B.DEFAULT_WARMUP,
                   help=f"untimed replays first (default {B.DEFAULT_WARMUP})")
    p.add_argument("--graph-ops", type=int, default=timing.GRAPH_OPS,
                   help=f"ops per CUDA graph (default {timing.GRAPH_OPS})")
    p.add_argument("--from-bench", metavar="RESULT",
                   help="measure nothing: derive the table from a `llcomm bench tp --algos all "
                   "--json` result file (runs anywhere)")
    p.add_argument("--device", help="with --from-bench: the GPU name to record (default: from "
                   "the result file)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    options.add_no_multicast_argument(p)


def _config(a) -> B.Config:
    problems = []
    sizes = []
    try:
        sizes = options.parse_sizes(a.sizes, hi=a.max_bytes)
    except ValueError as e:
        problems.append(str(e))
    try:
        dtype = options.dtype_name(options.parse_dtype(a.dtype))
    except ValueError as e:
        problems.append(str(e))
    for name in ("iters", "graph_ops"):
        if getattr(a, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be at least 1")
    if a.warmup < 0:
        problems.append("--warmup must not be negative")
    if problems:
        raise ValueError("; ".join(problems))
    return B.Config(sizes=sizes, dtype=dtype, iters=a.iters, warmup=a.warmup,
                    graph_ops=a.graph_ops, algos="all", ops=(), backend="peer",
                    progress=not a.no_progress)


def _write(doc: dict, out: str | None) -> str:
    path = out or str(T.user_table_path(doc["device"], doc["world_size"],
                                        settings.value("LLCOMM_TUNE_TABLE")))
    result_files.write_json(path, doc)
    return path


def _print(doc: dict) -> None:
    print(f"# all_reduce algorithm table: {doc['device']}, world size {doc['world_size']}, "
          f"{doc.get('dtype')}, commit {doc.get('commit')}")
    for row in doc["rows"]:
        print(f"  <= {console.fmt_bytes(row['max_bytes']):>6}  {row['algo']}")
    print(f"   > {console.fmt_bytes(doc['rows'][-1]['max_bytes']):>6}  {doc['rows'][-1]['algo']}")


def run(a) -> int:
    """``llcomm tune``: 0 on success, 2 for bad arguments or a host it cannot tune."""
    if a.from_bench:
        try:
            with open(a.from_bench) as f:
                result = json.load(f)
            doc = table_from_bench(result, source=a.from_bench, device=a.device,
                                   dtype=options.dtype_name(options.parse_dtype(a.dtype)))
        except (OSError, ValueError) as e:
            print(f"llcomm tune: {e}")
            return 2
        _print(doc)
        print(f"wrote {_write(doc, a.out)}")
        return 0
    try:
        cfg = _config(a)
    except ValueError as e:
        print(f"llcomm tune: {e}")
        return 2
    world, backend = spawn.plan()
    if backend != "nccl":
        print("llcomm tune: measures the peer backend's all_reduce algorithms (one_shot, "
              "two_shot, lamport), which needs two or more GPUs with peer access on this host; "
              "this host has fewer than two CUDA GPUs. Elsewhere all_reduce(algo='auto') uses "
              "the tables shipped in llcomm/tp/tables or the built-in rule. (--from-bench derives "
              "a table from a result file without GPUs.)")
        return 2
    import torch
    user = T.user_table_path(torch.cuda.get_device_name(0), world,
                             settings.value("LLCOMM_TUNE_TABLE"))
    if user.exists():  # every Communicator reads it, the ones tune times with included
        try:
            T.load(user)
        except T.AlgoTableError as e:
            print(f"llcomm tune: {e} (Communicator reads it at construction, so tuning cannot "
                  "start until it is fixed or deleted)")
            return 2
    res = spawn.launch(rank_main, cfg, multicast_off=a.no_multicast)
    for line in res["failures"]:
        print(f"llcomm tune: {line}")
    try:
        doc = T.document(res["device"], res["world_size"], res["times"], dtype=res["dtype"],
                         commit=res["commit"], dirty=res["dirty"], machine=res["machine"],
                         versions=res["versions"], date=datetime.date.today().isoformat(),
                         iters=res["iters"], graph_ops=res["graph_ops"], source="llcomm tune")
    except ValueError as e:
        print(f"llcomm tune: {e}")
        return 1
    _print(doc)
    print(f"wrote {_write(doc, a.out)}")
    return 0

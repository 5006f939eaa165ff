"""``llcomm bench fused``: the fused joins against the unfused sequences they replace, same
communicator, same inputs.

Per op (``--ops``, default all four: ``all_reduce_residual_rmsnorm``, ``all_reduce_rmsnorm``,
``all_reduce_residual_rmsnorm_fp8``, ``all_reduce_residual_rmsnorm_fp8_per_group``), row length
(``--hidden``, default 7168 and 8192, bf16) and token count (default 1 to 128): CUDA-graph and
eager rows for

- ``llcomm`` (``reference`` where the Communicator fell back): the fused op, algo ``auto``;
- ``unfused``: ``comm.all_reduce`` (algo ``auto``), then torch: ``+ residual``,
  ``torch.nn.functional.rms_norm`` (a manual fp32 RMSNorm where torch lacks it), and for the FP8
  ops the quantisation (``y / scale`` clamped and cast; per group: amax / 448 per 128 channels).

On CPU (``--cpu``: two gloo processes, the reference backend) only eager rows run. ``bytes`` is
the all-reduced x of one rank. Timing and result files as ``llcomm bench tp``
(``bench.timing``, docs/performance.md#how-we-measure); what each result is checked against:
``llcomm/bench/fused_ops.py``.
"""
from __future__ import annotations

from dataclasses import dataclass


from . import console, fused_ops, options, result_files, spawn
from . import timing
from . import tp as TP

OPS = fused_ops.OPS
DEFAULT_TOKENS = (1, 8, 32, 64, 128)
DEFAULT_HIDDEN = (7168, 8192)
EPS = fused_ops.EPS


@dataclass
class Config:
    tokens: list[int]
    hidden: list[int]
    ops: tuple = OPS
    dtype: str = "bfloat16"
    iters: int = TP.DEFAULT_ITERS
    warmup: int = TP.DEFAULT_WARMUP
    graph_ops: int = timing.GRAPH_OPS
    backend: str = "auto"
    seed: int = 0
    progress: bool = True


def rank_main(rank: int, world: int, cfg: Config):
    """One rank of ``llcomm bench fused``: rank 0 returns the result (header, rows, notes)."""
    itemsize = options.parse_dtype(cfg.dtype).itemsize
    tp_cfg = TP.Config(sizes=[max(cfg.tokens) * max(cfg.hidden) * itemsize], dtype=cfg.dtype,
                       iters=cfg.iters, warmup=cfg.warmup, graph_ops=cfg.graph_ops, ops=(),
                       backend=cfg.backend, seed=cfg.seed, progress=False)
    R = TP.Rank(rank, world, tp_cfg)
    rows = []
    cases = [(op, h, t) for op in cfg.ops for h in cfg.hidden for t in cfg.tokens]
    with console.progress(len(cases), "bench fused",
                          enabled=rank == 0 and cfg.progress) as bar:
        for op, hidden, tokens in cases:
            nbytes = tokens * hidden * itemsize
            for impl in fused_ops.impls(R, op, tokens, hidden):
                rows += TP.run_impl(R, op, nbytes, impl)
            bar.advance(f"{op} {hidden} x {tokens} tokens")
    backend, reason = R.comm.backend, R.comm.backend_reason
    R.comm.close()
    if rank != 0:
        return None
    return {**result_files.result_header(world, R.device), "bench": "fused", "backend": backend,
            "backend_reason": reason, "iters": cfg.iters, "warmup": cfg.warmup,
            "graph_ops": R.timing.ops if R.cuda else None, "hidden": list(cfg.hidden),
            "eps": EPS, "rows": rows, "notes": []}


# -- report ---------------------------------------------------------------------------------------
HEADERS = ["hidden", "tokens", "bytes", "dtype", "fused graph µs", "fused eager µs", "algo",
           "unfused graph µs", "unfused eager µs", "speedup", "#wrong"]
#: What each op's table compares.
UNFUSED = {
    "all_reduce_residual_rmsnorm": "all_reduce + add + rms_norm",
    "all_reduce_rmsnorm": "all_reduce + rms_norm",
    "all_reduce_residual_rmsnorm_fp8": "all_reduce + add + rms_norm + fp8 quant",
    "all_reduce_residual_rmsnorm_fp8_per_group": "all_reduce + add + rms_norm + fp8 group quant",
}


def table_rows(rows: list[dict]) -> list[list[str]]:
    """One table line per (hidden, tokens) of the rows of one op."""
    cells_of: dict = {}
    for r in rows:
        side = "unfused" if r["impl"] == "unfused" else "fused"
        cells_of.setdefault((r.get("hidden"), r["tokens"]), {})[(side, r["mode"])] = r
    out = []
    for (hidden, tokens), cells in cells_of.items():
        def us(side, mode):
            r = cells.get((side, mode))
            return None if r is None or r.get("error") else r["median_us"]
        any_row = next(iter(cells.values()))
        fused = us("fused", "graph") or us("fused", "eager")
        unfused = us("unfused", "graph") or us("unfused", "eager")
        wrong = [r["wrong"] for r in cells.values() if r.get("wrong") is not None]
        algo = next((r["algo"] for (side, _), r in cells.items() if side == "fused"), "-")
        out.append([str(hidden), str(tokens), console.fmt_bytes(any_row["bytes"]),
                    any_row["dtype"],
                    console.fmt_us(us("fused", "graph")), console.fmt_us(us("fused", "eager")),
                    algo,
                    console.fmt_us(us("unfused", "graph")), console.fmt_us(us("unfused", "eager")),
                    f"{unfused / fused:.2f}x" if fused and unfused else "-",
                    str(sum(wrong)) if wrong else "-"])
    return out


def print_result(result: dict) -> None:
    hidden = result["hidden"]
    print(f"# llcomm bench fused  {result['machine']}  backend {result['backend']}  "
          f"hidden {','.join(map(str, hidden if isinstance(hidden, list) else [hidden]))}  "
          f"commit {str(result['commit'])[:10]}")
    ops = list(dict.fromkeys(r.get("op", OPS[0]) for r in result["rows"]))
    for op in ops:
        console.print_table(f"{op} vs {UNFUSED.get(op, 'the unfused sequence')} "
                            "(median µs per op)", HEADERS,
                            table_rows([r for r in result["rows"] if r.get("op", OPS[0]) == op]))
    for r in result["rows"]:
        if r.get("error"):
            print(f"  {r.get('op')} {r['impl']} {r['mode']} {r['tokens']} tokens: {r['error']}")


# -- command line -------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--ops", default="all",
                   help="comma list of fused ops (default all: " + ", ".join(OPS) + ")")
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                   help="comma list of token counts (default 1,8,32,64,128)")
    p.add_argument("--hidden", default=",".join(map(str, DEFAULT_HIDDEN)),
                   help="comma list of row lengths (default 7168,8192)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16, float32")
    options.add_graph_ops_argument(p)
    p.add_argument("--backend", choices=("auto", "peer", "reference"), default="auto",
                   help="llcomm Communicator backend (default auto)")
    options.add_run_arguments(p, iters=TP.DEFAULT_ITERS, warmup=TP.DEFAULT_WARMUP)


def config_from_args(a) -> Config:
    """Validate every argument; raise one ValueError naming each problem."""
    problems, tokens, hidden = [], [], []
    ops = OPS if a.ops == "all" else tuple(o.strip() for o in a.ops.split(",") if o.strip())
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        problems.append(f"--ops {a.ops!r}: expected 'all' or a comma list of "
                        f"{', '.join(OPS)}")
    try:
        tokens = options.parse_ints(a.tokens, "--tokens")
    except ValueError as e:
        problems.append(str(e))
    try:
        hidden = options.parse_ints(a.hidden, "--hidden")
    except ValueError as e:
        problems.append(str(e))
    if any(fused_ops.needs_groups(o) for o in ops) and any(h % fused_ops.GROUP for h in hidden):
        problems.append(f"--hidden {a.hidden}: all_reduce_residual_rmsnorm_fp8_per_group needs "
                        f"multiples of {fused_ops.GROUP} (leave it out of --ops for others)")
    try:
        options.parse_dtype(a.dtype)
    except ValueError as e:
        problems.append(str(e))
    if a.graph_ops < 1:
        problems.append("--graph-ops must be at least 1")
    options.check_run_arguments(a, problems)
    if problems:
        raise ValueError("; ".join(problems))
    dtype = options.dtype_name(options.parse_dtype(a.dtype))
    return Config(tokens=tokens, hidden=hidden, ops=ops, dtype=dtype, iters=a.iters,
                  warmup=a.warmup, graph_ops=a.graph_ops, backend=a.backend, seed=a.seed,
                  progress=not a.no_progress)


def run(a) -> int:
    """``llcomm bench fused``: exit status 1 if any result was wrong or failed."""
    try:
        cfg = config_from_args(a)
    except ValueError as e:
        print(f"llcomm bench fused: {e}")
        return 2
    result = spawn.launch(rank_main, cfg, force_cpu=a.cpu,
                          multicast_off=a.no_multicast)
    print_result(result)
    result_files.write_outputs(result, a)
    bad = [r for r in result["rows"] if r.get("error") or (r["wrong"] or 0) > 0]
    if bad:
        print(f"llcomm bench fused: {len(bad)} result rows are wrong or failed")
    return 1 if bad else 0

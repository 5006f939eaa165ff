"""``llcomm bench fused``: ``all_reduce_residual_rmsnorm`` against the unfused sequence it
replaces (llcomm ``all_reduce`` + torch add + torch RMSNorm), same communicator, same inputs.

Per token count (hidden fixed, default 8192 bf16): CUDA-graph and eager rows for

- ``llcomm`` (``reference`` where the Communicator fell back): the fused op, algo ``auto``;
- ``unfused``: ``comm.all_reduce(x)`` (algo ``auto``), ``+ residual``, then
  ``torch.nn.functional.rms_norm`` (a manual fp32 RMSNorm where torch lacks it).

On CPU (two gloo processes) only eager rows run. ``bytes`` is the all-reduced x of one rank.
Timing and result files as ``llcomm bench tp`` (``bench.timing``,
docs/performance.md#how-we-measure).

Correctness, after the first call and after the timed loop, outputs poisoned with NaN before
each: ``residual_out`` must equal the rank-order fp32 sum rounded, plus the residual, rounded
(bit for bit on the peer backend; within the summation bound on the reference backend); ``out``
must be the float64 RMSNorm of the returned ``residual_out`` within two roundings of the dtype
(torch's RMSNorm rounds before the weight multiply, the fused op once).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import console, options, result_files, spawn, timing, verify
from . import tp as TP

OP = "all_reduce_residual_rmsnorm"
DEFAULT_TOKENS = (1, 8, 32, 64, 128)
DEFAULT_HIDDEN = 8192
EPS = 1e-6
#: ``out`` may be off its float64 norm by this many dtype epsilons (relative), see the top.
NORM_EPS_ALLOWED = 2
#: Relative slack for the fp32 arithmetic (mean, rsqrt) inside either implementation.
FP32_SLACK = 1e-5


@dataclass
class Config:
    tokens: list[int]
    hidden: int = DEFAULT_HIDDEN
    dtype: str = "bfloat16"
    iters: int = TP.DEFAULT_ITERS
    warmup: int = TP.DEFAULT_WARMUP
    graph_ops: int = timing.GRAPH_OPS
    backend: str = "auto"
    seed: int = 0
    progress: bool = True


def _rms_norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    fn = getattr(torch.nn.functional, "rms_norm", None)
    if fn is not None:
        return fn(h, (h.shape[-1],), w, EPS)
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype) * w


def _wrong_norm(y: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> int:
    hd = h.double()
    want = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    fi = torch.finfo(y.dtype)
    bound = (NORM_EPS_ALLOWED * fi.eps + FP32_SLACK) * want.abs() + fi.tiny
    return verify.count_wrong(y, want, bound)


def _impls(R: TP.Rank, tokens: int, hidden: int) -> list[TP.Impl]:
    x = R.rand(tokens, hidden)
    g = torch.Generator(device=R.device)
    g.manual_seed(R.cfg.seed * 1_000_003 + 7919 * tokens)  # no rank: the same on every rank
    res = torch.randn(tokens, hidden, dtype=R.dtype, device=R.device, generator=g)
    w = torch.rand(hidden, dtype=R.dtype, device=R.device, generator=g) + 0.5
    stack = torch.cat([verify.gather_inputs(x), res[None]])
    if R.exact:
        s = verify.rank_order_sum(stack[:-1], R.dtype)
        h_want, h_bound = (s.float() + res.float()).to(R.dtype), None
    else:
        h_want, h_bound = stack.double().sum(0), verify.sum_bound(stack, R.dtype)
    extra = {"tokens": tokens, "hidden": hidden}
    impls = []
    for name in ("fused", "unfused"):
        y = torch.empty_like(x)
        h = torch.empty_like(x)
        if name == "fused":
            fn = (lambda y=y, h=h: R.comm.all_reduce_residual_rmsnorm(
                x, res, w, EPS, out=y, residual_out=h))
            impl, algo = R.llcomm_name, R.comm.choose_fused_algo(x.numel() * R.itemsize)
        else:
            ar = torch.empty_like(x)

            def fn(y=y, h=h, ar=ar):
                R.comm.all_reduce(x, out=ar)
                torch.add(ar, res, out=h)
                y.copy_(_rms_norm(h, w))
            impl = "unfused"
            algo = (R.comm.choose_algo(x.numel() * R.itemsize) if R.comm.backend == "peer"
                    else "reference")

        def reset(y=y, h=h):
            verify.poison_(y)
            verify.poison_(h)

        def check(y=y, h=h):
            return verify.count_wrong(h, h_want, h_bound) + _wrong_norm(y, h, w)
        impls.append(timing.Impl(impl, algo, fn, reset=reset, check=check,
                            raise_errors=R.comm.check,
                            extra={**extra, "requested_algo": "auto",
                                   "backend": R.comm.backend}))
    return impls


def rank_main(rank: int, world: int, cfg: Config):
    """One rank of ``llcomm bench fused``: rank 0 returns the result (header, rows, notes)."""
    itemsize = torch.empty(0, dtype=options.parse_dtype(cfg.dtype)).element_size()
    tp_cfg = TP.Config(sizes=[max(cfg.tokens) * cfg.hidden * itemsize], dtype=cfg.dtype,
                       iters=cfg.iters, warmup=cfg.warmup, graph_ops=cfg.graph_ops, ops=(),
                       backend=cfg.backend, seed=cfg.seed, progress=False)
    R = TP.Rank(rank, world, tp_cfg)
    rows = []
    with console.progress(len(cfg.tokens), "bench fused",
                          enabled=rank == 0 and cfg.progress) as bar:
        for tokens in cfg.tokens:
            nbytes = tokens * cfg.hidden * itemsize
            for impl in _impls(R, tokens, cfg.hidden):
                rows += TP.run_impl(R, OP, nbytes, impl)
            bar.advance(f"{tokens} tokens")
    backend, reason = R.comm.backend, R.comm.backend_reason
    R.comm.close()
    if rank != 0:
        return None
    return {**result_files.result_header(world, R.device), "bench": "fused", "backend": backend,
            "backend_reason": reason, "iters": cfg.iters, "warmup": cfg.warmup,
            "graph_ops": R.timing.ops if R.cuda else None, "hidden": cfg.hidden, "eps": EPS,
            "rows": rows, "notes": []}


# -- report ---------------------------------------------------------------------------------------
HEADERS = ["tokens", "bytes", "dtype", "fused graph µs", "fused eager µs", "algo",
           "unfused graph µs", "unfused eager µs", "speedup", "#wrong"]


def table_rows(rows: list[dict]) -> list[list[str]]:
    by_tokens: dict = {}
    for r in rows:
        side = "unfused" if r["impl"] == "unfused" else "fused"
        by_tokens.setdefault(r["tokens"], {})[(side, r["mode"])] = r
    out = []
    for tokens, cells in by_tokens.items():
        def us(side, mode):
            r = cells.get((side, mode))
            return None if r is None or r.get("error") else r["median_us"]
        any_row = next(iter(cells.values()))
        fused = us("fused", "graph") or us("fused", "eager")
        unfused = us("unfused", "graph") or us("unfused", "eager")
        wrong = [r["wrong"] for r in cells.values() if r.get("wrong") is not None]
        algo = next((r["algo"] for (side, _), r in cells.items() if side == "fused"), "-")
        out.append([str(tokens), console.fmt_bytes(any_row["bytes"]), any_row["dtype"],
                    console.fmt_us(us("fused", "graph")), console.fmt_us(us("fused", "eager")),
                    algo,
                    console.fmt_us(us("unfused", "graph")), console.fmt_us(us("unfused", "eager")),
                    f"{unfused / fused:.2f}x" if fused and unfused else "-",
                    str(sum(wrong)) if wrong else "-"])
    return out


def print_result(result: dict) -> None:
    print(f"# llcomm bench fused  {result['machine']}  backend {result['backend']}  "
          f"hidden {result['hidden']}  commit {str(result['commit'])[:10]}")
    console.print_table(f"{OP} vs all_reduce + add + rms_norm (median µs per op)", HEADERS,
                  table_rows(result["rows"]))
    for r in result["rows"]:
        if r.get("error"):
            print(f"  {r['impl']} {r['mode']} {r['tokens']} tokens: {r['error']}")


# -- command line -------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                   help="comma list of token counts (default 1,8,32,64,128)")
    p.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN,
                   help=f"row length (default {DEFAULT_HIDDEN})")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16, float32")
    options.add_graph_ops_argument(p)
    p.add_argument("--backend", choices=("auto", "peer", "reference"), default="auto",
                   help="llcomm Communicator backend (default auto)")
    options.add_run_arguments(p, iters=TP.DEFAULT_ITERS, warmup=TP.DEFAULT_WARMUP)


def config_from_args(a) -> Config:
    """Validate every argument; raise one ValueError naming each problem."""
    problems, tokens = [], []
    try:
        tokens = options.parse_ints(a.tokens, "--tokens")
    except ValueError as e:
        problems.append(str(e))
    try:
        options.parse_dtype(a.dtype)
    except ValueError as e:
        problems.append(str(e))
    if a.hidden < 1:
        problems.append("--hidden must be at least 1")
    if a.graph_ops < 1:
        problems.append("--graph-ops must be at least 1")
    options.check_run_arguments(a, problems)
    if problems:
        raise ValueError("; ".join(problems))
    dtype = options.dtype_name(options.parse_dtype(a.dtype))
    return Config(tokens=tokens, hidden=a.hidden, dtype=dtype,
                  iters=a.iters, warmup=a.warmup, graph_ops=a.graph_ops, backend=a.backend,
                  seed=a.seed, progress=not a.no_progress)


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

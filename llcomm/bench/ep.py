"""``llcomm bench ep``: MoE dispatch / combine of ``llcomm.EPBuffer``, the peer backend against
the reference backend on NCCL, in the same run, on the same inputs, every result checked.

Per tokens-per-rank value (default 1, 32, 128, 256, 512; DeepSeek-V3's MoE: hidden 7168, 256
experts, top-8; bf16), on GPUs (one process per GPU, NCCL):

- ``llcomm``: ``EPBuffer(backend="peer")``, CUDA-graph mode and eager mode;
- ``reference``: ``EPBuffer(backend="reference")``, ``all_to_all_single`` on NCCL, same modes
  (a graph that cannot be captured gives a row with an ``error``, the eager row still runs).

On CPU (two gloo processes) only the reference runs, eagerly, with small default shapes.

Routing is uniform: each token's top-k experts are distinct and drawn uniformly (the top-k of
uniform random scores), weights are uniform and sum to 1. ``bytes`` is the payload one rank sends
(mean over ranks): a row of ``hidden`` values per (token, destination rank holding at least one
of its experts). Combine sends as many partial rows back (exactly, summed over ranks), so both ops
report the same ``bytes``; GB/s = bytes / time.

Correctness (``wrong``, summed over ranks), from every rank's inputs gathered by torch.distributed:
- dispatch, byte for byte: ``recv_count`` and, for each local expert, the rows of the tokens that
  chose it in source-rank then token order, and their ``src_info``;
- combine, bit for bit: the experts are a stand-in ``y = x * scale[g] + bias[g]`` per global expert
  ``g`` (fp32, rounded to bf16), the expected output is the documented combine arithmetic
  (docs/ep.md: per expert rank the k-order fp32 fold, rounded; then the rank-order fold, rounded)
  computed at the source from its own tokens. The reference backend implements exactly that, so
  the llcomm rows are checked against the reference's result and the reference rows against the
  oracle. Outputs are NaN-poisoned before the first call and before the timed loop.

``--fp8`` adds ``dispatch_fp8`` rows: ``dispatch(..., use_fp8=True)`` (``--round-scale``: with
``round_scale=True``) on the same buffers and inputs, timed alone (a combine after it would be the
bf16 combine above, fed by dequantised rows). Checked byte for byte: ``recv_count``,
``src_info``, and each row's e4m3 codes and fp32 scales against ``ep_oracle.fp8_oracle``, a
quantiser written independently of ``llcomm.runtime.fp8_format`` (a nearest-value search over
the e4m3 table, ties to the even code, ``frexp`` for the power-of-two scales), so both backends
are held to the same bytes. ``bytes`` counts ``hidden + hidden / 32`` per (token, destination rank).

``--ranks-per-host N`` declares hosts of N consecutive ranks (``LLCOMM_EP_RANKS_PER_HOST``, set in
every rank before its buffers are made), so that one machine runs the multi-host path
(docs/multihost.md): the reference backend on its two-level exchange, with its combine checked
against the two-level order; on GPUs the ``llcomm`` rows are the two-level kernels on SHMEM
(``backend="peer"`` across hosts; where they cannot run, the reason is printed and only the
reference runs); on CPU the kernels run in Triton's interpreter (``ep_interp``: ``interpreter``
rows, checked, not timed). Those rows carry ``inter_host_bytes`` (what the call put across hosts
as the backend counted it: ``EPBuffer.last_inter_host_bytes``, mean over ranks) beside what one
copy per (token, GPU) and per (token, expert) would have put (``per_gpu_bytes``,
``per_expert_bytes``: payload rows only, counted from the routing), and a table of them is
printed.

``--overlap`` adds ``overlap_step`` rows: a decode step of two micro-batches A and B (``tokens``
each per rank), run with ``return_recv_hook=True`` (algo ``recv_hook``) and without (``plain``),
the same calls in the same order::

    dispatch A send | compute | hook    (the compute stands for B's attention)
    dispatch B send | compute | hook    (A's experts)
    combine A send  | compute | hook    (B's experts)
    combine B send  | compute | hook    (A's next attention)

Without hooks each exchange completes before the compute starts; with them the compute runs
while the bytes travel and the peers catch up. ``compute`` is one ``[tokens, hidden] x [hidden,
hidden]`` matmul in the buffer dtype (the weights dominate at small batches: 100 MB at hidden
7168). The experts are the identity (combine reads ``recv_x`` in place), so both micro-batches'
combine results are checked bit for bit against the combine oracle above with ``y = x``; hooked
and plain steps must therefore agree with each other too. One row per variant, ``median_us`` per
step; the ``recv_hook`` row adds ``saving_us`` = plain - hooked (same impl and mode). The step
holds no host synchronisation, so it is captured in a CUDA graph like the single ops.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import console, ep_interp, ep_model_cli, options, result_files, spawn, timing, verify
from .ep_oracle import FP8_BLOCK, Expected, expert_affine, run_experts, uniform_routing
from .ep_report import OVERLAP_OP, print_result
from .timing import Impl
from ..errors import UnsupportedConfigError
from ..runtime.hosts import RANKS_PER_HOST_ENV

DEFAULT_ITERS = 50
DEFAULT_WARMUP = 5
#: (tokens per rank, hidden, experts, topk) on GPUs, and the tiny CPU defaults.
GPU_SHAPE = ("1,32,128,256,512", 7168, 256, 8)
CPU_SHAPE = ("1,8,32", 256, 16, 4)
#: Micro-batches of the ``--overlap`` step.
MICRO_BATCHES = 2
DTYPE = torch.bfloat16


@dataclass
class Config:
    tokens: list[int]
    hidden: int
    experts: int
    topk: int
    iters: int = DEFAULT_ITERS
    warmup: int = DEFAULT_WARMUP
    graph_ops: int = timing.GRAPH_OPS
    seed: int = 0
    progress: bool = True
    fp8: bool = False
    round_scale: bool = False
    overlap: bool = False
    max_tokens: int = 0         # the buffer's num_max_dispatch_tokens_per_rank; 0: max(tokens)
    carry_weights: bool = False  # dispatch(topk_weights=w), combine(..., None, handle)
    ranks_per_host: int = 0     # declared hosts (LLCOMM_EP_RANKS_PER_HOST); 0: detected

    @property
    def buffer_tokens(self) -> int:
        return self.max_tokens or max(self.tokens)


# -- one token count ---------------------------------------------------------------------------
def _impls(buf, name: str, x, idx, w, exp: Expected, ref_out, scale, bias, R,
           carry: bool = False) -> list[Impl]:
    """The dispatch and the combine of one buffer; combine runs on a handle of its own dispatch.
    ``carry``: the dispatches carry the weights (``topk_weights=w``), the combine takes None."""
    wd, wc = (w, None) if carry else (None, w)
    shape = (buf.num_local_experts, buf.num_ranks * buf.max_tokens, buf.hidden)
    recv = torch.zeros(shape, dtype=DTYPE, device=R.device)
    got = {}

    def dispatch():
        got["d"] = buf.dispatch(x, idx, out=recv, topk_weights=wd)
    d = Impl(name, "ll", dispatch, reset=lambda: verify.poison_(recv),
             check=lambda: exp.dispatch_wrong(*got["d"]), raise_errors=buf.check)
    recv_c = torch.zeros_like(recv)
    out = torch.empty_like(x)
    state = {}

    def prepare():  # a dispatch of its own: the handle lives until this buffer's next two
        rx, rc, state["h"] = buf.dispatch(x, idx, out=recv_c, topk_weights=wd)
        state["y"] = run_experts(rx, rc, scale, bias, R.rank)
        verify.poison_(out)

    expected = exp.combine if ref_out is None else ref_out
    c = Impl(name, "ll", lambda: buf.combine(state["y"], idx, wc, state["h"], out=out),
             reset=lambda: verify.poison_(out), check=lambda: verify.count_wrong(out, expected),
             raise_errors=buf.check)
    return [d, (prepare, c)]


def _fp8_impl(buf, name: str, x, idx, exp: Expected, round_scale: bool, R) -> Impl:
    """``dispatch(..., use_fp8=True)`` of one buffer into preallocated codes and scales."""
    shape = (buf.num_local_experts, buf.num_ranks * buf.max_tokens, buf.hidden)
    recv = (torch.zeros(shape, dtype=torch.float8_e4m3fn, device=R.device),
            torch.zeros(shape[:2] + (buf.hidden // FP8_BLOCK,), dtype=torch.float32,
                        device=R.device))
    got = {}

    def dispatch():
        got["d"] = buf.dispatch(x, idx, out=recv, use_fp8=True, round_scale=round_scale)

    def reset():
        for t in recv:
            verify.poison_(t)
    return Impl(name, "ll", dispatch, reset=reset, raise_errors=buf.check,
                check=lambda: exp.dispatch_fp8_wrong(*got["d"], round_scale))


class OverlapStep:
    """The ``--overlap`` decode step of two micro-batches on one buffer (module doc)."""

    def __init__(self, buf, mbs, weight, hooks: bool):
        self.buf, self.mbs, self.weight, self.hooks = buf, mbs, weight, hooks
        shape = (buf.num_local_experts, buf.num_ranks * buf.max_tokens, buf.hidden)
        self.recv = [torch.zeros(shape, dtype=buf.dtype, device=buf.device) for _ in mbs]
        self.out = [torch.zeros_like(x) for x, _, _ in mbs]
        self.act = [torch.zeros_like(x) for x, _, _ in mbs]

    def compute(self, i: int) -> None:
        """Stand-in for micro-batch i's attention or experts: one matmul, result unused."""
        torch.matmul(self.mbs[i][0], self.weight, out=self.act[i])

    def _dispatch(self, i: int):
        x, idx, _ = self.mbs[i]
        r = self.buf.dispatch(x, idx, out=self.recv[i], return_recv_hook=self.hooks)
        return r[2], (r[3] if self.hooks else _nothing)

    def _combine(self, i: int, handle):
        _, idx, w = self.mbs[i]
        r = self.buf.combine(self.recv[i], idx, w, handle, out=self.out[i],
                             return_recv_hook=self.hooks)
        return r[1] if self.hooks else _nothing

    def __call__(self) -> None:
        # One stream, time going right. With hooks a send half returns at once and the compute
        # after it runs while its bytes travel; its hook then waits only for what is missing:
        #   dispatch A  send [compute B] recv
        #   dispatch B                        send [compute A] recv
        #   combine A                                               send [compute B] recv
        #   combine B                                                    ...  send [compute A] recv
        # Without hooks each "send ... recv" is one call that ends before the compute starts.
        a, b = 0, 1
        ha, hook = self._dispatch(a)
        self.compute(b)                 # B's attention
        hook()
        hb, hook = self._dispatch(b)
        self.compute(a)                 # A's experts
        hook()
        hook = self._combine(a, ha)
        self.compute(b)                 # B's experts
        hook()
        hook = self._combine(b, hb)
        self.compute(a)                 # A's attention, next layer
        hook()

    def reset(self) -> None:
        for t in self.recv + self.out:
            verify.poison_(t)


def _nothing() -> None:
    """The hook of a call made without ``return_recv_hook``: it has already finished."""


def _overlap_impls(buf, name: str, mbs, expected, weight) -> list[Impl]:
    """The ``--overlap`` step of one buffer with and without receive hooks."""
    impls = []
    for hooks in (False, True):
        step = OverlapStep(buf, mbs, weight, hooks)
        impls.append(Impl(
            name, "recv_hook" if hooks else "plain", step, reset=step.reset,
            check=lambda step=step: sum(verify.count_wrong(o, e)
                                        for o, e in zip(step.out, expected)),
            raise_errors=buf.check,
            extra={"recv_hook": hooks, "micro_batches": len(mbs)}))
    return impls


class Rank:
    def __init__(self, rank: int, world: int, cfg: Config):
        import os

        from llcomm import EPBuffer

        if cfg.ranks_per_host:      # read by every EPBuffer this process makes
            os.environ[RANKS_PER_HOST_ENV] = str(cfg.ranks_per_host)
        self.rank, self.world, self.cfg = rank, world, cfg
        self.cuda = dist.get_backend() == "nccl"
        self.device = torch.device("cuda", rank) if self.cuda else torch.device("cpu")
        self.timing = timing.Timing(self.device, cfg.iters, cfg.warmup,
                               cfg.graph_ops if self.cuda else 1)
        kw = dict(num_experts=cfg.experts, hidden=cfg.hidden,
                  num_max_dispatch_tokens_per_rank=cfg.buffer_tokens, dtype=DTYPE)
        self.bufs = {"reference": EPBuffer(backend="reference", **kw)}
        self.hosts = self.bufs["reference"].hosts
        if self.cuda:   # across hosts "peer" is the two-level kernels on SHMEM, or refuses
            try:
                self.bufs = {"llcomm": EPBuffer(backend="peer", **kw), **self.bufs}
            except UnsupportedConfigError as e:     # on every rank alike (a collective)
                if not self.hosts.spans_hosts:
                    raise
                if rank == 0:
                    print(f"llcomm bench ep: no llcomm rows, only the reference's: {e}")
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(cfg.seed * 1_000_003 + rank)
        self.scale, self.bias = expert_affine(cfg.experts, self.device)


def run_tokens(R: Rank, n: int) -> list[dict]:
    cfg = R.cfg
    x = torch.randn(n, cfg.hidden, generator=R.gen, device=R.device,
                    dtype=torch.float32).to(DTYPE)
    idx, w = uniform_routing(n, cfg.experts, cfg.topk, R.gen, R.device)
    exp = Expected(x, idx, w, R.rank, R.world, cfg.buffer_tokens, R.scale, R.bias,
                   R.hosts.ranks_per_host)
    L = cfg.experts // R.world
    dests = torch.zeros(n, R.world, dtype=torch.bool, device=R.device)
    dests.scatter_(1, idx // L, True)
    pairs = spawn.sum_over_ranks(int(dests.sum()), R.device)      # (token, destination rank)
    nbytes = pairs * cfg.hidden * 2 // R.world
    base = {"op": None, "dtype": options.dtype_name(DTYPE), "world_size": R.world, "bytes": nbytes,
            "tokens_per_rank": n, "hidden": cfg.hidden, "num_experts": cfg.experts,
            "topk": cfg.topk, "max_tokens": cfg.buffer_tokens, "fp8": False,
            "carry_weights": cfg.carry_weights}
    rows, ref_out = [], None
    if cfg.fp8:
        fp8_bytes = pairs * (cfg.hidden + cfg.hidden // FP8_BLOCK * 4) // R.world
        fp8_base = {**base, "op": "dispatch_fp8", "bytes": fp8_bytes, "fp8": True,
                    "round_scale": cfg.round_scale}
    for name in reversed(list(R.bufs)):            # reference first: its combine is the oracle
        buf = R.bufs[name]
        d, (prepare, c) = _impls(buf, name, x, idx, w, exp, ref_out, R.scale, R.bias, R,
                                 cfg.carry_weights)
        rows += _with_bytes(R, buf, timing.time_impl(d, {**base, "op": "dispatch"}, R.timing),
                            idx, cfg.hidden * DTYPE.itemsize)
        for mode in c.modes:
            err = [None]
            if not spawn.attempt(prepare, err, R.device):
                rows.append({**base, "op": "combine", "impl": name, "algo": c.algo, "mode": mode,
                             "median_us": None, "p10_us": None, "p90_us": None, "wrong": None,
                             "error": f"dispatch before combine: {err[0]}"})
                continue
            one = Impl(**{**c.__dict__, "modes": (mode,)})
            rows += _with_bytes(R, buf, timing.time_impl(one, {**base, "op": "combine"},
                                                         R.timing),
                                idx, cfg.hidden * DTYPE.itemsize)
        if cfg.fp8:
            fp8 = _fp8_impl(buf, name, x, idx, exp, cfg.round_scale, R)
            rows += _with_bytes(R, buf, timing.time_impl(fp8, fp8_base, R.timing), idx,
                                cfg.hidden + cfg.hidden // FP8_BLOCK * 4)
        if name == "reference" and R.cuda:
            ref_out = _reference_combine(buf, x, idx, w, R)
    if not R.cuda and R.hosts.spans_hosts:      # the two-level kernels' own byte counts
        rows += ep_interp.interpreter_rows(
            R, x, idx, w, exp, base, lambda b, rs, ix, rb: _with_bytes(R, b, rs, ix, rb))
    if cfg.overlap:
        rows += run_overlap(R, n, {**base, "bytes": nbytes})
    return rows


def _with_bytes(R: Rank, buf, rows: list[dict], idx: torch.Tensor, row_bytes: int) -> list[dict]:
    """Across declared or detected hosts: add to ``rows`` (one op of one buffer, just timed) the
    bytes its latest call put across hosts and what one payload row per (token, GPU) and per
    (token, expert) on another host would have, each the mean over ranks. A collective."""
    if not R.hosts.spans_hosts:
        return rows
    L = R.cfg.experts // R.world
    other = (idx // L) // R.hosts.ranks_per_host != R.hosts.host_of(R.rank)    # [n, topk]
    gpus = torch.zeros(idx.shape[0], R.world, dtype=torch.bool, device=R.device)
    gpus.scatter_(1, idx // L, other)
    mean = {key: spawn.sum_over_ranks(v, R.device) // R.world for key, v in (
        ("inter_host_bytes", buf.last_inter_host_bytes),
        ("per_gpu_bytes", int(gpus.sum()) * row_bytes),
        ("per_expert_bytes", int(other.sum()) * row_bytes))}
    ledger = buf.last_wire_ledger
    if ledger is not None:      # the two-level kernels: their messages, every rank's printed
        mean["messages"] = spawn.sum_over_ranks(sum(m for m, _, _ in ledger.values()),
                                                R.device) / R.world
        everyone = [None] * R.world
        dist.all_gather_object(everyone, ledger)
        if R.rank == 0:
            ep_interp.print_wire_ledger([(led, led) for led in everyone], rows[0]["op"])
    return [{**r, **mean, "ranks_per_host": R.hosts.ranks_per_host} for r in rows]


def run_overlap(R: Rank, n: int, base: dict) -> list[dict]:
    """The ``--overlap`` rows of one token count: two micro-batches of ``n`` fresh tokens per
    rank each; ``bytes`` is what one rank sends in the whole step (mean over ranks)."""
    cfg = R.cfg
    mbs, expected, nbytes = [], [], 0
    ones = torch.ones(cfg.experts, device=R.device, dtype=torch.float32)
    zeros = torch.zeros(cfg.experts, device=R.device, dtype=torch.float32)
    L = cfg.experts // R.world
    for _ in range(MICRO_BATCHES):
        x = torch.randn(n, cfg.hidden, generator=R.gen, device=R.device,
                        dtype=torch.float32).to(DTYPE)
        idx, w = uniform_routing(n, cfg.experts, cfg.topk, R.gen, R.device)
        mbs.append((x, idx, w))
        expected.append(Expected(x, idx, w, R.rank, R.world, cfg.buffer_tokens, ones,
                                 zeros, R.hosts.ranks_per_host).combine)
        dests = torch.zeros(n, R.world, dtype=torch.bool, device=R.device)
        dests.scatter_(1, idx // L, True)
        nbytes += 2 * spawn.sum_over_ranks(int(dests.sum()), R.device) * cfg.hidden * 2 // R.world
    weight = (torch.randn(cfg.hidden, cfg.hidden, generator=R.gen, device=R.device,
                          dtype=torch.float32)
              / cfg.hidden ** 0.5).to(DTYPE)
    row = {**base, "op": OVERLAP_OP, "bytes": nbytes}
    rows = []
    for name in reversed(list(R.bufs)):
        got = []
        for impl in _overlap_impls(R.bufs[name], name, mbs, expected, weight):
            got += timing.time_impl(impl, row, R.timing)
        plain = {r["mode"]: r for r in got if not r["recv_hook"]}
        for r in got:
            p = plain.get(r["mode"])
            if r["recv_hook"] and r["median_us"] and p and p["median_us"]:
                r["saving_us"] = p["median_us"] - r["median_us"]
        rows += got
    return rows


def _reference_combine(buf, x, idx, w, R) -> torch.Tensor:
    """The reference backend's combine of these inputs (the expected llcomm combine)."""
    rx, rc, h = buf.dispatch(x, idx)
    return buf.combine(run_experts(rx, rc, R.scale, R.bias, R.rank), idx, w, h)


def rank_main(rank: int, world: int, cfg: Config):
    """One rank of ``llcomm bench ep``: rank 0 returns the result."""
    R = Rank(rank, world, cfg)
    rows = []
    with console.progress(len(cfg.tokens), "bench ep", enabled=rank == 0 and cfg.progress) as bar:
        for n in cfg.tokens:
            rows += run_tokens(R, n)
            bar.advance(f"{n} tokens")
    for buf in R.bufs.values():
        buf.close()
    if rank != 0:
        return None
    return {**result_files.result_header(world, R.device), "bench": "ep", "iters": cfg.iters,
            "warmup": cfg.warmup, "graph_ops": R.timing.ops if R.cuda else None,
            "routing": "uniform", "rows": rows}


# -- command line -------------------------------------------------------------------------------
def add_arguments(p) -> None:
    g, c = GPU_SHAPE, CPU_SHAPE
    p.add_argument("--tokens", help=f"comma list of tokens per rank (default {g[0]}; CPU {c[0]})")
    p.add_argument("--hidden", type=int, help=f"token width (default {g[1]}; CPU {c[1]})")
    p.add_argument("--experts", type=int, help=f"global experts (default {g[2]}; CPU {c[2]})")
    p.add_argument("--topk", type=int, help=f"experts per token (default {g[3]}; CPU {c[3]})")
    options.add_graph_ops_argument(p)
    p.add_argument("--fp8", action="store_true",
                   help="add dispatch_fp8 rows: dispatch(use_fp8=True), codes and scales checked "
                        "(hidden a multiple of 128)")
    p.add_argument("--round-scale", action="store_true",
                   help="with --fp8: dispatch_fp8 with round_scale=True (power-of-two scales)")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="the buffer's num_max_dispatch_tokens_per_rank (default: the largest "
                        "--tokens); the dispatch's cost depends on it, not only on the tokens sent")
    p.add_argument("--carry-weights", action="store_true",
                   help="dispatch(topk_weights=w) and combine(..., None, handle): the weights "
                        "travel with the dispatch and combine skips its weights exchange")
    p.add_argument("--overlap", action="store_true",
                   help="add overlap_step rows: a 2-micro-batch step with return_recv_hook=True "
                        "against the same step without hooks")
    p.add_argument("--ranks-per-host", type=int, default=0, metavar="N",
                   help="declare hosts of N consecutive ranks (LLCOMM_EP_RANKS_PER_HOST), so that "
                        "this machine runs the two-level exchange; prints the bytes put across "
                        "hosts next to one copy per (token, expert) (default: hosts detected)")
    options.add_run_arguments(p, iters=DEFAULT_ITERS, warmup=DEFAULT_WARMUP)
    ep_model_cli.add_arguments(p)


def config_from_args(a, on_cpu: bool) -> Config:
    """Validate every argument (defaults by where it runs); raise one ValueError naming each."""
    problems: list[str] = []
    d = CPU_SHAPE if on_cpu else GPU_SHAPE
    tokens = []
    try:
        tokens = options.parse_ints(a.tokens or d[0], "--tokens")
    except ValueError as e:
        problems.append(str(e))
    hidden, experts, topk = (v if v is not None else dv
                             for v, dv in zip((a.hidden, a.experts, a.topk), d[1:]))
    if hidden < 8 or hidden % 8:
        problems.append(f"--hidden {hidden}: expected a positive multiple of 8 (16-byte rows)")
    if experts < 1 or not 1 <= topk <= experts:
        problems.append(f"--experts {experts} --topk {topk}: expected 1 <= topk <= experts")
    if a.graph_ops < 1:
        problems.append("--graph-ops must be at least 1")
    if a.fp8 and hidden % FP8_BLOCK:
        problems.append(f"--fp8 needs --hidden to be a multiple of {FP8_BLOCK} (one scale per "
                        f"{FP8_BLOCK} channels), got {hidden}")
    if a.max_tokens < 0 or (tokens and a.max_tokens and a.max_tokens < max(tokens)):
        problems.append(f"--max-tokens {a.max_tokens}: expected 0 (the largest --tokens) or at "
                        f"least the largest --tokens ({max(tokens) if tokens else '?'})")
    if a.ranks_per_host < 0:
        problems.append(f"--ranks-per-host {a.ranks_per_host}: expected a positive number of "
                        "ranks (0: detected)")
    if a.round_scale and not a.fp8:
        problems.append("--round-scale needs --fp8 (it rounds the FP8 scales)")
    options.check_run_arguments(a, problems)
    if problems:
        raise ValueError("; ".join(problems))
    return Config(tokens=tokens, hidden=hidden, experts=experts, topk=topk, iters=a.iters,
                  warmup=a.warmup, graph_ops=a.graph_ops, seed=a.seed,
                  progress=not a.no_progress, fp8=a.fp8, round_scale=a.round_scale,
                  overlap=a.overlap, max_tokens=a.max_tokens, carry_weights=a.carry_weights,
                  ranks_per_host=a.ranks_per_host)


def run(a) -> int:
    """``llcomm bench ep``: exit status 1 if any result was wrong or an llcomm row failed."""
    if ep_model_cli.requested(a):   # the cost model or its calibration: no process starts
        return ep_model_cli.run(a)
    world, backend = spawn.plan(a.cpu)
    try:
        cfg = config_from_args(a, backend == "gloo")
        if cfg.experts % world:
            raise ValueError(f"--experts {cfg.experts} is not a multiple of the {world} ranks")
        if cfg.ranks_per_host and world % cfg.ranks_per_host:
            raise ValueError(f"--ranks-per-host {cfg.ranks_per_host} does not divide the "
                             f"{world} ranks")
    except ValueError as e:
        print(f"llcomm bench ep: {e}")
        return 2
    result = spawn.launch(rank_main, cfg, force_cpu=a.cpu,
                          multicast_off=a.no_multicast)
    print_result(result)
    result_files.write_outputs(result, a)
    bad = [r for r in result["rows"] if (r["wrong"] or 0) > 0
           or (r.get("error") and r["impl"] in ("llcomm", ep_interp.IMPL))]
    if bad:
        print(f"llcomm bench ep: {len(bad)} result rows are wrong or failed")
    return 1 if bad else 0

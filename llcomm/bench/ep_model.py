"""``llcomm bench ep --model``: the cost model of the two-level EP kernels
(``llcomm/ep/hosts/kernels/dispatch.py``, ``combine.py``; docs/multihost.md, "Cost model").

Per GPU and per call, in two parts:

- **What crosses hosts.** ``wire_counts``: the expectation under uniform routing (each token's
  top-k experts distinct and uniform), where a token has an expert on a given one of N hosts
  with probability ``1 - C(E - E/N, K) / C(E, K)``. ``wire_counts_exact``: the kernels' own
  formula from every rank's routing (docs/multihost.md, "The wire ledger"), which the tests
  hold to the ledger the kernels count in Triton's interpreter.
- **How long.** Each op as its stages in series, since the kernels wait between stages
  (``dispatch_model``, ``combine_model``), each stage timed from ``LinkParams``: a NIC stage
  ``max(bytes / bandwidth, messages / rate) + latency``; an in-host stage the peer kernels'
  2-GPU measurement scaled to the bytes it moves here (at least those bytes over NVLink); a
  local pass over HBM at its bandwidth. The longest stage limits the op.

The in-host stages are a scaling of a 2-GPU measurement, not a measurement at 8 GPUs per host,
until a calibration on a GPU replaces them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

from . import options
from ..ep.hosts.layout import ID_HEADER_WORDS
from ..ep.hosts.layout import row_bytes as slot_bytes

#: Bytes of the int64 flag word that ends every message (``kernels/rail.py``, ``FLAG``).
FLAG_BYTES = 8
#: A message's bytes are rounded up to whole 16-byte put units (``kernels/rail.py``).
PUT_ALIGN = 16
#: Bytes of an int32 top-k id or an fp32 weight.
WORD_BYTES = 4
#: Bytes per µs in one GB/s (10^9 bytes per second).
BYTES_PER_US_PER_GBPS = 1e3
#: The tables' MB (10^6 bytes).
MB = 1e6

#: GB/s each way of NVLink 4 on an H100 / H200 SXM (900 GB/s both ways: NVIDIA's datasheets).
NVLINK_GBPS = 450.0
#: GB/s of one 400 Gb/s NIC per GPU: 50 at line rate, 45 after RDMA packet headers (assumed).
NIC_GBPS = 45.0
#: µs one-way of a GPU-posted put-with-signal through one switch: assumed, not measured.
NIC_LATENCY_US = 3.0
#: Messages per second one NIC carries: assumed, below ConnectX's advertised small-write rates.
NIC_MSG_RATE = 100e6
#: GB/s of HBM3 on an H100 SXM (NVIDIA's datasheet; an H200 has 4.8 TB/s): the local passes.
HBM_GBPS = 3350.0
#: The peer kernels' FP8 dispatch on 2xH200: (payload bytes per rank, median µs) at 128 and 256
#: tokens (bench/results/h200x2-ep-b256.json, commit 68e11b7, CUDA-graph rows).
PEER_DISPATCH_FP8 = ((1_884_960, 13.2288), (3_773_616, 23.3584))
#: The peer kernels' bf16 combine on 2xH200, the same run and rows.
PEER_COMBINE_BF16 = ((3_655_680, 13.6352), (7_318_528, 24.3568))

#: The tables' shape: tokens per GPU, hidden, experts, top-k, GPUs per host (DeepSeek-V3 decode).
MODEL_SHAPE = dict(tokens=128, hidden=7168, experts=256, topk=8, ranks_per_host=8)
#: The EP sizes of the tables.
MODEL_EPS = (16, 32, 64)
#: Published dispatch / combine µs at MODEL_SHAPE (FP8 dispatch, bf16 combine), by EP: (name,
#: dispatch, combine, approximate). Their authors' figures; none was measured here. DeepEP V1:
#: the low-latency table of DeepEP's README before its version 2 (H800, CX7 400 Gb/s); the
#: layered mode: DeepEP's pull request 500, read from the request's logs.
ANCHORS = {16: (("DeepEP V1 low-latency", 118, 195, False), ("pplx-garden", 110, 186, False),
                ("NCCL EP (bf16)", 191, 201, True),
                ("DeepEP layered low-latency (PR 500)", 37, 67, True)),
           32: (("DeepEP V1 low-latency", 155, 273, False),),
           64: (("DeepEP V1 low-latency", 173, 314, False),)}
#: The project's goal, dispatch / combine µs, by EP.
GOALS = {16: (30, 55), 64: (80, 150)}


# -- what crosses hosts -----------------------------------------------------------------------
def _a16(n: int) -> int:
    return (n + PUT_ALIGN - 1) // PUT_ALIGN * PUT_ALIGN


def _check_topology(ranks: int, ranks_per_host: int, experts: int, topk: int) -> None:
    if ranks_per_host < 1 or ranks < 1 or ranks % ranks_per_host:
        raise ValueError(f"ranks_per_host={ranks_per_host}: expected a positive divisor of "
                         f"ranks={ranks}")
    if experts < 1 or experts % ranks:
        raise ValueError(f"experts={experts}: expected a positive multiple of ranks={ranks}")
    if not 1 <= topk <= experts:
        raise ValueError(f"topk={topk}: expected 1 <= topk <= experts={experts}")


def hit_probability(experts: int, parts: int, topk: int) -> float:
    """Probability that a token's ``topk`` distinct uniform experts of ``experts`` include one
    of a given ``parts``-th of them (a host's, or a rank's)."""
    return 1.0 - math.comb(experts - experts // parts, topk) / math.comb(experts, topk)


@dataclass(frozen=True)
class OpWire:
    """One op's ``(messages, flags, bytes)`` per destination host: ints from a routing, floats
    when expected. ``bytes`` is data; each flag adds FLAG_BYTES on the wire."""

    hosts: dict

    def total(self) -> tuple:
        """``(messages, flags, bytes)`` to all hosts."""
        return tuple(sum(v[i] for v in self.hosts.values()) for i in range(3))

    @property
    def wire_bytes(self):
        """Data and flags, as ``HostsPeerEP.rail_bytes`` counts them."""
        _, flags, nbytes = self.total()
        return nbytes + FLAG_BYTES * flags

    def by_rank(self, rank: int, ranks_per_host: int) -> dict:
        """Keyed by destination rank, the rail rank on each host (``HostsPeerEP.wire_ledger``)."""
        local = rank % ranks_per_host
        return {g * ranks_per_host + local: v for g, v in self.hosts.items()}


@dataclass(frozen=True)
class Wire:
    """What one GPU sends across hosts in one dispatch and one combine."""

    dispatch: OpWire
    combine: OpWire


def wire_counts(ranks: int, ranks_per_host: int, tokens: int, topk: int, experts: int,
                row_bytes: int, sum_bytes: int) -> Wire:
    """Expected messages, flags and bytes from one GPU of host 0 to each other host (all alike)
    under uniform routing: ``rows = tokens * hit_probability(experts, N, topk)`` tokens have an
    expert there, each a row of ``row_bytes`` (dispatch) and a host sum of ``sum_bytes`` back
    (combine; the rail rank there sends as many as this GPU does, by symmetry), plus one id
    block or weights block per host (``wire_counts_exact``)."""
    _check_topology(ranks, ranks_per_host, experts, topk)
    if tokens < 0:
        raise ValueError(f"tokens={tokens}: expected a count of tokens, 0 or more")
    rows = tokens * hit_probability(experts, ranks // ranks_per_host, topk)
    ids = _a16(WORD_BYTES * (ID_HEADER_WORDS + tokens * topk))
    wts = _a16(WORD_BYTES * tokens * topk)
    others = range(1, ranks // ranks_per_host)
    return Wire(OpWire({g: (rows + 1, rows + 1, rows * row_bytes + ids) for g in others}),
                OpWire({g: (rows + 1, rows + 1, rows * sum_bytes + wts) for g in others}))


def _routing(topk_idx) -> torch.Tensor:
    idx = torch.as_tensor(topk_idx, dtype=torch.int64, device="cpu")
    if idx.dim() != 2:
        raise ValueError(f"topks: expected [tokens, topk] per rank, got shape {tuple(idx.shape)}")
    return idx


def _hosts_hit(idx: torch.Tensor, experts: int, per_host: int, hosts: int) -> torch.Tensor:
    """``[tokens, hosts]`` bool: the token names an expert of the host. An id outside
    ``[0, experts)`` names none, as in the kernels."""
    host = torch.where((idx >= 0) & (idx < experts), idx // per_host, -1)
    return (host.unsqueeze(-1) == torch.arange(hosts, dtype=idx.dtype, device=idx.device)).any(1)


def wire_counts_exact(topks, rank: int, ranks_per_host: int, experts: int, row_bytes: int,
                      sum_bytes: int) -> Wire:
    """What ``rank`` sends across hosts in one call, from every rank's ``[n, K]`` top-k ids
    (``topks``), by the kernels' formula. To the rail rank on each other host g:

    - dispatch: ``rows(g) + 1`` messages and as many flags: one row of ``row_bytes`` per own
      token with an expert on g, and the id block, ``a16(4 (ID_HEADER_WORDS + n K))`` bytes;
    - combine: ``sums(g) + 1``: one host sum of ``sum_bytes`` per token of that rail rank with
      an expert on this rank's host, and the weights block, ``a16(4 n K)`` bytes;

    with ``n`` this rank's tokens and ``a16`` rounding up to 16. Nothing depends on blocks."""
    ranks = len(topks)
    mine = _routing(topks[rank])
    _check_topology(ranks, ranks_per_host, experts, mine.shape[1])
    if not 0 <= rank < ranks:
        raise ValueError(f"rank={rank}: expected 0 <= rank < {ranks}")
    hosts, per_host = ranks // ranks_per_host, experts // ranks * ranks_per_host
    host, local = divmod(rank, ranks_per_host)
    (n, k), out = mine.shape, _hosts_hit(mine, experts, per_host, hosts)
    d, c = {}, {}
    for g in range(hosts):
        if g == host:
            continue
        back = _hosts_hit(_routing(topks[g * ranks_per_host + local]), experts, per_host, hosts)
        rows, sums = int(out[:, g].sum()), int(back[:, host].sum())
        d[g] = (rows + 1, rows + 1, rows * row_bytes + _a16(WORD_BYTES * (ID_HEADER_WORDS + n * k)))
        c[g] = (sums + 1, sums + 1, sums * sum_bytes + _a16(WORD_BYTES * n * k))
    return Wire(OpWire(d), OpWire(c))


# -- how long -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class HostExchange:
    """An in-host exchange's time as ``fixed_us + bytes / gbps``, ``bytes`` the payload a GPU
    writes (its own rows included, as ``llcomm bench ep`` counts ``bytes``)."""

    fixed_us: float
    gbps: float

    @classmethod
    def fit(cls, points) -> HostExchange:
        """The line through two measured ``(bytes, µs)`` points."""
        (b0, t0), (b1, t1) = points
        per_byte = (t1 - t0) / (b1 - b0)
        return cls(t0 - b0 * per_byte, 1.0 / (per_byte * BYTES_PER_US_PER_GBPS))

    def us(self, nbytes: float) -> float:
        return self.fixed_us + nbytes / (self.gbps * BYTES_PER_US_PER_GBPS)


@dataclass(frozen=True)
class LinkParams:
    """What the stages are timed with (each default's provenance at its constant).

    The NIC's 45 GB/s is the 50 GB/s line rate of 400 Gb/s less about 10% for the headers of
    RDMA writes of a few KB: the sustained rate, not the peak, since a call's bytes are a few
    MB (DeepEP's V1 tables report 39 to 46 GB/s for its low-latency kernels at EP64 and beyond
    on such NICs). The in-host exchanges are the peer kernels' 2-GPU measurements fitted as a
    line in bytes (``HostExchange.fit``): a scaling, not a measurement at 8 GPUs per host."""

    nvlink_gbps: float = NVLINK_GBPS
    nic_gbps: float = NIC_GBPS
    nic_latency_us: float = NIC_LATENCY_US
    nic_msg_rate: float = NIC_MSG_RATE
    hbm_gbps: float = HBM_GBPS
    host_dispatch: HostExchange = HostExchange.fit(PEER_DISPATCH_FP8)
    host_combine: HostExchange = HostExchange.fit(PEER_COMBINE_BF16)

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, HostExchange):
                if not (v.fixed_us >= 0 and v.gbps > 0 and math.isfinite(v.gbps)):
                    raise ValueError(f"{f.name}={v}: expected fixed_us >= 0 and gbps > 0")
            elif not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{f.name}={v!r}: expected a positive number")


@dataclass(frozen=True)
class Shape:
    """One configuration: ``ranks`` GPUs in hosts of ``ranks_per_host``, ``tokens`` per GPU,
    FP8 dispatch rows (``fp8``) or rows of ``itemsize`` bytes, combine in ``itemsize``."""

    ranks: int
    ranks_per_host: int = MODEL_SHAPE["ranks_per_host"]
    tokens: int = MODEL_SHAPE["tokens"]
    hidden: int = MODEL_SHAPE["hidden"]
    experts: int = MODEL_SHAPE["experts"]
    topk: int = MODEL_SHAPE["topk"]
    fp8: bool = True
    itemsize: int = 2

    def __post_init__(self):
        _check_topology(self.ranks, self.ranks_per_host, self.experts, self.topk)
        if self.tokens < 1 or self.hidden < 1:
            raise ValueError(f"tokens={self.tokens}, hidden={self.hidden}: expected positive")
        if self.fp8 and self.hidden % 128:
            raise ValueError(f"hidden={self.hidden}: FP8 rows need a multiple of 128")

    @property
    def hosts(self) -> int:
        return self.ranks // self.ranks_per_host

    @property
    def row_bytes(self) -> int:
        """A dispatch row as the kernels send it (``layout.row_bytes``)."""
        return slot_bytes(self.hidden, self.itemsize, self.fp8)

    @property
    def sum_bytes(self) -> int:
        return self.hidden * self.itemsize

    @property
    def host_rows(self) -> float:
        """Rows a forwarder writes inside its host, its own included: each of the ``hosts``
        sources of its rail sends ``tokens``, each to ``ranks_per_host * P(rank hit)`` ranks;
        by symmetry also the rows a GPU receives, and the partials it sends back."""
        return self.ranks * self.tokens * hit_probability(self.experts, self.ranks, self.topk)

    def wire(self) -> Wire:
        return wire_counts(self.ranks, self.ranks_per_host, self.tokens, self.topk,
                           self.experts, self.row_bytes, self.sum_bytes)


@dataclass(frozen=True)
class Stage:
    """One stage: its name, what bounds it, the messages and bytes it moves, its time."""

    name: str
    bound: str
    messages: float
    nbytes: float
    us: float


@dataclass(frozen=True)
class OpModel:
    """One op's stages, in series."""

    op: str
    stages: tuple

    @property
    def total_us(self) -> float:
        return sum(s.us for s in self.stages)

    @property
    def limit(self) -> str:
        """The longest stage."""
        return max(self.stages, key=lambda s: s.us).name


def _link_us(nbytes: float, gbps: float) -> float:
    return nbytes / (gbps * BYTES_PER_US_PER_GBPS)


def _nic(name: str, messages: float, nbytes: float, p: LinkParams) -> Stage:
    """Messages out of this GPU's NIC: its bandwidth or its message rate, then one latency."""
    if messages == 0:
        return Stage(name, "NIC", 0, 0, 0.0)
    by_rate = messages / p.nic_msg_rate * 1e6
    by_bw = _link_us(nbytes, p.nic_gbps)
    return Stage(name, "NIC rate" if by_rate > by_bw else "NIC", messages, nbytes,
                 max(by_bw, by_rate) + p.nic_latency_us)


def _in_host(name: str, nbytes: float, over_nvlink: float, cost: HostExchange,
             p: LinkParams) -> Stage:
    """A GPU writes ``nbytes`` inside its host, ``over_nvlink`` of them to other GPUs: the
    peer kernels' cost scaled to those bytes, at least the NVLink time."""
    nv, scaled = _link_us(over_nvlink, p.nvlink_gbps), cost.us(nbytes)
    return Stage(name, "NVLink" if nv > scaled else "in host (scaled)", 0, nbytes,
                 max(nv, scaled))


def _local(name: str, nbytes: float, p: LinkParams) -> Stage:
    return Stage(name, "HBM", 0, nbytes, _link_us(nbytes, p.hbm_gbps))


def dispatch_model(s: Shape, p: LinkParams = LinkParams()) -> OpModel:
    """send: the rows and id blocks out of the NIC (``wire_counts``); forward: the rows of the
    rail's sources into the ranks of this host, and every source's ids to each of them; expand:
    the received rows read and written once into ``recv_x``. The peer kernels' measured
    dispatch includes its own copy into ``recv_x``, so forward and expand count that copy twice
    (a bias towards slower)."""
    w = s.wire().dispatch
    moved = s.host_rows * s.row_bytes
    ids = s.hosts * s.tokens * s.topk * WORD_BYTES * (s.ranks_per_host - 1)
    over = moved * (s.ranks_per_host - 1) / s.ranks_per_host + ids
    return OpModel("dispatch", (_nic("send", w.total()[0], w.wire_bytes, p),
                                _in_host("forward", moved, over, p.host_dispatch, p),
                                _local("expand", 2 * moved, p)))


def combine_model(s: Shape, p: LinkParams = LinkParams()) -> OpModel:
    """weights: one block to each other host's rail rank, then handed to this host's ranks;
    partials: each expert rank's partial per (token, source) to the token's rail rank here (the
    peer kernels' measured combine includes the fold of them, so the host sums add none);
    host sums: one per (token, other host) out of the NIC; out: each own token's host sums read
    and the output written."""
    w, n, N, R = s.wire().combine, s.tokens, s.hosts, s.ranks_per_host
    w_msgs = N - 1
    w_bytes = w_msgs * (_a16(WORD_BYTES * n * s.topk) + FLAG_BYTES)
    weights = _nic("weights", w_msgs, w_bytes, p)
    hand_out = _link_us(N * n * s.topk * WORD_BYTES * (R - 1), p.nvlink_gbps)
    part = s.host_rows * s.sum_bytes
    sums_read = n * N * hit_probability(s.experts, N, s.topk) * s.sum_bytes
    return OpModel("combine", (
        replace(weights, us=weights.us + hand_out),
        _in_host("partials", part, part * (R - 1) / R, p.host_combine, p),
        _nic("host sums", w.total()[0] - w_msgs, w.wire_bytes - w_bytes, p),
        _local("out", sums_read + n * s.sum_bytes, p)))


# -- the tables ---------------------------------------------------------------------------------
def _num(v: float, digits: int) -> str:
    return f"{v:.{digits}f}" if v else ""


def ep_table(s: Shape, p: LinkParams) -> list[str]:
    """One configuration's tables: every stage, then each op's total, its limiting stage, the
    project's goal and the published figures (at MODEL_SHAPE only)."""
    ops = (dispatch_model(s, p), combine_model(s, p))
    lines = [f"EP{s.ranks}: {s.hosts} hosts of {s.ranks_per_host} GPUs, {s.tokens} tokens per "
             f"GPU, hidden {s.hidden}, top-{s.topk} of {s.experts}; dispatch rows "
             f"{s.row_bytes} B ({'FP8' if s.fp8 else f'{s.itemsize}-byte'}), host sums "
             f"{s.sum_bytes} B", "",
             "| op | stage | bound by | messages | MB | µs |", "|---|---|---|---|---|---|"]
    for m in ops:
        lines += [f"| {m.op} | {st.name} | {st.bound} | {_num(st.messages, 1)} | "
                  f"{st.nbytes / MB:.2f} | {st.us:.1f} |" for st in m.stages]
    shape = {k: getattr(s, k) for k in MODEL_SHAPE}
    anchors = ANCHORS.get(s.ranks, ()) if shape == MODEL_SHAPE and s.fp8 else ()
    goal = GOALS.get(s.ranks) if shape == MODEL_SHAPE else None
    head = ["op", "model µs", "limited by", "goal µs", "goal"] + [a[0] for a in anchors]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, m in enumerate(ops):
        row = [m.op, f"{m.total_us:.1f}", m.limit]
        row += ([f"<= {goal[i]}", "met" if m.total_us <= goal[i] else "not met"] if goal
                else ["-", "-"])
        row += [(f"about {a[1 + i]}" if a[3] else str(a[1 + i])) for a in anchors]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def report(shapes, p: LinkParams = LinkParams()) -> str:
    """The model's printout: the parameters, then ``ep_table`` for each shape."""
    hd, hc = p.host_dispatch, p.host_combine
    lines = ["two-level EP kernels, cost model per GPU and call (docs/multihost.md, 'Cost model')",
             f"links: NVLink {p.nvlink_gbps:g} GB/s, NIC {p.nic_gbps:g} GB/s + "
             f"{p.nic_latency_us:g} µs, {p.nic_msg_rate / 1e6:g} M messages/s, "
             f"HBM {p.hbm_gbps:g} GB/s",
             f"in host: the peer kernels on 2xH200 scaled by bytes (not measured at this size): "
             f"dispatch {hd.fixed_us:.1f} µs + bytes / {hd.gbps:.0f} GB/s, combine "
             f"{hc.fixed_us:.1f} µs + bytes / {hc.gbps:.0f} GB/s"]
    for s in shapes:
        lines += [""] + ep_table(s, p)
    return "\n".join(lines)


# -- llcomm bench ep --model ----------------------------------------------------------------------
#: The flags that override LinkParams, and the field each sets.
FLAGS = {"--nvlink-gbps": "nvlink_gbps", "--nic-gbps": "nic_gbps",
         "--nic-latency-us": "nic_latency_us", "--nic-msg-rate": "nic_msg_rate"}


def add_arguments(p) -> None:
    """``--model`` and its parameters, on ``llcomm bench ep``'s parser."""
    g = p.add_argument_group("cost model", "the two-level kernels' model (docs/multihost.md)")
    g.add_argument("--model", action="store_true",
                   help="print the cost model of the two-level kernels at EP16, 32 and 64 and "
                        "exit, starting no process (--tokens, --hidden, --experts, --topk and "
                        "--ranks-per-host change the shape)")
    units = {"nvlink_gbps": "NVLink GB/s per GPU, each way", "nic_gbps": "NIC GB/s per GPU",
             "nic_latency_us": "NIC one-way latency of a message, µs",
             "nic_msg_rate": "NIC messages per second"}
    for flag, field in FLAGS.items():
        g.add_argument(flag, type=float, default=None, metavar="X",
                       help=f"with --model: {units[field]} (default "
                            f"{getattr(LinkParams(), field):g})")


def requested(a) -> bool:
    """Whether the command line asks for the model (or sets one of its parameters)."""
    return a.model or any(getattr(a, f) is not None for f in FLAGS.values())


def from_args(a) -> tuple[list[Shape], LinkParams]:
    """The shapes and parameters of the command line; one ValueError naming each bad flag."""
    problems, values = [], {}
    for flag, field in FLAGS.items():
        v = getattr(a, field)
        if v is None:
            continue
        if not (math.isfinite(v) and v > 0):
            problems.append(f"{flag} {v:g}: expected a positive number")
        elif not a.model:
            problems.append(f"{flag} needs --model")
        values[field] = v
    tokens = [MODEL_SHAPE["tokens"]]
    if a.tokens:
        try:
            tokens = options.parse_ints(a.tokens, "--tokens")
        except ValueError as e:
            problems.append(str(e))
    given = {"hidden": a.hidden, "experts": a.experts, "topk": a.topk,
             "ranks_per_host": a.ranks_per_host or None}
    shape = {k: (MODEL_SHAPE[k] if v is None else v) for k, v in given.items()}
    shapes = []
    for ep in MODEL_EPS:
        for n in tokens:
            try:
                shapes.append(Shape(ranks=ep, tokens=n, **shape))
            except ValueError as e:
                flags = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in given.items()
                                  if v is not None)
                problems.append(f"EP{ep} ({flags or 'defaults'}): {e}")
    if problems:
        raise ValueError("; ".join(dict.fromkeys(problems)))
    return shapes, LinkParams(**values)


def run(a) -> int:
    """``llcomm bench ep --model``: print the model; 2 on a bad option."""
    try:
        shapes, params = from_args(a)
    except ValueError as e:
        print(f"llcomm bench ep: {e}")
        return 2
    print(report(shapes, params))
    return 0

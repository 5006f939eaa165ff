"""The cost model of the two-level EP kernels (``llcomm/ep/hosts/kernels/dispatch.py``,
``forward.py``, ``combine.py``; docs/multihost.md, "Cost model"); ``ep_model_cli`` prints it
(``llcomm bench ep --model``).

Per GPU and per call, in two parts:

- **What crosses hosts.** ``wire_counts``: the expectation under uniform routing (each token's
  top-k experts distinct and uniform), where a token has an expert on a given one of N hosts
  with probability ``1 - C(E - E/N, K) / C(E, K)``. ``wire_counts_exact``: the kernels' own
  formula from every rank's routing (docs/multihost.md, "The wire ledger"), which the tests
  hold to the ledger the kernels count in Triton's interpreter.
- **How long.** Each op as its stages (``dispatch_model``, ``combine_model``), each timed from
  ``LinkParams``: a NIC stage ``max(bytes / bandwidth, messages / rate) + latency``; an in-host
  stage from ``InHost`` (the peer kernels' 2-GPU measurement scaled to its bytes, or a
  calibration of the stage on one GPU), at least its bytes over NVLink; a local pass over HBM
  at its bandwidth. A stage runs after the previous one, or overlaps it (``Stage.overlaps``:
  the dispatch's forward runs during the send), and ``OpModel`` derives the op's time and the
  stage that limits it from that schedule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

from ..ep.hosts.layout import ENTRY_BYTES, ID_HEADER_WORDS, fp8_sum_bytes
from ..ep.hosts.layout import row_bytes as slot_bytes
from ..ep.hosts.peer import default_num_blocks
from .ep_inhost import BYTES_PER_US_PER_GBPS, SCALED, HostExchange, InHost

#: Bytes of the int64 flag word that ends every message (``kernels/rail.py``, ``FLAG``).
FLAG_BYTES = 8
#: A message's bytes are rounded up to whole 16-byte put units (``kernels/rail.py``).
PUT_ALIGN = 16
#: Bytes of an int32 top-k id or an fp32 weight.
WORD_BYTES = 4
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
#: The tables' shape: tokens per GPU, hidden, experts, top-k, GPUs per host (DeepSeek-V3 decode).
MODEL_SHAPE = dict(tokens=128, hidden=7168, experts=256, topk=8, ranks_per_host=8)
#: The EP sizes of the tables.
MODEL_EPS = (16, 32, 64)


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


def _id_block(n: int, k: int, carry: bool) -> int:
    """Bytes of an id block: header, ids, and with ``carry`` the weights."""
    return _a16(WORD_BYTES * (ID_HEADER_WORDS + n * k * (2 if carry else 1)))


def _weights_block(n: int, k: int, carry: bool) -> int:
    """Bytes of the combine's first message: the weights, or with ``carry`` the entry."""
    return ENTRY_BYTES if carry else _a16(WORD_BYTES * n * k)


def wire_counts(ranks: int, ranks_per_host: int, tokens: int, topk: int, experts: int,
                row_bytes: int, sum_bytes: int, carry: bool = True) -> Wire:
    """Expected messages, flags and bytes from one GPU of host 0 to each other host (all alike)
    under uniform routing: ``rows = tokens * hit_probability(experts, N, topk)`` tokens have an
    expert there, each a row of ``row_bytes`` (dispatch) and a host sum of ``sum_bytes`` back
    (combine; the rail rank there sends as many as this GPU does, by symmetry), plus one id
    block and one weights block (with ``carry``: the entry) per host
    (``wire_counts_exact``)."""
    _check_topology(ranks, ranks_per_host, experts, topk)
    if tokens < 0:
        raise ValueError(f"tokens={tokens}: expected a count of tokens, 0 or more")
    rows = tokens * hit_probability(experts, ranks // ranks_per_host, topk)
    ids = _id_block(tokens, topk, carry)
    wts = _weights_block(tokens, topk, carry)
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
                      sum_bytes: int, carry: bool = False) -> Wire:
    """What ``rank`` sends across hosts in one call, from every rank's ``[n, K]`` top-k ids
    (``topks``), by the kernels' formula. To the rail rank on each other host g:

    - dispatch: ``rows(g) + 1`` messages and as many flags: one row of ``row_bytes`` per own
      token with an expert on g, and the id block, ``a16(4 (ID_HEADER_WORDS + n K))`` bytes
      (``carry``, the weights carried by the dispatch: ``a16(4 (ID_HEADER_WORDS + 2 n K))``);
    - combine: ``sums(g) + 1``: one host sum of ``sum_bytes`` per token of that rail rank with
      an expert on this rank's host, and the weights block, ``a16(4 n K)`` bytes (``carry``:
      the entry, ENTRY_BYTES);

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
        d[g] = (rows + 1, rows + 1, rows * row_bytes + _id_block(n, k, carry))
        c[g] = (sums + 1, sums + 1, sums * sum_bytes + _weights_block(n, k, carry))
    return Wire(OpWire(d), OpWire(c))


# -- how long -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinkParams:
    """What the stages are timed with (each default's provenance at its constant).

    The NIC's 45 GB/s is the 50 GB/s line rate of 400 Gb/s less about 10% for the headers of
    RDMA writes of a few KB: the sustained rate, not the peak, since a call's bytes are a few
    MB (DeepEP's V1 tables report 39 to 46 GB/s for its low-latency kernels at EP64 and beyond
    on such NICs). ``in_host``: the in-host stages' costs (``SCALED``, or a calibration)."""

    nvlink_gbps: float = NVLINK_GBPS
    nic_gbps: float = NIC_GBPS
    nic_latency_us: float = NIC_LATENCY_US
    nic_msg_rate: float = NIC_MSG_RATE
    hbm_gbps: float = HBM_GBPS
    in_host: InHost = SCALED

    def __post_init__(self):
        for f in fields(self):      # the in-host lines check themselves (HostExchange)
            v = getattr(self, f.name)
            if not isinstance(v, InHost) and not (isinstance(v, (int, float))
                                                  and math.isfinite(v) and v > 0):
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
    #: the dispatch carries the weights (``EPBuffer.dispatch(topk_weights=)``), so the combine
    #: sends only an entry flag before its host sums; False: DeepEP's API, weights at combine
    carry: bool = True
    #: the host sums cross hosts in FP8 (``combine(rail_fp8=True)``): ``fp8_sum_bytes`` each
    rail_fp8: bool = False

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
    def blocks(self) -> int:
        """Blocks of a launch (``HostsPeerEP``'s default, on a GPU of 128 SMs or more)."""
        return default_num_blocks(self.hosts, self.ranks_per_host)

    @property
    def row_bytes(self) -> int:
        """A dispatch row as the kernels send it (``layout.row_bytes``)."""
        return slot_bytes(self.hidden, self.itemsize, self.fp8)

    @property
    def sum_bytes(self) -> int:
        return self.hidden * self.itemsize

    @property
    def rail_sum_bytes(self) -> int:
        """A host sum as it crosses hosts: ``sum_bytes``, or with ``rail_fp8`` its e4m3 bytes
        and scales (``layout.fp8_sum_bytes``)."""
        return fp8_sum_bytes(self.hidden) if self.rail_fp8 else self.sum_bytes

    @property
    def host_rows(self) -> float:
        """Rows a forwarder writes inside its host, its own included: each of the ``hosts``
        sources of its rail sends ``tokens``, each to ``ranks_per_host * P(rank hit)`` ranks;
        by symmetry also the rows a GPU receives, and the partials it sends back."""
        return self.ranks * self.tokens * hit_probability(self.experts, self.ranks, self.topk)

    @property
    def rows_per_token(self) -> float:
        """Ranks of a host that a token reaching that host goes to (its rows there)."""
        return (self.ranks_per_host * hit_probability(self.experts, self.ranks, self.topk)
                / hit_probability(self.experts, self.hosts, self.topk))

    @property
    def last_batch_tokens(self) -> float:
        """Tokens of the last batch a forwarder moves after the last row arrived: one per block
        (each block walks its share in the order the sender's block put them, so the last
        arrivals are each block's last token), at most one host's tokens routed here."""
        return min(self.blocks * LAST_BATCH_TOKENS_PER_BLOCK,
                   self.tokens * hit_probability(self.experts, self.hosts, self.topk))

    def wire(self) -> Wire:
        return wire_counts(self.ranks, self.ranks_per_host, self.tokens, self.topk,
                           self.experts, self.row_bytes, self.rail_sum_bytes, self.carry)


#: Tokens per block in the last batch of an overlapping stage (``Shape.last_batch_tokens``).
LAST_BATCH_TOKENS_PER_BLOCK = 1


@dataclass(frozen=True)
class Stage:
    """One stage: its name, what bounds it, the messages and bytes it moves, its time alone
    (``us``). ``overlaps``: it starts with the previous stage instead of after it, and then
    ends no earlier than its own time from that start, nor than ``tail_us`` (its last batch)
    after the previous stage ends (``OpModel.schedule``)."""

    name: str
    bound: str
    messages: float
    nbytes: float
    us: float
    overlaps: bool = False
    tail_us: float = 0.0


@dataclass(frozen=True)
class OpModel:
    """One op's stages, each after the previous one or overlapping it (``Stage.overlaps``)."""

    op: str
    stages: tuple

    def schedule(self) -> list[tuple[float, float]]:
        """``(start, end)`` µs of each stage: after the previous one, ``start`` is its end and
        ``end = start + us``; overlapping it, ``start`` is its start and ``end = max(start +
        us, previous end + tail_us)``."""
        out: list[tuple[float, float]] = []
        for s in self.stages:
            if not out:
                start, end = 0.0, s.us
            elif s.overlaps:
                start, prev_end = out[-1][0], out[-1][1]
                end = max(start + s.us, prev_end + s.tail_us)
            else:
                start = out[-1][1]
                end = start + s.us
            out.append((start, end))
        return out

    @property
    def total_us(self) -> float:
        return self.schedule()[-1][1] if self.stages else 0.0

    def on_path_us(self) -> list[float]:
        """Per stage, the µs of ``total_us`` it accounts for on the critical path, traced back
        from the end (they sum to the total): a stage whose own time decides its end counts
        ``us`` and the path goes on from its start; an overlapping stage whose end is decided
        by the previous stage's counts ``tail_us`` and the path goes on from that stage's
        end; a stage hidden under one that overlaps it counts 0."""
        sched, path = self.schedule(), [0.0] * len(self.stages)
        i, at_end = len(self.stages) - 1, True
        while i >= 0:
            s = self.stages[i]
            if at_end:
                start, end = sched[i]
                if s.overlaps and i > 0 and end > start + s.us:
                    path[i] += s.tail_us            # the previous stage's end decided it
                    i -= 1
                    continue
                path[i] += s.us
            # at the start of stage i: an overlapping stage started with the previous one
            at_end = not s.overlaps
            i -= 1
        return path

    @property
    def limit_stage(self) -> Stage:
        """The stage with the largest share of the critical path: what limits the op."""
        path = self.on_path_us()
        return self.stages[max(range(len(path)), key=path.__getitem__)]

    @property
    def limit(self) -> str:
        return self.limit_stage.name


def _link_us(nbytes: float, gbps: float) -> float:
    return nbytes / (gbps * BYTES_PER_US_PER_GBPS)


def _nic_us(messages: float, nbytes: float, p: LinkParams) -> tuple[float, str]:
    """Messages out of this GPU's NIC: its bandwidth or its message rate (which, and the µs
    without the latency)."""
    by_rate = messages / p.nic_msg_rate * 1e6
    by_bw = _link_us(nbytes, p.nic_gbps)
    return max(by_bw, by_rate), ("NIC rate" if by_rate > by_bw else "NIC")


def _nic(name: str, messages: float, nbytes: float, p: LinkParams) -> Stage:
    """Messages out of this GPU's NIC: its bandwidth or its message rate, then one latency."""
    if messages == 0:
        return Stage(name, "NIC", 0, 0, 0.0)
    us, bound = _nic_us(messages, nbytes, p)
    return Stage(name, bound, messages, nbytes, us + p.nic_latency_us)


def _in_host(name: str, nbytes: float, over_nvlink: float, cost: HostExchange,
             p: LinkParams) -> Stage:
    """A GPU writes ``nbytes`` inside its host, ``over_nvlink`` of them to other GPUs: the
    in-host cost of those bytes, at least their NVLink time."""
    nv, own = _link_us(over_nvlink, p.nvlink_gbps), cost.us(nbytes)
    return Stage(name, "NVLink" if nv > own else p.in_host.bound, 0, nbytes, max(nv, own))


def _local(name: str, nbytes: float, p: LinkParams) -> Stage:
    return Stage(name, "HBM", 0, nbytes, _link_us(nbytes, p.hbm_gbps))


def dispatch_model(s: Shape, p: LinkParams = LinkParams()) -> OpModel:
    """send: the id blocks, then the rows, out of the NIC (``wire_counts``); forward, during
    the send: the rows of the rail's sources into the ranks of this host and every source's
    ids to each of them, its own at once and the others' as they arrive, so it ends no
    earlier than its own time nor than the last row's arrival (the send's end, latency
    included) plus the last batch (``Shape.last_batch_tokens``: one token's rows per block) at
    the stage's per-byte rate, at least over NVLink; expand, after every forwarder of the host:
    the received rows read and written once into ``recv_x``. The 2-GPU dispatch that
    ``SCALED`` fits includes its own copy into ``recv_x``, so with it forward and expand count
    that copy twice (a bias towards slower)."""
    w, R = s.wire().dispatch, s.ranks_per_host
    moved = s.host_rows * s.row_bytes
    ids = s.hosts * s.tokens * s.topk * WORD_BYTES * (R - 1)
    fwd = _in_host("forward", moved, moved * (R - 1) / R + ids, p.in_host.forward, p)
    batch = s.last_batch_tokens * s.rows_per_token * s.row_bytes
    tail = max(_link_us(batch * (R - 1) / R, p.nvlink_gbps), p.in_host.forward.per_byte_us(batch))
    return OpModel("dispatch", (_nic("send", w.total()[0], w.wire_bytes, p),
                                replace(fwd, overlaps=True, tail_us=tail),
                                _local("expand", 2 * moved, p)))


def _host_sums(s: Shape, messages: float, nbytes: float, partials_us: float,
               entry_us: float, p: LinkParams) -> Stage:
    """The host sums, overlapping the partials (``kernels/combine.py``,
    ``_partials_and_sums``): the other hosts' sources first, each forwarder's source at a
    different step in different blocks, so sums leave from the first step on (``partials_us /
    (N R)``, and not before the entry flags have come, ``entry_us``) and stream out of the NIC;
    the last one leaves after the last other host's partials (``partials_us (N - 1) / N``).
    So: the later of first step + NIC time and last other host's partials + last batch, then
    one latency. The fold of the partials (``InHost.host_sums``; without it the partials' cost
    holds it) can bound it instead. ``tail_us``: this host's own sums after the last partial,
    folded locally."""
    nic = _nic("host sums", messages, nbytes, p)
    N, R = s.hosts, s.ranks_per_host
    first = max(partials_us / (N * R), entry_us)
    batch = messages / max(1, N - 1) / R                    # one step's sums
    last = partials_us * (N - 1) / N + _nic_us(batch, batch * (s.rail_sum_bytes + FLAG_BYTES),
                                               p)[0]
    us = max(first + nic.us - p.nic_latency_us, last) + p.nic_latency_us
    own = s.tokens * hit_probability(s.experts, N, s.topk) * s.rows_per_token * s.sum_bytes / N
    fold = p.in_host.host_sums
    tail = fold.per_byte_us(own / R) if fold is not None else 0.0
    if fold is not None:
        fold_us = fold.us(s.host_rows * s.sum_bytes) + p.nic_latency_us  # each partial, once
        if fold_us > us:
            return replace(nic, bound=p.in_host.bound, us=fold_us, tail_us=tail)
    return replace(nic, us=us, tail_us=tail)


def combine_model(s: Shape, p: LinkParams = LinkParams()) -> OpModel:
    """The combine kernel's stages. With ``Shape.carry`` (the dispatch carried the weights):
    entry, one 16-byte message to each other host's rail rank, whose latency only holds back
    the first host sum; partials, each expert rank's partial per (token, source) to the
    token's rail rank here, during it. Without: weights out, one block to each other host's
    rail rank, then weights in, handed to this host's ranks, then the partials. Then host sums
    (``_host_sums``), one per (token, other host) out of the NIC, during the partials; out,
    each own token's host sums read and the output written, after them."""
    w, n, N, R = s.wire().combine, s.tokens, s.hosts, s.ranks_per_host
    w_msgs = N - 1
    w_bytes = w_msgs * (_weights_block(n, s.topk, s.carry) + FLAG_BYTES)
    part = s.host_rows * s.sum_bytes
    partials = _in_host("partials", part, part * (R - 1) / R, p.in_host.partials, p)
    sums_read = n * N * hit_probability(s.experts, N, s.topk) * s.sum_bytes
    first = _nic("entry" if s.carry else "weights out", w_msgs, w_bytes, p)
    sums = _host_sums(s, w.total()[0] - w_msgs, w.wire_bytes - w_bytes, partials.us,
                      first.us if s.carry else 0.0, p)
    if s.carry:
        head = (first, replace(partials, overlaps=True))
    else:
        hand_out = N * n * s.topk * WORD_BYTES * (R - 1)
        head = (first, Stage("weights in", "NVLink", 0, hand_out,
                             _link_us(hand_out, p.nvlink_gbps)), partials)
    return OpModel("combine", head + (
        replace(sums, overlaps=True),       # as the partials of each source complete
        _local("out", sums_read + n * s.sum_bytes, p)))

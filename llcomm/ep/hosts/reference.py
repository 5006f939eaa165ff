"""The two-level reference EP exchange: ranks grouped into hosts (``runtime/hosts.py``), one
copy of a token per (token, destination host) across hosts.

Rank ``r`` is local rank ``l`` of host ``h`` (``r = h * R + l``, ``R`` ranks per host, ``N``
hosts). Two kinds of subgroup, created once in the constructor: a *host group* per host (its R
ranks) and a *rail group* per local rank (rank l of every host). Dispatch of token t of rank s:

    1. rail:  s sends t once to each other host holding one of t's experts, to the rank of
              s's local index there (the *rail rank* of t on that host);
    2. host:  every rank forwards the tokens it holds (its own, and those its rail brought) to
              the ranks of its host that hold their experts; each (token, expert rank) pair
              arrives exactly once, tagged with its pair id ``s * T + t`` and its top-k ids;
    3. the receiver places the pairs in the experts' rows exactly as the single-level
       reference does (``reference.expand_pairs``): same rows, counts and handle.

Combine runs the route backwards. The weights go the dispatch's way (rail, then host), each
expert rank forms its partial per pair (``reference.rank_partials``: the k-order fold, rounded
once), the partials go back inside the host to the rail rank, which folds them **in rank order**
and rounds once (one host partial per (token, host)), and one message per (token, host) goes
back over the rail; the source folds the host partials **in host order** and rounds once
(docs/multihost.md, "Combine order"):

    partial[q, t]   = dtype( k-order fold over the entries of t on rank q )
    host_sum[g, t]  = dtype( fold over the ranks q of host g in rank order, t routed to q:
                               acc = acc + fp32(partial[q, t])      (fp32, acc0 = +0.0) )
    out[t]          = dtype( fold over the hosts g in order, t routed to host g:
                               acc = acc + fp32(host_sum[g, t])     (fp32, acc0 = +0.0) )

Each exchange is an ``all_to_all_single`` with split sizes on a subgroup, preceded (in the
dispatch) by a small exchange of the row counts, so exactly the rows that must cross do: the
counts are read on the host (a synchronisation on NCCL: this path is not capturable in a CUDA
graph). Every exchange is bounded as the single-level reference's are (``BoundedCalls``), and
``inter_host_bytes`` holds what the latest call put on the rail groups from this rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...runtime.bounded import BoundedCalls
from ...runtime.fp8_format import dequantize, quantize
from ...runtime.hosts import Hosts
from ..reference import ReferenceEP, expand_pairs, rank_partials, token_rows
from .layout import fp8_sum_bytes as fp8_row_bytes

#: Bytes of one row count in the dispatch's count exchange.
COUNT_BYTES = 8
#: Bytes of a row's tag beside its payload: its pair id, then its top-k global expert ids
#: (int64 each), so that the rank forwarding it and the rank receiving it can route and place it.
TAG_WORD_BYTES = 8


def tag_bytes(topk: int) -> int:
    """Bytes of the tag that travels with each dispatched row (pair id and ``topk`` ids)."""
    return TAG_WORD_BYTES * (1 + topk)


@dataclass
class Route:
    """Where the rows of one dispatch went (the handle's state): what combine retraces.

    ``rail_idx``: own token of each row sent over the rail, grouped by destination host;
    ``rail_out`` / ``rail_in``: rows sent to / received from each host. ``hold_idx``: the held
    row (own tokens first, then the rail's rows in receive order) of each row sent inside the
    host, grouped by local rank; ``host_out`` / ``host_in`` likewise. ``pairs``: pair id of each
    row received inside the host; ``row_of``: as the single-level reference's."""
    rail_idx: torch.Tensor
    rail_out: list[int]
    rail_in: list[int]
    hold_idx: torch.Tensor
    host_out: list[int]
    host_in: list[int]
    pairs: torch.Tensor
    row_of: torch.Tensor


def _pack(rows: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, row bytes + tag bytes]``: each row's bytes, then its tag's."""
    return torch.cat([rows.contiguous().view(torch.uint8), tags.contiguous().view(torch.uint8)],
                     1)


def _tags(packed: torch.Tensor, topk: int) -> torch.Tensor:
    """int64 ``[n, 1 + topk]``: the tags of ``_pack``'s rows, copied out in the contiguous
    format. Behind an FP8 row of ``H + H / 32`` bytes a tag is not 8-byte aligned, and a slice
    of 0 or 1 rows counts as contiguous, so ``.contiguous()`` (and a plain ``clone()``) keeps
    its offset or row stride, which ``view(torch.int64)`` refuses."""
    return packed[:, -tag_bytes(topk):].clone(memory_format=torch.contiguous_format).view(
        torch.int64)


class TwoLevelReferenceEP(ReferenceEP):
    """Dispatch / combine across hosts on torch.distributed subgroups (module doc). The same
    calls, outputs and handle meaning as ``ReferenceEP``; the handle's state is a ``Route``."""

    name = "reference (two-level)"

    def __init__(self, group, *, hosts: Hosts, **kw):
        super().__init__(group, **kw)
        self.hosts = hosts
        self.host = hosts.host_of(self.rank)
        self.local = hosts.local_rank(self.rank)
        # Each rank creates its own two subgroups, its host's first: with local
        # synchronisation only a subgroup's members take part (the ranks outside ``group``
        # too may stay away), and every member of one subgroup creates it at the same point.
        members = dist.get_process_group_ranks(group)
        self.host_group = dist.new_group([members[r] for r in hosts.host_ranks(self.host)],
                                         use_local_synchronization=True)
        self.rail_group = dist.new_group([members[r] for r in hosts.rail_ranks(self.local)],
                                         use_local_synchronization=True)
        bound = dict(device=self.device, checked=False)     # the call check runs on `group`
        self.host_calls = BoundedCalls(self.host_group, self.calls.timeout_ms, "EPBuffer",
                                       **bound)
        self.rail_calls = BoundedCalls(self.rail_group, self.calls.timeout_ms, "EPBuffer",
                                       **bound)
        #: bytes the latest dispatch or combine put on the rail groups from this rank
        self.inter_host_bytes = 0

    # -- exchanges -------------------------------------------------------------------------------
    def _counts(self, calls: BoundedCalls, op: str, out: list[int]) -> list[int]:
        """Rows each member sends this rank, from ``out`` (rows this rank sends each member)."""
        send = torch.tensor(out, dtype=torch.int64, device=self.device)
        if calls.world_size == 1:
            return out
        got = torch.empty_like(send)
        calls.run(op, lambda a: dist.all_to_all_single(got, send, group=calls.group,
                                                       async_op=a))
        return got.tolist()

    def _rows(self, calls: BoundedCalls, op: str, send: torch.Tensor, out: list[int],
              into: list[int]):
        """Start the exchange of ``send``'s rows (``out[i]`` to member i, ``into[i]`` from it);
        returns (wait, the received rows)."""
        got = torch.empty((sum(into),) + tuple(send.shape[1:]), dtype=send.dtype,
                          device=self.device)
        if calls.world_size == 1:
            got.copy_(send)
            return (lambda: None), got
        o, i = got.view(torch.uint8), send.contiguous().view(torch.uint8)
        return calls.start(op, lambda a: dist.all_to_all_single(
            o, i, output_split_sizes=into, input_split_sizes=out, group=calls.group,
            async_op=a)), got

    # -- dispatch --------------------------------------------------------------------------------
    def dispatch_send(self, x: torch.Tensor, topk_idx: torch.Tensor, recv_x: torch.Tensor,
                      fp8: int = 0, recv_scales: torch.Tensor | None = None,
                      weights: bool = False):
        """The send half: call check, quantise, the rail's counts, start the rail exchange.
        Returns the receive half (the host exchange and the placement)."""
        T, L = self.max_tokens, self.num_local_experts
        N, R = self.hosts.num_hosts, self.hosts.ranks_per_host
        n, K = topk_idx.shape
        dev = self.device
        valid = self._checked_routing(topk_idx, fp8, weights)
        ids = torch.where(valid, topk_idx, -1)
        pair = self.rank * T + torch.arange(n, dtype=torch.int64, device=dev)
        own = _pack(token_rows(x, fp8), torch.cat([pair.view(n, 1), ids], 1))
        # Rail: token t once to each other host g holding one of its experts.
        dest_host = torch.where(valid, ids // (L * R), -1)
        hosts = torch.arange(N, dtype=torch.int64, device=dev)
        to_host = (dest_host.unsqueeze(-1) == hosts).any(1)                           # [n, N]
        to_host[:, self.host] = False
        _, rail_idx = to_host.T.nonzero(as_tuple=True)     # host major, token order
        rail_out = to_host.sum(0).tolist()
        rail_in = self._counts(self.rail_calls, "dispatch", rail_out)
        wait, got = self._rows(self.rail_calls, "dispatch", own[rail_idx], rail_out, rail_in)
        self.inter_host_bytes = own.shape[1] * sum(rail_out) + COUNT_BYTES * (N - 1)
        return lambda: self._dispatch_in_host(wait, own, got, rail_idx, rail_out, rail_in, n, K,
                                            fp8, recv_x, recv_scales)

    def _dispatch_in_host(self, wait, own, got, rail_idx, rail_out, rail_in, n, K, fp8, recv_x,
                        recv_scales):
        L, R = self.num_local_experts, self.hosts.ranks_per_host
        P = self.world_size * self.max_tokens
        dev = self.device
        wait()
        held = torch.cat([own, got])                                # own tokens, then the rail's
        ids = _tags(held, K)[:, 1:]
        # Host: each held row to the ranks of this host that hold one of its experts.
        dest = torch.where(ids >= 0, ids // L - self.host * R, -1)  # local rank, or out of host
        local_ranks = torch.arange(R, dtype=torch.int64, device=dev)
        to_local = (dest.unsqueeze(-1) == local_ranks).any(1)       # [held, R]
        _, hold_idx = to_local.T.nonzero(as_tuple=True)             # local rank major
        host_out = to_local.sum(0).tolist()
        host_in = self._counts(self.host_calls, "dispatch", host_out)
        wait_h, mine = self._rows(self.host_calls, "dispatch", held[hold_idx], host_out, host_in)
        wait_h()
        tags = _tags(mine, K)
        pairs, ids = tags[:, 0], tags[:, 1:]
        # Placement: the pairs' rows in a dense [P, row] by pair id, as the single-level
        # exchange delivers them, then the same expansion.
        body = mine[:, :-tag_bytes(K)]
        dense = torch.zeros((P, body.shape[1]), dtype=torch.uint8, device=dev)
        dense[pairs] = body
        meta = torch.full((P, K), -1, dtype=torch.int64, device=dev)
        meta[pairs] = torch.where(ids // L == self.rank, ids - self.rank * L, -1)
        got_x = dense if fp8 else dense.view(recv_x.dtype)
        count, src, row_of = expand_pairs(got_x, meta, L, fp8, recv_x, recv_scales)
        route = Route(rail_idx, rail_out, rail_in, hold_idx, host_out, host_in, pairs, row_of)
        return count, src, route

    # -- combine ---------------------------------------------------------------------------------
    def combine(self, expert_out: torch.Tensor, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor, route: Route, out: torch.Tensor,
                carried: bool = False, rail_fp8: bool = False):
        return self.combine_send(expert_out, topk_idx, topk_weights, route, out, carried,
                                 rail_fp8)()

    def combine_send(self, expert_out: torch.Tensor, topk_idx: torch.Tensor,
                     topk_weights: torch.Tensor, route: Route, out: torch.Tensor,
                     carried: bool = False, rail_fp8: bool = False):
        """The send half: call check, the weights along the dispatch's route, this rank's
        partials, start sending them back inside the host. Returns the receive half (host
        fold, rail back, host-order fold into ``out``). ``rail_fp8``: each host sum for
        another host crosses as the kernels' FP8 (``fp8_format.quantize`` of the fp32 sum;
        its fp32 product with the scales is what arrives)."""
        P = self.world_size * self.max_tokens
        K = topk_idx.shape[1]
        self._agree("combine", K, int(carried), int(rail_fp8))
        wait, w_rail = self._rows(self.rail_calls, "combine", topk_weights[route.rail_idx],
                                  route.rail_out, route.rail_in)
        wait()
        held_w = torch.cat([topk_weights, w_rail])
        wait, w_mine = self._rows(self.host_calls, "combine", held_w[route.hold_idx],
                                  route.host_out, route.host_in)
        wait()
        got_w = torch.zeros((P, K), dtype=torch.float32, device=self.device)
        got_w[route.pairs] = w_mine
        partial = rank_partials(expert_out, route.row_of, got_w)
        wait, back = self._rows(self.host_calls, "combine", partial[route.pairs],
                                route.host_in, route.host_out)
        sent_w = topk_weights.element_size() * K * sum(route.rail_out)   # none to this host
        return lambda: self._combine_back(wait, back, topk_weights.shape[0], route, sent_w,
                                           out, rail_fp8)

    def _combine_back(self, wait, back, n, route: Route, sent_w: int, out: torch.Tensor,
                      rail_fp8: bool):
        H, dtype, dev = self.hidden, self.dtype, self.device
        held = n + sum(route.rail_in)
        wait()
        # Host fold on the rail rank: the partials of this host's ranks in rank order.
        acc = torch.zeros((held, H), dtype=torch.float32, device=dev)
        start = 0
        for count in route.host_out:            # one segment per local rank, in rank order
            idx = route.hold_idx[start:start + count]
            acc[idx] = acc[idx] + back[start:start + count].float()
            start += count
        host_sum = acc.to(dtype)
        went_here = torch.zeros(n, dtype=torch.bool, device=dev)
        went_here[route.hold_idx[route.hold_idx < n]] = True
        # Rail back: one host partial per (token, host) to the token's rank.
        leaving, row_bytes = host_sum[n:], H * dtype.itemsize
        if rail_fp8:
            leaving = dequantize(*quantize(acc[n:]), torch.float32)
            row_bytes = fp8_row_bytes(H)
        wait, from_hosts = self._rows(self.rail_calls, "combine", leaving, route.rail_in,
                                      route.rail_out)
        wait()
        self.inter_host_bytes = sent_w + row_bytes * sum(route.rail_in)
        # Source fold: the host partials in host order.
        total = torch.zeros((n, H), dtype=torch.float32, device=dev)
        start = 0
        for g, count in enumerate(route.rail_out):
            if g == self.host:
                total = torch.where(went_here.unsqueeze(1), total + host_sum[:n].float(), total)
                continue
            idx = route.rail_idx[start:start + count]
            total[idx] = total[idx] + from_hosts[start:start + count].float()
            start += count
        out.copy_(total)
        return out

    def precheck(self) -> None:
        """Raise CommBrokenError if an earlier exchange failed, on any of the three groups."""
        for calls in (self.calls, self.host_calls, self.rail_calls):
            calls.check()

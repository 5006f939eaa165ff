"""DeepEP's normal (high-throughput) mode on ``Buffer``: ``get_dispatch_layout``, ``dispatch``
and ``combine`` with DeepEP's arguments, results and handle, carried by torch.distributed's
``all_to_all_single`` over the buffer's group (a mixin of ``Buffer``; the ops are in
``normal_ops``; docs/deep_ep.md, "Normal mode").

Every call is a collective of the buffer's group. Each first exchanges a small header (what
the call moves, and whether this rank's arguments are good), so that bad arguments on one rank
raise on every rank before any row moves; a dispatch without a handle then exchanges the
counts, which the host reads (as DeepEP's normal dispatch waits for its counts), then the rows.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import validate as V
from ..runtime.hosts import resolve_hosts, this_host
from ..runtime.settings import EPSettings
from . import normal_ops as O
from .checks import PREFIX, check_bools, check_int
from .config import DEFAULT_NVL_RECV, DEFAULT_NVL_SEND, DEFAULT_RDMA_RECV, DEFAULT_RDMA_SEND
from .config import Config
from .event import EventOverlap, after
from .normal_checks import (check_bias, check_handle, check_int_arg, check_layout, check_topk,
                            check_weights, check_x)

#: Header fields every rank exchanges first: [bad, then what must agree across ranks].
HEADER_FIELDS = 9


class NormalHandle(tuple):
    """DeepEP's intranode handle: ``(rank_prefix_matrix [W, W], channel_prefix_matrix [W, C],
    recv_channel_prefix_matrix [W, C], recv_src_idx [N], is_token_in_rank [T, W],
    send_head [T, W])``, all int32 but ``is_token_in_rank`` (bool), as DeepEP's. It also keeps
    the row counts on the host (``send_splits``, ``recv_splits``, ``num_recv``), so that a
    cached dispatch and the combine need no host synchronisation; a plain tuple of the same
    tensors works too (the counts are then read from ``rank_prefix_matrix``)."""

    send_splits: list[int]
    recv_splits: list[int]
    num_recv: int


def _prefix_counts(rpm: torch.Tensor, rank: int) -> tuple[list[int], list[int]]:
    """(rows rank sends to each rank, rows it receives from each) from the rank prefix matrix
    (``rpm[i][j]``: rows ranks 0..i send to rank j)."""
    m = rpm.to(torch.int64).cpu()
    per = torch.cat([m[:1], m[1:] - m[:-1]])            # per[i][j]: rows i sends to j
    return per[rank].tolist(), per[:, rank].tolist()


class NormalMode:
    """``Buffer``'s normal-mode calls. The ``Buffer`` provides ``group``, ``rank``,
    ``group_size``, ``num_sms`` and ``_check_open``."""

    _normal_ranks_per_host: int | None = None

    # -- configs ----------------------------------------------------------------------------------
    @classmethod
    def get_dispatch_config(cls, num_ranks: int) -> Config:
        """A ``Config`` for the dispatch: ``Buffer.num_sms`` SMs (``set_num_sms``) and valid
        chunk sizes, for any number of ranks (llcomm's normal mode does not tune by them)."""
        check_int_arg("get_dispatch_config", "num_ranks", num_ranks)
        return Config(cls.num_sms, DEFAULT_NVL_SEND, DEFAULT_NVL_RECV, DEFAULT_RDMA_SEND,
                      DEFAULT_RDMA_RECV)

    @classmethod
    def get_combine_config(cls, num_ranks: int) -> Config:
        """A ``Config`` for the combine (as ``get_dispatch_config``)."""
        check_int_arg("get_combine_config", "num_ranks", num_ranks)
        return Config(cls.num_sms, DEFAULT_NVL_SEND, DEFAULT_NVL_RECV, DEFAULT_RDMA_SEND,
                      DEFAULT_RDMA_RECV)

    # -- layout -----------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's layout of a dispatch: ``(num_tokens_per_rank [W] int32,
        num_tokens_per_rdma_rank [hosts] int32 or None on one host, num_tokens_per_expert [E]
        int32, is_token_in_rank [T, W] bool, event)``. Local torch ops, except that the first
        call on a group whose hosts are not declared (``LLCOMM_EP_RANKS_PER_HOST``) learns them
        from the ranks' host names: a collective, once."""
        fn = "get_dispatch_layout"
        self._check_open(fn)
        pr = V.Problems(f"deep_ep.Buffer.{fn}")
        check_bools(pr, async_finish=async_finish,
                    allocate_on_comm_stream=allocate_on_comm_stream)
        check_topk(pr, topk_idx)
        if check_int(pr, "num_experts", num_experts, 1) and num_experts % self.group_size:
            pr.add(f"num_experts={num_experts} is not a multiple of the group's "
                   f"{self.group_size} ranks")
        rph = self._ranks_per_host()    # a collective the first time: before any raise
        pr.raise_if_any()
        _wait(previous_event)
        per_rank, per_host, per_expert, in_rank = O.dispatch_layout(
            topk_idx, num_experts, self.group_size, rph)
        event = after(topk_idx.device, async_finish, (topk_idx, per_rank, per_expert, in_rank))
        return per_rank, per_host, per_expert, in_rank, event

    def _ranks_per_host(self) -> int:
        if self._normal_ranks_per_host is None:
            declared = EPSettings.read().ranks_per_host
            if declared is not None:
                hosts = resolve_hosts("deep_ep.Buffer", [("", 0)] * self.group_size, declared)
            else:
                infos = [None] * self.group_size
                dist.all_gather_object(infos, this_host(), group=self.group)
                hosts = resolve_hosts("deep_ep.Buffer", infos, None)
            self._normal_ranks_per_host = hosts.ranks_per_host
        return self._normal_ranks_per_host

    # -- the header every call exchanges first ----------------------------------------------------
    def _agree(self, fn: str, pr: V.Problems, names: tuple[str, ...],
               values: tuple[int, ...]) -> None:
        """Exchange (bad, *values) with every rank; raise on every rank when any rank's
        arguments were bad (this rank's own ``pr`` first) or the ranks disagree."""
        vec = torch.tensor([1 if pr.items else 0, *values] + [0] * (HEADER_FIELDS - 1
                                                                  - len(values)),
                           dtype=torch.int64, device="cpu")
        got = O.gather_counts(self.group, vec).tolist()
        pr.raise_if_any()
        bad = [r for r, row in enumerate(got) if row[0]]
        if bad:
            raise ValueError(f"{PREFIX}.{fn}: rank(s) {bad} passed bad arguments (their own "
                             "error names them); nothing was sent")
        for i, name in enumerate(names, start=1):
            seen = {row[i] for row in got}
            if len(seen) > 1:
                raise ValueError(f"{PREFIX}.{fn}: the ranks disagree on {name}: " + ", ".join(
                    f"rank {r} has {row[i]}" for r, row in enumerate(got)) + "; every rank "
                    "must make the same call")

    # -- dispatch ---------------------------------------------------------------------------------
    def dispatch(self, x, handle: tuple | None = None,
                 num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None,
                 is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Config | None = None, previous_event: EventOverlap | None = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's normal dispatch (docs/deep_ep.md, "Normal mode").

        ``x`` is ``[T, hidden]`` (bf16, or any float dtype) or an FP8 tuple ``(values
        [T, hidden] float8_e4m3fn, scales [T, hidden // 128] float32 or int32, any strides)``.
        Without ``handle``: ``num_tokens_per_rank``, ``is_token_in_rank`` and
        ``num_tokens_per_expert`` as ``get_dispatch_layout`` gives them, with optional
        ``topk_idx`` / ``topk_weights`` (together). With ``handle`` (a cached dispatch): the
        same rows as that dispatch, without top-k.

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event)``: rows in (source rank, token) order; top-k as local expert indices
        (-1 where the expert is on another rank, weight 0 there); the list of rows per local
        expert rounded up to ``expert_alignment`` (empty with ``num_worst_tokens``, which pads
        every result to that many rows, top-k -1). A cached dispatch returns None for the
        top-k, the list and the handle, as DeepEP's. ``num_tokens_per_rdma_rank``,
        ``config``'s chunk sizes and ``allocate_on_comm_stream`` are checked and not needed.
        """
        fn = "dispatch"
        self._check_open(fn)
        pr = V.Problems(f"deep_ep.Buffer.{fn}")
        check_bools(pr, async_finish=async_finish,
                    allocate_on_comm_stream=allocate_on_comm_stream)
        check_int(pr, "expert_alignment", expert_alignment, 1)
        check_int(pr, "num_worst_tokens", num_worst_tokens, 0)
        config = self._config(pr, config, "get_dispatch_config")
        vals, scales = check_x(pr, x)
        T = vals.shape[0] if vals is not None else 0
        W = self.group_size
        cached = handle is not None
        if cached:
            if topk_idx is not None or topk_weights is not None:
                pr.add("a cached dispatch (handle given) takes no topk_idx / topk_weights")
            handle = check_handle(pr, handle, W, T)
        else:
            check_layout(pr, W, T, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert)
            if (topk_idx is None) != (topk_weights is None):
                pr.add("topk_idx and topk_weights go together: pass both or neither")
            elif topk_idx is not None and check_topk(pr, topk_idx, T):
                check_weights(pr, topk_weights, topk_idx)
            if isinstance(num_worst_tokens, int) and num_worst_tokens and topk_idx is None:
                pr.add("num_worst_tokens needs topk_idx and topk_weights (as DeepEP's)")
        E = num_tokens_per_expert.numel() if isinstance(num_tokens_per_expert,
                                                        torch.Tensor) else 0
        K = topk_idx.shape[1] if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 else 0
        row_bytes = vals.shape[1] * vals.element_size() if vals is not None and vals.dim() == 2 \
            else 0
        self._agree(fn, pr, ("cached", "fp8", "row bytes", "num_experts", "topk",
                             "num_sms (config)", "num_worst_tokens", "CUDA tensors"),
                    (int(cached), int(scales is not None), row_bytes, E, K,
                     config.num_sms if config else 0,
                     num_worst_tokens if isinstance(num_worst_tokens, int) else 0,
                     int(vals is not None and vals.is_cuda)))
        device = vals.device
        _wait(previous_event)
        C = config.num_channels
        if cached:
            in_rank = handle[4]
            send, recv, n = _counts_of(handle, self.rank)
            rows = self._move(vals, scales, in_rank, None, None, 0, send, recv)
            out = _fit(rows[0], max(n, handle[3].shape[0]))
            got = (out, _fit(rows[1], out.shape[0])) if scales is not None else out
            event = after(device, async_finish, (vals, scales, got))
            return got, None, None, None, None, event
        in_rank = is_token_in_rank
        L = E // W
        mine = torch.cat([
            (num_tokens_per_rank.to(torch.int64) != in_rank.sum(dim=0)).any().view(1).long(),
            in_rank.sum(dim=0, dtype=torch.int64), num_tokens_per_expert.to(torch.int64),
            O.channel_counts(in_rank, C).flatten()])
        table = O.gather_counts(self.group, mine)
        mismatch = table[:, 0].nonzero().flatten().tolist()
        if mismatch:
            raise ValueError(f"{PREFIX}.{fn}: num_tokens_per_rank differs from "
                             f"is_token_in_rank.sum(0) on rank(s) {mismatch}; pass the "
                             "get_dispatch_layout results together")
        per = table[:, 1:1 + W]                                  # per[s][r]: rows s -> r
        experts = table[:, 1 + W:1 + W + E].view(W, W, L)[:, self.rank].sum(dim=0)
        chans = table[:, 1 + W + E:].view(W, W, C)[:, self.rank]  # [source, channel] -> me
        send, recv = per[self.rank].tolist(), per[:, self.rank].tolist()
        n = sum(recv)
        rows = self._move(vals, scales, in_rank, topk_idx, topk_weights, L, send, recv)
        N = num_worst_tokens or n
        if num_worst_tokens and n > num_worst_tokens:
            raise ValueError(f"{PREFIX}.{fn}: this rank receives {n} rows, more than "
                             f"num_worst_tokens={num_worst_tokens}")
        recv_x = _fit(rows[0], N)
        got = (recv_x, _fit(rows[1], N)) if scales is not None else recv_x
        src_idx = _fit(rows[2], N, fill=-1).flatten()
        r_idx = r_w = None
        if topk_idx is not None:
            r_idx = _fit(rows[3], N, fill=-1)
            r_w = _fit(rows[4], N)
        counts = [] if num_worst_tokens else [
            -(-c // expert_alignment) * expert_alignment for c in experts.tolist()]
        i32 = dict(dtype=torch.int32, device=device)
        rpm = per.cumsum(dim=0).to(**i32)
        cpm = O.channel_counts(in_rank, C).cumsum(dim=1).to(**i32)
        rcpm = (chans.cumsum(dim=1) - chans).to(**i32)
        h = NormalHandle((rpm, cpm, rcpm, src_idx, in_rank, O.send_heads(in_rank, C)))
        h.send_splits, h.recv_splits, h.num_recv = send, recv, n
        event = after(device, async_finish, (vals, scales, topk_idx, topk_weights, recv_x,
                                             r_idx, r_w, *h))
        return got, r_idx, r_w, counts, h, event

    def _move(self, vals, scales, in_rank, topk_idx, topk_weights, L, send, recv):
        """This rank's rows for every rank, in (rank, token) order, exchanged: the received
        (values, scales, source token, local top-k, weights), None where not carried."""
        pairs = in_rank.T.nonzero()                     # (rank, token), rank-major
        dest, tokens = pairs[:, 0], pairs[:, 1]
        parts, specs = [vals[tokens]], [(vals.dtype, tuple(vals.shape[1:]))]
        if scales is not None:
            parts.append(scales[tokens])
            specs.append((scales.dtype, tuple(scales.shape[1:])))
        parts.append(tokens.to(torch.int32).view(-1, 1))
        specs.append((torch.int32, (1,)))
        if topk_idx is not None:
            parts += O.local_topk(topk_idx[tokens], topk_weights[tokens], dest, L)
            K = topk_idx.shape[1]
            specs += [(topk_idx.dtype, (K,)), (torch.float32, (K,))]
        got = O.unpack(O.all_to_all_rows(self.group, O.pack(parts), send, recv), specs)
        it = iter(got)
        return (next(it), next(it) if scales is not None else None, next(it),
                *((next(it), next(it)) if topk_idx is not None else (None, None)))

    # -- combine ----------------------------------------------------------------------------------
    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: torch.Tensor | None = None,
                bias=None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """DeepEP's normal combine: each token's rows back from the ranks that received it,
        **added without weights**, in fp32 in rank order, plus ``bias`` (a ``[T, hidden]``
        tensor or a pair of them, added in that order), rounded once to ``x``'s dtype.

        ``x`` is ``[N, hidden]``, row i the result for row i of the dispatch's ``recv_x`` (rows
        past the rows received, with ``num_worst_tokens``, are not read); ``topk_weights``
        ``[N, topk]`` float32 are summed the same way. Returns ``(combined_x [T, hidden],
        combined_topk_weights [T, topk] float32 or None, event)``."""
        fn = "combine"
        self._check_open(fn)
        pr = V.Problems(f"deep_ep.Buffer.{fn}")
        check_bools(pr, async_finish=async_finish,
                    allocate_on_comm_stream=allocate_on_comm_stream)
        config = self._config(pr, config, "get_combine_config")
        ok = V.check_tensor(pr, "x", x, x.device if isinstance(x, torch.Tensor) else None,
                            dtypes=None) and x.dim() == 2 and x.is_floating_point()
        if isinstance(x, torch.Tensor) and not ok and not pr.items:
            pr.add(f"x must be a 2-D float tensor [rows received, hidden], got shape "
                   f"{tuple(x.shape)} and dtype {x.dtype}", type_error=True)
        T = None
        if isinstance(handle, tuple) and len(handle) == 6 and isinstance(handle[4], torch.Tensor):
            T = handle[4].shape[0]
        handle = check_handle(pr, handle, self.group_size, T)
        N = handle[3].shape[0] if handle is not None else 0
        if ok and handle is not None and x.shape[0] != N:
            pr.add(f"x has {x.shape[0]} rows; the dispatch of this handle received {N}")
        K = 0
        if topk_weights is not None:
            if V.check_tensor(pr, "topk_weights", topk_weights, x.device if ok else None,
                              dtypes=(torch.float32,)):
                if topk_weights.dim() != 2 or topk_weights.shape[0] != N:
                    pr.add(f"topk_weights has shape {tuple(topk_weights.shape)}; expected "
                           f"[{N}, topk]")
                else:
                    K = topk_weights.shape[1]
        biases = check_bias(pr, bias, x if ok else None, T)
        self._agree(fn, pr, ("row bytes", "topk", "dtype", "CUDA tensors"),
                    (x.shape[1] * x.element_size(), K, _dtype_code(x.dtype), int(x.is_cuda))
                    if ok else (0, 0, 0, 0))
        device = x.device
        _wait(previous_event)
        send, recv, n = _counts_of(handle, self.rank)
        parts, specs = [x[:n]], [(x.dtype, (x.shape[1],))]
        if K:
            parts.append(topk_weights[:n])
            specs.append((torch.float32, (K,)))
        got = O.unpack(O.all_to_all_rows(self.group, O.pack(parts), recv, send), specs)
        in_rank = handle[4]
        acc = O.sum_back(got[0], in_rank, send, x.shape[1])
        for b in biases:
            acc += b.float()
        combined = acc.to(x.dtype)
        weights = O.sum_back(got[1], in_rank, send, K) if K else None
        event = after(device, async_finish, (x, topk_weights, combined, weights))
        return combined, weights, event

    def internode_dispatch(self, x, handle: tuple | None = None,
                           num_tokens_per_rank: torch.Tensor | None = None,
                           num_tokens_per_rdma_rank: torch.Tensor | None = None,
                           is_token_in_rank: torch.Tensor | None = None,
                           num_tokens_per_expert: torch.Tensor | None = None,
                           topk_idx: torch.Tensor | None = None,
                           topk_weights: torch.Tensor | None = None, expert_alignment: int = 1,
                           config: Config | None = None,
                           previous_event: EventOverlap | None = None,
                           async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's dispatch across hosts (its arguments, without ``num_worst_tokens``): the
        same call as ``dispatch`` here (one collective over the whole group carries every
        host), with the same handle."""
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                             is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                             expert_alignment, 0, config, previous_event, async_finish,
                             allocate_on_comm_stream)

    def internode_combine(self, x: torch.Tensor, handle: tuple,
                          topk_weights: torch.Tensor | None = None, bias=None,
                          config: Config | None = None,
                          previous_event: EventOverlap | None = None, async_finish: bool = False,
                          allocate_on_comm_stream: bool = False):
        """DeepEP's combine across hosts: the same call as ``combine`` here."""
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)

    def _config(self, pr: V.Problems, config, default: str) -> Config | None:
        if config is None:
            return getattr(self, default)(self.group_size)
        if not isinstance(config, Config):
            pr.add(f"config must be a llcomm.deep_ep.Config or None, got "
                   f"{type(config).__name__}", type_error=True)
            return None
        if config.num_sms < 2 or config.num_sms % 2:
            pr.add(f"config.num_sms={config.num_sms}; expected a positive even number (two SMs "
                   "per channel, as DeepEP's)")
            return None
        return config


def _counts_of(handle, rank: int) -> tuple[list[int], list[int], int]:
    if isinstance(handle, NormalHandle):
        return handle.send_splits, handle.recv_splits, handle.num_recv
    send, recv = _prefix_counts(handle[0], rank)
    return send, recv, sum(recv)


def _fit(t: torch.Tensor, rows: int, fill: float = 0) -> torch.Tensor:
    """``t`` with ``rows`` rows: itself, or padded with ``fill``."""
    if t.shape[0] == rows:
        return t
    out = torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    out[:t.shape[0]] = t
    return out


def _wait(previous_event) -> None:
    """The current stream waits for ``previous_event`` (an EventOverlap), if any."""
    if previous_event is not None and getattr(previous_event, "event", None) is not None:
        previous_event.event.current_stream_wait()


#: Codes of the dtypes a combine's ranks must agree on (the header carries ints).
DTYPE_CODES = {d: i for i, d in enumerate((torch.bfloat16, torch.float16, torch.float32,
                                           torch.float64))}


def _dtype_code(dtype: torch.dtype) -> int:
    return DTYPE_CODES.get(dtype, len(DTYPE_CODES))

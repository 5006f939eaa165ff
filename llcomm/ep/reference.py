"""The reference EP backend: dispatch and combine on torch.distributed ``all_to_all_single``.

The oracle of the peer kernels and the EP path on CPU (gloo); across hosts ``EPBuffer`` runs
its two-level exchange (``hosts/reference.py``), built from this module's blocks. It
shares no code with ``llcomm/ep/kernels/`` but produces the same bytes: the same ``recv_x`` rows
(per local expert: source rank major, then source token order, packed from row 0), the same
``recv_count`` and handle, and the same combine arithmetic (docs/ep.md):

    partial[rank q, token t] = round_dtype( fold over k in order, k on rank q:
                                            acc = acc + w[t, k] * y_k        (fp32, acc0 = +0.0) )
    out[t]                  = round_dtype( fold over ranks q in order, t routed to q:
                                            acc = acc + partial[q, t]       (fp32, acc0 = +0.0) )

Exchanges have fixed sizes (every rank sends ``max_tokens`` slots to every rank), so nothing
waits on the host and the whole thing can be captured in a CUDA graph on NCCL. Payloads travel
as bytes (uint8 views): byte-exact, and gloo moves no 16-bit types. ``EPBuffer`` validates
arguments before calling in here. On gloo every exchange is bounded by ``timeout_ms`` on the host
(``reference.BoundedCalls``): a peer that is gone or late raises ``CommTimeoutError``. With
``check_calls`` (default over gloo) each dispatch and combine first exchanges a small header, so
ranks that disagree about the op, ``topk``, FP8 mode, carried weights or the buffer's shapes get
``CommMismatchError`` instead of a mismatched exchange (docs/failures.md). Rank masks
(``enable_masks=True``) are peer-backend only: ``EPBuffer`` refuses them here, since a collective
cannot leave a member out.

FP8 dispatch quantises on the sender (``fp8_format.quantize``, the documented arithmetic) and moves
the e4m3 bytes and fp32 scales of each slot in one exchange, as the peer kernel does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime.fp8_format import FP8_BLOCK, quantize
from ..runtime.bounded import BoundedCalls


class ReferenceEP:
    """Dispatch / combine for one group on torch.distributed collectives."""

    name = "reference"

    def __init__(self, group, *, num_experts: int, hidden: int, max_tokens: int,
                 dtype: torch.dtype, device: torch.device, timeout_ms: int, check_calls: bool):
        self.group = group
        self.calls = BoundedCalls(group, timeout_ms, "EPBuffer", device=device,
                                  checked=check_calls)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.world_size
        self.hidden = hidden
        self.max_tokens = max_tokens
        self.dtype = dtype
        self.device = device
        # Out-of-range top-k entries seen on the device (counted, never synchronised on the hot
        # path; ``take_bad_count`` reads it).
        self._bad = torch.zeros((), dtype=torch.int64, device=device)

    def _a2a_bytes(self, op: str, out: torch.Tensor, inp: torch.Tensor) -> None:
        """all_to_all_single of equal splits along dim 0, moving raw bytes (bounded on gloo)."""
        o, i = out.view(torch.uint8), inp.view(torch.uint8)
        self.calls.run(op, lambda a: dist.all_to_all_single(o, i, group=self.group, async_op=a))

    def _a2a_start(self, op: str, out: torch.Tensor, inp: torch.Tensor):
        """``_a2a_bytes`` issued now; returns the function that waits for it."""
        o, i = out.view(torch.uint8), inp.view(torch.uint8)
        return self.calls.start(
            op, lambda a: dist.all_to_all_single(o, i, group=self.group, async_op=a))

    # -- dispatch -------------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, recv_x: torch.Tensor,
                 fp8: int = 0, recv_scales: torch.Tensor | None = None, weights: bool = False):
        """Fill ``recv_x`` (and, for ``fp8`` 1 or 2 (power-of-two scales), ``recv_scales``);
        return ``(recv_count, src_info, row_of)``. ``weights``: the dispatch carries the
        combine's weights (``EPBuffer`` keeps them; here it only enters the call check)."""
        return self.dispatch_send(x, topk_idx, recv_x, fp8, recv_scales, weights)()

    def _agree(self, op: str, topk: int, *modes: int) -> None:
        self.calls.agree(op, self.dtype, topk, *modes, self.hidden, self.max_tokens,
                         self.num_experts)

    def _checked_routing(self, topk_idx: torch.Tensor, fp8: int, weights: bool) -> torch.Tensor:
        """A dispatch's call check; returns its valid top-k entries (the out-of-range ones are
        counted on the device for ``take_bad_count``, never synchronised here)."""
        E = self.num_experts
        self._agree("dispatch", topk_idx.shape[1], fp8, int(weights))
        if self.device.type == "cuda":
            self._bad += ((topk_idx < -1) | (topk_idx >= E)).sum()
        return (topk_idx >= 0) & (topk_idx < E)

    def dispatch_send(self, x: torch.Tensor, topk_idx: torch.Tensor, recv_x: torch.Tensor,
                      fp8: int = 0, recv_scales: torch.Tensor | None = None,
                      weights: bool = False):
        """The send half: call check, quantise, build the slots, start both exchanges. Returns
        the receive half: a function that waits for them, fills the outputs and returns what
        ``dispatch`` does.

        ``row_of [W * T, K]`` int64: flat row ``e * W * T + j`` of expert_out that holds pair
        ``(s, t)``'s entry k on this rank, or -1 (what combine needs).
        """
        W, T = self.world_size, self.max_tokens
        L = self.num_local_experts
        n, K = topk_idx.shape
        dev = self.device
        valid = self._checked_routing(topk_idx, fp8, weights)
        # Token rows: slot (dest, t) = x[t] for every dest (the exchange has fixed size). FP8:
        # the slot is the row's e4m3 bytes followed by its fp32 scales' bytes.
        rows = token_rows(x, fp8)
        send_x = torch.zeros((W, T, rows.shape[1]), dtype=rows.dtype, device=dev)
        send_x[:, :n] = rows
        got_x = torch.empty_like(send_x)
        wait_x = self._a2a_start("dispatch", got_x, send_x)
        # Metadata: slot (dest, t, k) = local expert id on dest, or -1.
        dest = torch.where(valid, topk_idx // L, -1)
        local = torch.where(valid, topk_idx - dest * L, -1)
        send_m = torch.full((W, T, K), -1, dtype=torch.int64, device=dev)
        ranks = torch.arange(W, dtype=torch.int64, device=dev).view(W, 1, 1)
        send_m[:, :n] = torch.where(dest.unsqueeze(0) == ranks, local.unsqueeze(0), -1)
        meta = torch.empty_like(send_m)
        wait_m = self._a2a_start("dispatch", meta, send_m)
        return lambda: self._dispatch_recv(wait_x, wait_m, got_x, meta, n, K, fp8, recv_x,
                                           recv_scales)

    def _dispatch_recv(self, wait_x, wait_m, got_x, meta, n, K, fp8, recv_x, recv_scales):
        wait_x()
        wait_m()
        P = self.world_size * self.max_tokens
        return expand_pairs(got_x.view(P, -1), meta.view(P, K), self.num_local_experts, fp8,
                            recv_x, recv_scales)

    # -- combine --------------------------------------------------------------------------------
    def combine(self, expert_out: torch.Tensor, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor, row_of: torch.Tensor, out: torch.Tensor,
                carried: bool = False):
        return self.combine_send(expert_out, topk_idx, topk_weights, row_of, out, carried)()

    def combine_send(self, expert_out: torch.Tensor, topk_idx: torch.Tensor,
                     topk_weights: torch.Tensor, row_of: torch.Tensor, out: torch.Tensor,
                     carried: bool = False):
        """The send half (as the peer kernel's): call check, weights exchange, partials, start
        their exchange. Returns the receive half (wait, sum in rank order into ``out``, return
        it). ``carried``: the dispatch carried ``topk_weights`` (only enters the call check)."""
        W, T, H = self.world_size, self.max_tokens, self.hidden
        n, K = topk_idx.shape
        P = W * T
        dev = self.device
        self._agree("combine", K, int(carried))
        # Weights: slot (dest, t, k) = topk_weights[t, k] for every dest.
        send_w = torch.zeros((W, T, K), dtype=torch.float32, device=dev)
        send_w[:, :n] = topk_weights
        got_w = torch.empty_like(send_w)
        self._a2a_bytes("combine", got_w, send_w)
        partial = rank_partials(expert_out, row_of, got_w.view(P, K)).view(W, T, H)
        back = torch.empty_like(partial)             # slot (expert rank, t)
        wait = self._a2a_start("combine", back, partial)
        return lambda: self._combine_recv(wait, back, topk_idx, out)

    def _combine_recv(self, wait, back, topk_idx, out):
        W, H = self.world_size, self.hidden
        L, E = self.num_local_experts, self.num_experts
        n = topk_idx.shape[0]
        dev = self.device
        wait()
        valid = (topk_idx >= 0) & (topk_idx < E)
        dest = torch.where(valid, topk_idx // L, -1)
        total = torch.zeros((n, H), dtype=torch.float32, device=dev)
        for q in range(W):
            went = (dest == q).any(1, keepdim=True)
            total = torch.where(went, total + back[q, :n].float(), total)
        out.copy_(total)
        return out

    def precheck(self) -> None:
        """Raise CommBrokenError if an earlier exchange failed (timeout or lost peer)."""
        self.calls.check()

    def take_bad_count(self) -> int:
        """Out-of-range top-k entries seen since the last call (synchronises the device)."""
        bad = int(self._bad.item())
        if bad:
            self._bad.zero_()
        return bad


# -- building blocks (also of the two-level exchange, ``hosts/reference.py``) ---------------------
def token_rows(x: torch.Tensor, fp8: int) -> torch.Tensor:
    """The rows that travel for tokens ``x [n, H]``: ``x`` itself, or with ``fp8`` (1, or 2 for
    power-of-two scales) uint8 ``[n, H + H / 32]``: each row's e4m3 bytes, then its fp32 scales'
    bytes (quantised on the sender, as the peer kernel does)."""
    if not fp8:
        return x
    n, H = x.shape
    if not n:
        return torch.empty((0, H + H // FP8_BLOCK * 4), dtype=torch.uint8, device=x.device)
    q, sc = quantize(x, round_scale=fp8 == 2)
    return torch.cat([q.view(torch.uint8), sc.view(torch.uint8)], 1)


def expand_pairs(got_x: torch.Tensor, meta: torch.Tensor, L: int, fp8: int,
                 recv_x: torch.Tensor, recv_scales: torch.Tensor | None):
    """Place the received rows into the experts' rows. ``got_x [P, row]``: pair ``p = s * T +
    t``'s row (``token_rows``' format); ``meta [P, K]`` int64: its local expert per top-k entry
    on this rank, or -1. Fills ``recv_x`` (and ``recv_scales``) in the documented row order and
    returns ``(recv_count [L] int32, src_info [L, P] int32, row_of [P, K] int64)``; ``row_of``:
    flat row ``e * P + j`` of expert_out that holds pair p's entry k, or -1."""
    P, K = meta.shape
    H = recv_x.shape[-1]
    dev = meta.device
    ok = meta >= 0
    # Pair p uses local expert e (once, however often e repeats in its top-k).
    onehot = ((meta.unsqueeze(-1) == torch.arange(L, dtype=torch.int64, device=dev))
              & ok.unsqueeze(-1)).any(1)
    hits = onehot.to(torch.int64)
    rows = torch.cumsum(hits, 0) - hits          # [P, L]: row of pair p for expert e
    count = hits.sum(0)                          # [L]
    e_pk = meta.clamp(min=0)
    flat = e_pk * P + rows.gather(1, e_pk)       # [P, K]
    row_of = torch.where(ok, flat, -1)
    # Scatter pair rows to their expert rows. Entries that are not a pair's first copy of an
    # expert write the same bytes to the same row again; a pair with no local expert writes
    # expert 0's first unused row (free: that pair does not route to expert 0).
    has = ok.any(1, keepdim=True)
    first_ok = torch.argmax(ok.to(torch.int8), 1, keepdim=True)
    fallback = torch.where(has, flat.gather(1, first_ok), count[0].clamp(max=P - 1))
    target = torch.where(ok, flat, fallback)
    if fp8:
        recv_x.view(torch.uint8).view(L * P, H)[target] = got_x[:, :H].reshape(P, 1, H)
        ns = recv_scales.shape[-1]
        recv_scales.view(L * P, ns)[target] = \
            got_x[:, H:].contiguous().view(torch.float32).view(P, 1, ns)
    else:
        recv_x.view(L * P, H)[target] = got_x.view(P, 1, H)
    src_flat = torch.empty(L * P, dtype=torch.int32, device=dev)
    pair_id = torch.arange(P, dtype=torch.int32, device=dev).view(P, 1).expand(P, K)
    src_flat[target.reshape(-1)] = pair_id.reshape(-1)
    return count.to(torch.int32), src_flat.view(L, P), row_of


def rank_partials(expert_out: torch.Tensor, row_of: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """``[P, H]`` in expert_out's dtype: for each pair p, this rank's weighted sum of its
    entries, ``acc = acc + w[p, k] * y`` in k order in fp32 from +0.0, rounded once (zeros for
    a pair with no entry here). ``row_of`` as ``expand_pairs`` returns it, ``weights [P, K]``
    fp32 by pair."""
    P, K = row_of.shape
    H = expert_out.shape[-1]
    y = expert_out.view(-1, H)
    acc = torch.zeros((P, H), dtype=torch.float32, device=row_of.device)
    for k in range(K):
        r = row_of[:, k]
        yk = y[r.clamp(min=0)].float()
        acc = torch.where((r >= 0).unsqueeze(1), acc + weights[:, k:k + 1] * yk, acc)
    return acc.to(expert_out.dtype)

"""The torch ops under DeepEP's normal (high-throughput) mode in ``llcomm.deep_ep``: the layout
of a dispatch, the rows each rank sends, the one exchange of the counts and the one
``all_to_all_single`` of the rows, and the combine's sums (docs/deep_ep.md, "Normal mode").

Every rank sends its rows for rank ``r`` in token order, the ranks' blocks in rank order, so the
receiver's rows are in (source rank, token) order, as DeepEP's. Each row travels as bytes, with
whatever the call carries beside it (FP8 scales, source token index, top-k indices and
weights) packed after the values: one collective per dispatch or combine, after one exchange
of the counts (a host synchronisation, as DeepEP's own normal dispatch waits for its counts).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..runtime.backend import device_backends, reference_device

#: dtype of the counts DeepEP's layout returns and its handle holds.
COUNT_DTYPE = torch.int32


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                    ranks_per_host: int | None):
    """DeepEP's ``get_dispatch_layout``: tokens per rank ``[W]`` and per host (None on one
    host), tokens per expert ``[E]`` (int32) and ``is_token_in_rank`` ``[T, W]`` (bool). An
    entry of -1 selects nothing."""
    T, dev = topk_idx.shape[0], topk_idx.device
    per_rank_experts = num_experts // num_ranks
    valid = topk_idx >= 0
    idx = torch.where(valid, topk_idx, torch.zeros((), dtype=topk_idx.dtype, device=dev))
    per_expert = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    per_expert.scatter_add_(0, idx[valid].long(), torch.ones_like(idx[valid], dtype=torch.int64))
    rank_of = (idx // per_rank_experts).long()
    in_rank = (torch.nn.functional.one_hot(rank_of, num_ranks).bool() & valid[..., None]) \
        .any(dim=1)
    per_rank = in_rank.sum(dim=0, dtype=torch.int64)
    per_host = None
    if ranks_per_host is not None and ranks_per_host < num_ranks:
        per_host = in_rank.view(T, num_ranks // ranks_per_host, ranks_per_host).any(dim=2) \
            .sum(dim=0, dtype=torch.int64).to(COUNT_DTYPE)
    return per_rank.to(COUNT_DTYPE), per_host, per_expert.to(COUNT_DTYPE), in_rank


def channel_bounds(num_tokens: int, num_channels: int) -> list[int]:
    """Token ranges of DeepEP's channels: channel c holds tokens ``[b[c], b[c + 1])``, equal
    ranges of ``ceil(T / C)`` tokens, the last ones shorter or empty."""
    step = -(-num_tokens // num_channels) if num_channels else num_tokens
    return [min(c * step, num_tokens) for c in range(num_channels + 1)]


def channel_counts(in_rank: torch.Tensor, num_channels: int) -> torch.Tensor:
    """``[W, C]`` int64: tokens of each channel this rank sends to each rank."""
    b = channel_bounds(in_rank.shape[0], num_channels)
    cum = torch.cat([torch.zeros((1, in_rank.shape[1]), dtype=torch.int64, device=in_rank.device),
                     in_rank.to(torch.int64).cumsum(dim=0)])
    ends = cum[torch.tensor(b, dtype=torch.int64, device=in_rank.device)]
    return (ends[1:] - ends[:-1]).T.contiguous()


def send_heads(in_rank: torch.Tensor, num_channels: int) -> torch.Tensor:
    """``[T, W]`` int32: a token's position among the tokens of its channel sent to that rank,
    -1 where it is not sent (the meaning of DeepEP's ``send_head``)."""
    T, W = in_rank.shape
    b = channel_bounds(T, num_channels)
    pos = in_rank.to(torch.int64).cumsum(dim=0) - 1
    chan = torch.bucketize(torch.arange(T, dtype=torch.int64, device=in_rank.device),
                           torch.tensor(b[1:-1], dtype=torch.int64, device=in_rank.device),
                           right=True)
    starts = torch.cat([torch.zeros((1, W), dtype=torch.int64, device=in_rank.device),
                        in_rank.to(torch.int64).cumsum(dim=0)])
    first = starts[torch.tensor(b[:-1], dtype=torch.int64, device=in_rank.device)[chan]]
    return torch.where(in_rank, pos - first, torch.full_like(pos, -1)).to(COUNT_DTYPE)


def gather_counts(group, vec: torch.Tensor) -> torch.Tensor:
    """Every rank's ``vec`` (int64, the same length on every rank) as ``[W, n]`` on the CPU
    (the host reads them). The exchange runs where the group alone says
    (``reference_device``), so every rank takes the same backend whatever its arguments."""
    W = dist.get_world_size(group)
    where = reference_device(group)
    out = [torch.empty(vec.numel(), dtype=torch.int64, device=where) for _ in range(W)]
    dist.all_gather(out, vec.to(where).contiguous(), group=group)
    return torch.stack(out).cpu()


def all_to_all_rows(group, rows: torch.Tensor, send_splits: list[int],
                    recv_splits: list[int]) -> torch.Tensor:
    """``all_to_all_single`` of ``[n, B]`` byte rows: ``send_splits[r]`` rows to rank r,
    ``recv_splits[s]`` from rank s, in rank order (staged through the CPU where needed)."""
    where = _carrier(group, rows.device)
    out = torch.empty((sum(recv_splits), rows.shape[1]), dtype=rows.dtype, device=where)
    dist.all_to_all_single(out, rows.to(where).contiguous(), recv_splits, send_splits,
                           group=group)
    return out.to(rows.device)


def _carrier(group, device: torch.device) -> torch.device:
    """The device the group's collectives move: ``device`` when its backend serves that
    device type (NCCL: CUDA; gloo: CPU; a mixed ``cpu:gloo,cuda:nccl`` group: both), else the
    CPU (a gloo group holding CUDA tensors, as on one GPU shared by two ranks)."""
    return device if device.type in device_backends(group) else torch.device("cpu")


def pack(parts: list[torch.Tensor]) -> torch.Tensor:
    """``[n, B]`` uint8: each part's rows as bytes, side by side (parts are ``[n, ...]``)."""
    n = parts[0].shape[0]
    return torch.cat([p.contiguous().view(torch.uint8).reshape(
        n, math.prod(p.shape[1:]) * p.element_size())
                      for p in parts], dim=1)


def unpack(rows: torch.Tensor, specs: list[tuple[torch.dtype, tuple[int, ...]]]):
    """The parts ``pack`` joined, from their (dtype, shape of one row)."""
    out, at = [], 0
    for dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        out.append(rows[:, at:at + nbytes].contiguous().view(dtype).reshape(-1, *shape))
        at += nbytes
    return out


def local_topk(topk_idx: torch.Tensor, topk_weights: torch.Tensor, dest: torch.Tensor,
               per_rank_experts: int):
    """The top-k that rank ``dest[i]`` receives for row i: its own experts' local indices, -1
    elsewhere, and their weights, 0 elsewhere (as DeepEP sends them)."""
    lo = (dest * per_rank_experts).view(-1, 1).to(topk_idx.dtype)
    mine = (topk_idx >= lo) & (topk_idx < lo + per_rank_experts)
    idx = torch.where(mine, topk_idx - lo, torch.full_like(topk_idx, -1))
    w = torch.where(mine, topk_weights, torch.zeros_like(topk_weights))
    return idx, w


def sum_back(got: torch.Tensor, in_rank: torch.Tensor, recv_splits: list[int],
             width: int) -> torch.Tensor:
    """``[T, width]`` float32: for each token, the rows the ranks that received it sent back,
    summed in fp32 in rank order (rank r's block holds its tokens in token order)."""
    T, W = in_rank.shape
    acc = torch.zeros((T, width), dtype=torch.float32, device=got.device)
    at = 0
    for r in range(W):
        n = recv_splits[r]
        if n:
            tokens = in_rank[:, r].nonzero().flatten()
            acc.index_add_(0, tokens, got[at:at + n].float())
        at += n
    return acc

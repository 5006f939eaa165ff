"""The synthetic decode steps ``llcomm bench decode`` times: random weights, real bf16 matmuls,
the communication a tensor- or expert-parallel step does, nothing else.

**Dense TP step** (``DenseTP``), a 70B-class model (Llama-2/3-70B dims: hidden 8192, 64 query
heads and 8 KV heads of 128, MLP intermediate 28672, 80 layers) at TP = world size W. Per layer,
for a batch of B tokens (``h [B, hidden]``, the same on every rank)::

    a   = rmsnorm(h)                                  (no learned scale)
    qkv = a @ Wqkv          [B, hidden] @ [hidden, (64 + 2*8) * 128 / W]    column-parallel
    o   = qkv[:, :8192/W] @ Wo   [B, 8192/W] @ [8192/W, hidden]             row-parallel
    h   = h + all_reduce(o)                                                 join 1
    a   = rmsnorm(h)
    gu  = a @ Wgu           [B, hidden] @ [hidden, 2 * 28672 / W]           column-parallel
    d   = (silu(gu[:, :I]) * gu[:, I:]) @ Wd   [B, 28672/W] @ [28672/W, hidden]  row-parallel
    h   = h + all_reduce(d)                                                 join 2

Not in it: attention itself (no KV cache is read: the first 8192/W columns of qkv stand in for
the attention output), rotary embeddings, embedding and LM head, sampling. So the step is the
weight-streaming part of decode plus its 2 * layers all-reduces of ``[B, hidden]``. Weights are
``weight_sets`` distinct sets used by layers in turn (layer l uses set l % weight_sets): one set
is 0.86 GB per rank at W = 2, far beyond the 50 MB L2, so every layer streams its weights from
HBM as a real model does, without holding 68 GB of random numbers.

**MoE EP step** (``MoEEP``), DeepSeek-V3's MoE dims (hidden 7168, 256 routed experts, top-8) at
EP = world size, T tokens per rank (``h [T, hidden]``, different on every rank). Per layer::

    recv_x, recv_count, handle = dispatch(h, topk_idx[l], topk_weights=topk_weights[l])
    a = silu(recv_x[:, :R] @ W1)      batched over the L local experts, [R, hidden] @ [hidden, I]
    y[:, :R] = a @ W2                 [R, I] @ [I, hidden]
    h = h + combine(y, topk_idx[l], None, handle)     # the weights came with the dispatch

Routing is uniform and fixed per layer (no router matmul). R, the rows computed per expert, is
fixed (twice the mean W*T*topk/256 rows, rounded up to 8) so the step is capturable: rows past R
of a hot expert keep stale values (a timing model, not a model). The expert intermediate I
(default 192) makes a rank read as many expert-weight bytes per layer at W = 2 (128 experts x 2 x
7168 x 192 x 2 B = 705 MB) as one rank of a 32-way EP DeepSeek-V3 deployment (8 experts x 3 x
7168 x 2048 x 2 B). No shared expert, attention or dense layers.

The ``none`` variants of both steps are the same step with every join removed (TP: the partial
product is used as is; EP: the expert matmuls run on a static ``recv_x`` and the combine is left
out), so step - none is the time communication adds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

#: RMSNorm epsilon.
NORM_EPS = 1e-5


@dataclass(frozen=True)
class DenseShape:
    hidden: int = 8192
    q_heads: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 28672
    layers: int = 80


#: The tiny CPU stand-in (runs in seconds on two gloo processes).
DENSE_CPU = DenseShape(hidden=256, q_heads=4, kv_heads=2, head_dim=64, intermediate=512, layers=2)


def rmsnorm(h: torch.Tensor) -> torch.Tensor:
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + NORM_EPS)).to(h.dtype)


def _weight(rows: int, cols: int, gen, device, dtype) -> torch.Tensor:
    """[rows, cols] random, scaled by 1/sqrt(rows) so activations keep unit size."""
    w = torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32)
    return (w * rows ** -0.5).to(dtype)


class DenseTP:
    """Weights of one rank of the dense TP step (module doc); ``step`` runs it."""

    def __init__(self, shape: DenseShape, world: int, weight_sets: int, gen, device, dtype):
        s = shape
        for name, v in (("query width", s.q_heads * s.head_dim), ("KV heads", s.kv_heads),
                        ("intermediate", s.intermediate)):
            if v % world:
                raise ValueError(f"llcomm bench decode: {name} {v} does not split over {world} "
                                 "ranks")
        self.shape, self.world = s, world
        self.q_cols = s.q_heads * s.head_dim // world
        self.inter = s.intermediate // world
        qkv_cols = (s.q_heads + 2 * s.kv_heads) * s.head_dim // world
        self.sets = [{"qkv": _weight(s.hidden, qkv_cols, gen, device, dtype),
                      "o": _weight(self.q_cols, s.hidden, gen, device, dtype),
                      "gu": _weight(s.hidden, 2 * self.inter, gen, device, dtype),
                      "d": _weight(self.inter, s.hidden, gen, device, dtype)}
                     for _ in range(max(1, min(weight_sets, s.layers)))]

    def step(self, h: torch.Tensor, proj: Callable) -> torch.Tensor:
        """One decode step on ``h [B, hidden]``. ``proj(a, w)`` is a row-parallel projection
        ``a @ w`` followed by its all-reduce (or not, for the no-communication step)."""
        for layer in range(self.shape.layers):
            w = self.sets[layer % len(self.sets)]
            qkv = rmsnorm(h) @ w["qkv"]
            h = h + proj(qkv[:, :self.q_cols], w["o"])
            gu = rmsnorm(h) @ w["gu"]
            h = h + proj(F.silu(gu[:, :self.inter]) * gu[:, self.inter:], w["d"])
        return h


@dataclass(frozen=True)
class MoEShape:
    hidden: int = 7168
    experts: int = 256
    topk: int = 8
    intermediate: int = 192
    layers: int = 4


#: The tiny CPU stand-in.
MOE_CPU = MoEShape(hidden=128, experts=8, topk=2, intermediate=32, layers=2)
#: Rows computed per expert: this many times the mean, rounded up to a multiple of ROW_ALIGN.
ROW_SLACK = 2
ROW_ALIGN = 8


def expert_rows(world: int, tokens: int, shape: MoEShape) -> int:
    mean = -(-world * tokens * shape.topk // shape.experts)
    rows = -(-ROW_SLACK * mean // ROW_ALIGN) * ROW_ALIGN
    return min(rows, world * tokens)


class MoEEP:
    """Weights, routing and buffers of one rank of the MoE EP step (module doc)."""

    def __init__(self, shape: MoEShape, world: int, tokens: int, gen, device, dtype):
        s = shape
        if s.experts % world:
            raise ValueError(f"llcomm bench decode: {s.experts} experts do not split over "
                             f"{world} ranks")
        self.shape, self.tokens = s, tokens
        L = s.experts // world
        self.rows = expert_rows(world, tokens, s)
        self.w1 = [torch.stack([_weight(s.hidden, s.intermediate, gen, device, dtype)
                                for _ in range(L)]) for _ in range(s.layers)]
        self.w2 = [torch.stack([_weight(s.intermediate, s.hidden, gen, device, dtype)
                                for _ in range(L)]) for _ in range(s.layers)]
        self.routing = []
        for _ in range(s.layers):
            idx = torch.rand(tokens, s.experts, generator=gen, device=device).topk(s.topk).indices
            w = torch.rand(tokens, s.topk, generator=gen, device=device) + 0.01
            self.routing.append((idx.contiguous(), (w / w.sum(1, keepdim=True)).contiguous()))
        self.recv_shape = (L, world * tokens, s.hidden)
        self.dtype, self.device = dtype, device

    def buffers(self):
        """``(recv_x, expert_out)`` of one implementation, zeroed."""
        return (torch.zeros(self.recv_shape, dtype=self.dtype, device=self.device),
                torch.zeros(self.recv_shape, dtype=self.dtype, device=self.device))

    def _experts(self, layer: int, recv: torch.Tensor, y: torch.Tensor) -> None:
        a = F.silu(torch.bmm(recv[:, :self.rows], self.w1[layer]))
        y[:, :self.rows] = torch.bmm(a, self.w2[layer])

    def step(self, h: torch.Tensor, buf, recv: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One MoE stack on ``h [T, hidden]`` through ``buf`` (an EPBuffer), or without any
        communication when ``buf`` is None."""
        for layer in range(self.shape.layers):
            idx, w = self.routing[layer]
            if buf is None:
                self._experts(layer, recv, y)
                continue
            # the weights travel with the dispatch (the combine then skips their exchange)
            rx, _, handle = buf.dispatch(h, idx, out=recv, topk_weights=w)
            self._experts(layer, rx, y)
            h = h + buf.combine(y, idx, None, handle)
        return h

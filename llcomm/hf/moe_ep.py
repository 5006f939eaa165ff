"""Expert parallelism for transformers' own Qwen3-MoE block, tokens moved by ``llcomm.EPBuffer``
(docs/integration.md, "Real model code").

``ExpertParallelMoE(block, transport)`` stands in for a ``Qwen3MoeSparseMoeBlock``. It keeps
the block's own router (``block.gate``) on every rank and this rank's slice of the block's own
experts module (``block.experts``: transformers stores all experts' weights as 3-D tensors and
runs them in one module), and per call:

1. routes this rank's tokens with the router: ``topk_idx`` (global expert ids) and
   ``topk_weights``;
2. ``dispatch``: each token goes to the ranks of its top-k experts. Rank r holds experts
   ``[r * L, (r + 1) * L)``; what it receives is ``recv_x [L, W * T, hidden]`` (W ranks, T the
   most tokens a rank sends) with ``recv_count[e]`` valid rows for local expert e;
3. runs this rank's experts on their rows and writes each expert's outputs to its rows of the
   combine input. Two ways:

   - ``rows=None``: the experts module itself on the valid rows, each row tagged with its local
     expert, weight 1 (the same code and weights the block runs). Reading ``recv_count`` on the
     host is a sync, so this path cannot be captured in a CUDA graph.
   - ``rows=R``: every local expert on its first R rows, batched matmuls over the module's own
     weights (``grouped_experts``): no host sync, fixed shapes, capturable. Exact when R covers
     every expert's rows (R = W * T); with a smaller R the rows past R of an expert that got
     more are not computed (what a benchmark with a fixed budget of rows per expert does).
4. ``combine``: every token gets back the sum of its experts' outputs weighted by the router's
   top-k weights, in the order it was given.

The transport is the one place that speaks to llcomm: ``EPBufferTransport`` (``EPBuffer``) or
``DeepEPTransport`` (``llcomm.deep_ep.Buffer``, DeepEP's low-latency API, as an engine written
for DeepEP calls it).
Plain torch on the modules transformers built: this module imports no transformers code.
"""
from __future__ import annotations

import copy

import torch
from torch import nn


class EPBufferTransport:
    """dispatch / combine over an ``llcomm.EPBuffer`` (bf16 / fp32 rows, no FP8).

    ``carry_weights``: the top-k weights travel with the dispatch (``dispatch(topk_weights=)``)
    and the combine gets None. ``recv_out`` / ``expert_out``: fixed tensors for ``recv_x`` and
    the experts' outputs (a CUDA graph needs the same addresses on every replay); by default
    the buffer's own."""

    def __init__(self, buf, *, carry_weights: bool = False, recv_out: torch.Tensor | None = None,
                 expert_out: torch.Tensor | None = None):
        self.buf = buf
        self.num_experts, self.rank, self.world_size = buf.num_experts, buf.rank, buf.num_ranks
        self.carry_weights, self.recv_out, self.expert_out = carry_weights, recv_out, expert_out

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor | None = None):
        """``(recv_x [L, W * T, hidden], recv_count [L], handle, expert_out)``: ``expert_out``
        is where the experts write their rows for ``combine``."""
        kw = {"out": self.recv_out} if self.recv_out is not None else {}
        if self.carry_weights:
            kw["topk_weights"] = topk_weights
        recv_x, recv_count, handle = self.buf.dispatch(x, topk_idx, **kw)
        out = self.expert_out if self.expert_out is not None else self.buf.get_combine_input(handle)
        return recv_x, recv_count, handle, out

    def combine(self, expert_out, topk_idx, topk_weights, handle) -> torch.Tensor:
        return self.buf.combine(expert_out, topk_idx,
                                None if self.carry_weights else topk_weights, handle)


class DeepEPTransport:
    """dispatch / combine over ``llcomm.deep_ep.Buffer`` (DeepEP's low-latency calls, bf16 /
    fp32 rows, no FP8): ``low_latency_dispatch``, the experts writing straight into
    ``get_next_low_latency_combine_buffer(handle)``, and ``low_latency_combine`` with
    ``zero_copy=True``. ``max_tokens``: the ``num_max_dispatch_tokens_per_rank`` every call
    passes (the same on every rank and every call, as DeepEP requires)."""

    def __init__(self, buf, num_experts: int, max_tokens: int):
        self.buf, self.num_experts, self.max_tokens = buf, num_experts, max_tokens
        self.rank, self.world_size = buf.rank, buf.group_size

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor | None = None):
        """As ``EPBufferTransport.dispatch``; the handle is DeepEP's."""
        recv_x, recv_count, handle, _, _ = self.buf.low_latency_dispatch(
            x, topk_idx, self.max_tokens, self.num_experts, use_fp8=False)
        return recv_x, recv_count, handle, self.buf.get_next_low_latency_combine_buffer(handle)

    def combine(self, expert_out, topk_idx, topk_weights, handle) -> torch.Tensor:
        combined, _, _ = self.buf.low_latency_combine(expert_out, topk_idx, topk_weights, handle,
                                                      zero_copy=True)
        return combined


# What ExpertParallelMoE asks of a transport: ``num_experts``, ``rank``, ``world_size``;
# ``dispatch(x, topk_idx, topk_weights) -> (recv_x [L, W * T, hidden], recv_count [L], handle,
# expert_out)``; ``combine(expert_out, topk_idx, topk_weights (float32), handle) ->
# [num_tokens, hidden]``. tests/test_hf_models.py runs its checks once per transport.


def local_experts(experts: nn.Module, rank: int, world_size: int) -> nn.Module:
    """A copy of a transformers experts module (3-D ``gate_up_proj`` / ``down_proj``) holding
    this rank's experts only, numbered from 0."""
    n = experts.num_experts
    if n % world_size:
        raise ValueError(f"local_experts: num_experts={n} is not a multiple of the world size "
                         f"{world_size}")
    per = n // world_size
    mine = slice(rank * per, (rank + 1) * per)
    out = copy.copy(experts)            # a shallow copy: the module's code, config and act_fn
    out._parameters = dict(experts._parameters)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            setattr(out, name, nn.Parameter(getattr(experts, name)[mine].clone(),
                                            requires_grad=False))
    out.num_experts = per
    return out


def grouped_experts(experts: nn.Module, recv_x: torch.Tensor, rows: int,
                    out: torch.Tensor) -> None:
    """Every expert of ``experts`` (the module's own weights: ``gate_up_proj [L, 2I, hidden]``
    holding gate then up, ``down_proj [L, hidden, I]``, its ``act_fn``) on its first ``rows``
    rows of ``recv_x [L, rows+, hidden]``, written to ``out[:, :rows]``: the module's
    ``down(act(gate(x)) * up(x))`` as batched matmuls, no host sync, fixed shapes."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    L, two_i, hidden = gate_up.shape
    if down.shape != (L, hidden, two_i // 2):
        raise ValueError(f"grouped_experts: gate_up_proj {tuple(gate_up.shape)} and down_proj "
                         f"{tuple(down.shape)} are not [L, 2I, hidden] and [L, hidden, I]")
    x = recv_x[:, :rows]
    gate, up = torch.bmm(x, gate_up.transpose(1, 2)).chunk(2, dim=-1)
    out[:, :rows] = torch.bmm(experts.act_fn(gate) * up, down.transpose(1, 2))


class ExpertParallelMoE(nn.Module):
    """A Qwen3-MoE sparse block with its experts spread over the transport's ranks (module
    doc). Every rank must call it the same number of times; token counts may differ.
    ``rows``: None, or the fixed rows per expert of the capturable path."""

    def __init__(self, block: nn.Module, transport, rows: int | None = None):
        super().__init__()
        if rows is not None and (not isinstance(rows, int) or rows < 1):
            raise ValueError(f"ExpertParallelMoE: rows={rows!r} must be an int of at least 1 "
                             "(or None)")
        if block.experts.num_experts != transport.num_experts:
            raise ValueError(f"ExpertParallelMoE: the block has {block.experts.num_experts} "
                             f"experts, the transport {transport.num_experts}")
        self.gate = block.gate
        self.experts = local_experts(block.experts, transport.rank, transport.world_size)
        self.transport = transport
        self.rows = rows

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).contiguous()
        _, topk_weights, topk_idx = self.gate(x)                    # the block's own router
        weights = topk_weights.float()
        recv_x, recv_count, handle, expert_out = self.transport.dispatch(x, topk_idx, weights)
        if self.rows is not None:
            grouped_experts(self.experts, recv_x, min(self.rows, recv_x.shape[1]), expert_out)
        else:
            self._experts_on_valid_rows(recv_x, recv_count, expert_out)
        out = self.transport.combine(expert_out, topk_idx, weights, handle)
        return out.view(shape)

    def _experts_on_valid_rows(self, recv_x, recv_count, expert_out) -> None:
        counts = recv_count.tolist()       # the host sync (rows=R avoids it)
        rows = torch.cat([recv_x[e, :c] for e, c in enumerate(counts)])
        if not rows.shape[0]:
            return
        which = torch.cat([torch.full((c, 1), e, dtype=torch.long, device=rows.device)
                           for e, c in enumerate(counts)])
        y = self.experts(rows, which, torch.ones(which.shape, dtype=rows.dtype,
                                                 device=rows.device))
        for e, part in enumerate(y.split(counts)):
            expert_out[e, :counts[e]] = part


def expert_parallel(model: nn.Module, transport, rows: int | None = None) -> nn.Module:
    """Replace every sparse MoE block of a Qwen3-MoE model by ``ExpertParallelMoE`` (in
    place); returns the model."""
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate"):
            layer.mlp = ExpertParallelMoE(layer.mlp, transport, rows)
    return model

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
3. runs the experts module on the valid rows, each row tagged with its local expert, weight 1
   (the same code and weights the block runs, on this rank's experts only), and writes each
   expert's outputs to its rows of the combine input;
4. ``combine``: every token gets back the sum of its experts' outputs weighted by the router's
   top-k weights, in the order it was given.

The transport is the one place that speaks to llcomm (``EPBufferTransport``); a transport with
the same three calls over ``llcomm.deep_ep`` (DeepEP's ``Buffer`` API) slots in beside it.

The check below builds a tiny Qwen3-MoE with random weights (nothing is downloaded). The block:
each rank routes tokens of its own (three of them sent only to experts of other ranks) and
compares the result with the block's own forward on those tokens. The whole
model: each rank generates from prompts of its own with every MoE block expert-parallel (the
attention and the rest replicated, as data parallelism) and must pick the tokens the unsharded
model picks.

    python examples/hf_moe_ep.py            # 2 local processes (GPUs if there are two, else CPU)
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import llcomm
from _launch import device, launch


class EPBufferTransport:
    """dispatch / combine over an ``llcomm.EPBuffer`` (bf16 / fp32 rows, no FP8)."""

    def __init__(self, buf: llcomm.EPBuffer):
        self.buf = buf
        self.num_experts, self.rank, self.world_size = buf.num_experts, buf.rank, buf.num_ranks

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor):
        """``(recv_x [L, W * T, hidden], recv_count [L], handle, expert_out)``: ``expert_out``
        is where the experts write their rows for ``combine``."""
        recv_x, recv_count, handle = self.buf.dispatch(x, topk_idx)
        return recv_x, recv_count, handle, self.buf.get_combine_input(handle)

    def combine(self, expert_out, topk_idx, topk_weights, handle) -> torch.Tensor:
        return self.buf.combine(expert_out, topk_idx, topk_weights, handle)


# What ExpertParallelMoE asks of a transport: ``num_experts``, ``rank``, ``world_size``;
# ``dispatch(x, topk_idx) -> (recv_x [L, W * T, hidden], recv_count [L], handle, expert_out)``;
# ``combine(expert_out, topk_idx, topk_weights (float32), handle) -> [num_tokens, hidden]``.
# A transport over llcomm.deep_ep (DeepEP's Buffer API) goes here: dispatch through its
# low_latency_dispatch(..., use_fp8=False) and get_next_low_latency_combine_buffer(handle),
# combine through low_latency_combine(...)[0]; tests/test_hf_models.py runs its checks once per
# transport it lists.


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


class ExpertParallelMoE(nn.Module):
    """A Qwen3-MoE sparse block with its experts spread over the transport's ranks (module
    doc). Every rank must call it the same number of times; token counts may differ."""

    def __init__(self, block: nn.Module, transport):
        super().__init__()
        if block.experts.num_experts != transport.num_experts:
            raise ValueError(f"ExpertParallelMoE: the block has {block.experts.num_experts} "
                             f"experts, the transport {transport.num_experts}")
        self.gate = block.gate
        self.experts = local_experts(block.experts, transport.rank, transport.world_size)
        self.transport = transport

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).contiguous()
        _, topk_weights, topk_idx = self.gate(x)                    # the block's own router
        recv_x, recv_count, handle, expert_out = self.transport.dispatch(x, topk_idx)
        counts = recv_count.tolist()       # a host sync (a grouped GEMM on recv_count avoids it)
        rows = torch.cat([recv_x[e, :c] for e, c in enumerate(counts)])
        if rows.shape[0]:
            which = torch.cat([torch.full((c, 1), e, dtype=torch.long, device=x.device)
                               for e, c in enumerate(counts)])
            y = self.experts(rows, which, torch.ones(which.shape, dtype=rows.dtype,
                                                     device=x.device))
            for e, part in enumerate(y.split(counts)):
                expert_out[e, :counts[e]] = part
        out = self.transport.combine(expert_out, topk_idx, topk_weights.float(), handle)
        return out.view(shape)


def expert_parallel(model: nn.Module, transport) -> nn.Module:
    """Replace every sparse MoE block of a Qwen3-MoE model by ``ExpertParallelMoE`` (in
    place); returns the model."""
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate"):
            layer.mlp = ExpertParallelMoE(layer.mlp, transport)
    return model


# --- the check ------------------------------------------------------------------------------

def tiny_qwen3_moe(seed: int, dtype: torch.dtype = torch.float32, layers: int = 2,
                   ranks: int = 2):
    """A small Qwen3MoeForCausalLM with 4 experts per rank of ``ranks`` and random weights drawn
    from ``seed``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         moe_intermediate_size=32, num_experts=4 * ranks, num_experts_per_tok=2,
                         norm_topk_prob=True, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         rms_norm_eps=1e-5, pad_token_id=0)
    model = Qwen3MoeForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.25 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g))
    return model.to(dtype).eval()


def routed_tokens(gate: nn.Module, experts: list[int], n: int,
                  g: torch.Generator) -> torch.Tensor:
    """``n`` tokens that the router ``gate`` sends to experts in ``experts`` only (each built
    from the router's rows of ``top_k`` of them, and checked through the router)."""
    w = gate.weight.detach().float().cpu()
    tokens = []
    for _ in range(n):
        pick = torch.tensor(experts)[torch.randperm(len(experts), generator=g)[:gate.top_k]]
        tokens.append(4 * w[pick].sum(0) / w[pick].norm(dim=1).mean() ** 2
                      + 0.1 * torch.randn(w.shape[1], generator=g))
    x = torch.stack(tokens).to(gate.weight.device, gate.weight.dtype)
    _, _, idx = gate(x)
    assert bool(torch.isin(idx.cpu(), torch.tensor(experts)).all()), "a token went elsewhere"
    return x


def tolerance(want: torch.Tensor) -> dict:
    """How close the expert-parallel block's output must be to the block's own. float32: the
    same products, summed in another order (llcomm's combine adds a token's k weighted expert
    outputs in its own order, the experts run on other row batches), which moves an output by
    a few units in the last place (ulps) of the largest output; 64 such ulps leave a tenfold
    margin, while a token missed, an expert's rows misplaced or a weight lost moves outputs by
    their own size. bf16 (GPU): 1/32 of the largest output (bf16 keeps 8 bits of mantissa)."""
    scale = float(want.abs().max())
    if want.dtype == torch.float32:
        return dict(rtol=0, atol=FP32_ULPS * torch.finfo(torch.float32).eps * scale)
    return dict(rtol=0, atol=scale / 32)


#: float32 tolerance in ulps of the largest output (``tolerance``).
FP32_ULPS = 64


def main():
    rank, ws = dist.get_rank(), dist.get_world_size()
    dev = device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ref = tiny_qwen3_moe(seed=0, dtype=dtype, ranks=ws).to(dev)
    cfg = ref.config
    max_tokens = 16
    buf = llcomm.EPBuffer(num_experts=cfg.num_experts, hidden=cfg.hidden_size,
                          num_max_dispatch_tokens_per_rank=max_tokens, dtype=dtype)
    transport = EPBufferTransport(buf)

    # the block alone, each rank with tokens of its own (a different number on each rank),
    # three of them routed only to experts of other ranks
    block = ref.model.layers[0].mlp
    per = cfg.num_experts // ws
    g = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        elsewhere = [e for e in range(cfg.num_experts) if e // per != rank]
        x = torch.cat([torch.randn(9 - rank, cfg.hidden_size, generator=g).to(dev, dtype),
                       routed_tokens(block.gate, elsewhere, 3, g)])[None]
        want = block(x)
        got = ExpertParallelMoE(block, transport)(x)
    torch.testing.assert_close(got, want, **tolerance(want))

    # the whole model: every MoE block expert-parallel, each rank generating its own prompts
    ep = expert_parallel(copy.deepcopy(ref), transport)
    ids = torch.randint(1, cfg.vocab_size, (2, 5), generator=g).to(dev)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
              do_sample=False, pad_token_id=0)
    want_tokens = ref.generate(ids, **kw)
    tokens = ep.generate(ids, **kw)
    if dtype == torch.float32:             # bf16 may turn a near tie the other way
        assert torch.equal(tokens, want_tokens), (tokens, want_tokens)
    buf.check()
    buf.close()
    if rank == 0:
        print(f"hf_moe_ep: ok (backend={buf.backend}, {ws} ranks, {cfg.num_experts} experts, "
              f"top-{cfg.num_experts_per_tok}, tokens {tokens[0, ids.shape[1]:].tolist()})")


if __name__ == "__main__":
    launch(main)

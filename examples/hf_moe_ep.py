"""Expert parallelism for transformers' own Qwen3-MoE block, tokens moved by ``llcomm.EPBuffer``
(docs/integration.md, "Real model code").

``ExpertParallelMoE(block, transport)`` (``llcomm.hf.moe_ep``, which says what one call does)
stands in for a ``Qwen3MoeSparseMoeBlock``: the block's own router on every rank, this rank's
slice of the block's own experts, and the tokens moved to their experts and back by the
transport: ``EPBufferTransport`` (``EPBuffer.dispatch`` / ``combine``), or ``DeepEPTransport``
(``llcomm.deep_ep.Buffer``'s ``low_latency_dispatch`` / ``low_latency_combine``, the calls an
engine written for DeepEP makes).

The check below builds a tiny Qwen3-MoE with random weights (nothing is downloaded). The block:
each rank routes tokens of its own (three of them sent only to experts of other ranks) and
compares the result with the block's own forward on those tokens, through each transport. The whole
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
import llcomm.deep_ep as deep_ep
from _launch import device, launch
from llcomm.hf.moe_ep import DeepEPTransport, EPBufferTransport, ExpertParallelMoE, expert_parallel


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
        # the same block through DeepEP's API
        deep = deep_ep.Buffer(None, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
            max_tokens, cfg.hidden_size, ws, cfg.num_experts))
        got = ExpertParallelMoE(block, DeepEPTransport(deep, cfg.num_experts, max_tokens))(x)
        torch.testing.assert_close(got, want, **tolerance(want))
        deep.destroy()

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

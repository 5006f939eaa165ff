"""Tensor parallelism for transformers' own Llama model, joined by llcomm (docs/integration.md,
"Real model code").

``tensor_parallel(model, comm)`` shards a ``transformers.LlamaForCausalLM`` in place over the
ranks of an ``llcomm.Communicator``: it swaps the model's ``nn.Linear`` layers for sharded ones
and leaves transformers' attention, rotary embedding, KV cache, MLP, norms, masks and
``generate()`` to run as they are.

- q / k / v and gate / up are column-parallel: each rank keeps its rows of the weight (its
  query heads and key / value heads, its part of the MLP's width), so attention runs on this
  rank's heads only and the KV cache holds only them.
- o_proj and down_proj are row-parallel: each rank multiplies its slice of the input by its
  columns of the weight, and the partial sums are joined across ranks.
- The join. ``fused=False``: the row-parallel layer calls ``comm.all_reduce`` and the decoder
  layer's own forward adds the residual and applies the next RMSNorm. ``fused=True``: each
  join is ``comm.all_reduce_residual_rmsnorm`` (all-reduce, residual add and the next RMSNorm in
  one call). transformers' decoder layer adds the residual inline, between its calls to
  ``self_attn`` and ``post_attention_layernorm``, where no hook reaches, so the fused mode gives
  each decoder layer a forward of its own that calls the layer's own modules in the layer's
  order and joins through llcomm (``_fused_layer_forward``). The join after down_proj takes the
  *next* norm's weight (the next layer's ``input_layernorm``, or the model's final ``norm``),
  and that norm hands back the join's output when it is called on the join's residual.
- The embedding is replicated; lm_head is vocab-parallel: each rank computes the logits of its
  slice of the vocabulary and ``comm.all_gather_2d`` puts every rank's slice in place (token
  major), so every rank holds the whole logits and ``generate()`` picks the same tokens.

Requires ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size`` and
``vocab_size`` to be multiples of the world size.

The check below builds a tiny Llama with random weights (nothing is downloaded), shards a copy,
and compares the logits of a batch of prompts and the tokens ``generate()`` picks (with its KV
cache) against the unsharded model on every rank, fused and unfused.

    python examples/hf_llama_tp.py          # 2 local processes (GPUs if there are two, else CPU)
"""
from __future__ import annotations

import copy
import functools
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import llcomm
from _launch import device, launch


class RowParallelLinear(nn.Module):
    """This rank's input columns of an ``nn.Linear``; the partial products are joined across
    ranks by ``join`` (``comm.all_reduce``), or left unjoined (``join=None``) for a caller that
    joins them itself (the fused decoder layer). A bias is added once, by rank 0."""

    def __init__(self, linear: nn.Linear, comm: llcomm.Communicator, join=None):
        super().__init__()
        part = linear.in_features // comm.world_size
        cols = slice(comm.rank * part, (comm.rank + 1) * part)
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].contiguous(),
                                   requires_grad=False)
        self.bias = None
        if linear.bias is not None and comm.rank == 0:
            self.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.join = join

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y if self.join is None else self.join(y.contiguous())


def _column_parallel(linear: nn.Linear, comm: llcomm.Communicator) -> nn.Linear:
    """This rank's output rows of an ``nn.Linear`` (its heads, its part of the MLP), as an
    ``nn.Linear`` the module calls as before."""
    part = linear.out_features // comm.world_size
    rows = slice(comm.rank * part, (comm.rank + 1) * part)
    out = nn.Linear(linear.in_features, part, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[rows])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[rows])
    out.requires_grad_(False)
    return out


class VocabParallelLMHead(nn.Module):
    """lm_head split by vocabulary rows; ``comm.all_gather_2d`` joins the slices token-major, so
    every rank returns the whole ``[..., vocab]`` logits."""

    def __init__(self, linear: nn.Linear, comm: llcomm.Communicator):
        super().__init__()
        self.inner = _column_parallel(linear, comm)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = self.inner(x.reshape(-1, x.shape[-1]).contiguous())
        return self.comm.all_gather_2d(part).view(*x.shape[:-1], -1)


def rms_eps(norm: nn.Module) -> float:
    """The epsilon of an RMSNorm module (transformers names it ``variance_epsilon``)."""
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


class JoinedNorm(nn.Module):
    """Stands where an RMSNorm stood. The fused join before it already computed its output for
    one tensor (``hand_over``); called on that very tensor it returns the output, on anything
    else it runs the RMSNorm it replaced. ``hits`` counts the hand-overs taken."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm
        self.weight = norm.weight
        self.eps = rms_eps(norm)
        self._key = self._value = None
        self.hits = 0

    def hand_over(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self._key, self._value = key, value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key, value = self._key, self._value
        self._key = self._value = None
        if x is key:
            self.hits += 1
            return value
        return self.norm(x)


def fused_join(comm: llcomm.Communicator, partial: torch.Tensor, residual: torch.Tensor,
               norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(residual + sum of partial), residual + sum of partial)``, one llcomm call."""
    shape = residual.shape
    h = shape[-1]
    # plain tensors (the weight detached from its Parameter): llcomm's per-shape fast path
    # takes those only
    out, res = comm.all_reduce_residual_rmsnorm(partial.reshape(-1, h).contiguous(),
                                                residual.reshape(-1, h).contiguous(),
                                                norm.weight.detach(), rms_eps(norm))
    return out.view(shape), res.view(shape)


def _fused_layer_forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    """A Llama decoder layer's forward with its two joins fused (bound to the layer by
    ``tensor_parallel``): the layer's own modules, called as the layer calls them."""
    residual = hidden_states
    x = self.input_layernorm(hidden_states)        # a JoinedNorm after the first layer
    x, _ = self.self_attn(hidden_states=x, **kwargs)        # o_proj's partial sums
    x, residual = self.tp_join(x, residual, self.post_attention_layernorm)
    x = self.mlp(x)                                         # down_proj's partial sums
    normed, hidden = self.tp_join(x, residual, self.tp_next_norm)
    self.tp_next_norm.hand_over(hidden, normed)
    return hidden


def tensor_parallel(model: nn.Module, comm: llcomm.Communicator, *, fused: bool = True):
    """Shard a ``LlamaForCausalLM`` (or a model of the same layout) in place over ``comm``'s
    ranks (see the module doc); returns it. Every rank must pass the same weights."""
    cfg, ws = model.config, comm.world_size
    bad = [f"{k}={getattr(cfg, k)}" for k in ("num_attention_heads", "num_key_value_heads",
                                              "intermediate_size", "vocab_size")
           if getattr(cfg, k) % ws]
    if bad:
        raise ValueError(f"tensor_parallel: {', '.join(bad)} not a multiple of the world size "
                         f"{ws}")
    base = model.model
    layers = list(base.layers)
    join = None if fused else comm.all_reduce
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, _column_parallel(getattr(attn, name), comm))
        attn.o_proj = RowParallelLinear(attn.o_proj, comm, join)
        for name in ("gate_proj", "up_proj"):
            setattr(mlp, name, _column_parallel(getattr(mlp, name), comm))
        mlp.down_proj = RowParallelLinear(mlp.down_proj, comm, join)
    if fused:
        for i, layer in enumerate(layers):
            if i + 1 < len(layers):
                nxt = layers[i + 1].input_layernorm = JoinedNorm(layers[i + 1].input_layernorm)
            else:
                nxt = base.norm = JoinedNorm(base.norm)
            layer.tp_next_norm = nxt
            layer.tp_join = functools.partial(fused_join, comm)
            layer.forward = types.MethodType(_fused_layer_forward, layer)
    model.lm_head = VocabParallelLMHead(model.lm_head, comm)
    return model


# --- the check ------------------------------------------------------------------------------

def tiny_llama(seed: int, dtype: torch.dtype = torch.float32, layers: int = 3, ranks: int = 2):
    """A small LlamaForCausalLM that ``ranks`` ranks can share, with random weights drawn from
    ``seed`` (every parameter, norms included, so that a norm weight applied in the wrong place
    shows). Two query heads per key / value head; 12 and 6 heads for 2, 3 or 6 ranks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kv_heads = 6 if 6 % ranks == 0 else ranks
    cfg = LlamaConfig(vocab_size=ranks * (384 // ranks), hidden_size=16 * kv_heads,
                      intermediate_size=ranks * (192 // ranks), num_hidden_layers=layers,
                      num_attention_heads=2 * kv_heads, num_key_value_heads=kv_heads,
                      head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                      pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.25 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g))
    return model.to(dtype).eval()


def greedy(model: nn.Module, ids: torch.Tensor, steps: int):
    """``generate()`` greedily for ``steps`` tokens (KV cache on); returns the tokens and the
    logits of each step."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                         min_new_tokens=steps, do_sample=False, use_cache=True,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def tolerance(want: torch.Tensor) -> dict:
    """How close the sharded model's logits must be to the unsharded model's. float32: the
    sharded model sums the same products in another order (each rank its slice, then the
    all-reduce), which moves a logit by a few units in the last place (ulps) of the largest
    logit; 64 such ulps leave a tenfold margin, while a missing join, a wrong slice or a norm
    weight in the wrong place moves logits by their own size. bf16 (GPU) rounds every layer's
    output to 8 bits of mantissa: 1/16 of the largest logit."""
    scale = float(want.abs().max())
    if want.dtype == torch.float32:
        return dict(rtol=0, atol=FP32_ULPS * torch.finfo(torch.float32).eps * scale)
    return dict(rtol=0, atol=scale / 16)


#: float32 tolerance in ulps of the largest output (``tolerance``).
FP32_ULPS = 64


def main():
    rank, ws = dist.get_rank(), dist.get_world_size()
    dev = device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ref = tiny_llama(seed=0, dtype=dtype, ranks=ws).to(dev)
    ids = torch.randint(1, ref.config.vocab_size, (3, 7),
                        generator=torch.Generator().manual_seed(1)).to(dev)
    with torch.no_grad():
        want_logits = ref(ids).logits
    want_tokens, _ = greedy(ref, ids, steps=6)

    comm = llcomm.Communicator(max_bytes=1 << 20)
    for fused in (True, False):
        tp = tensor_parallel(copy.deepcopy(ref), comm, fused=fused)
        with torch.no_grad():
            torch.testing.assert_close(tp(ids).logits, want_logits, **tolerance(want_logits))
        tokens, _ = greedy(tp, ids, steps=6)
        if dtype == torch.float32:         # bf16 may turn a near tie the other way
            assert torch.equal(tokens, want_tokens), (tokens, want_tokens)
        everyone = [None] * ws
        dist.all_gather_object(everyone, tokens.cpu())
        assert all(torch.equal(t, everyone[0]) for t in everyone), "ranks picked different tokens"
    comm.check()
    comm.close()
    if rank == 0:
        print(f"hf_llama_tp: ok (backend={comm.backend}, {ws} ranks, fused and unfused joins, "
              f"tokens {want_tokens[0].tolist()})")


if __name__ == "__main__":
    launch(main)

"""Tensor parallelism for transformers' own Llama model (docs/integration.md, "Real model code").

``tensor_parallel(model, comm)`` shards a ``transformers.LlamaForCausalLM`` in place over the
ranks of an ``llcomm.Communicator``: it swaps the model's ``nn.Linear`` layers for sharded ones
and leaves transformers' attention, rotary embedding, KV cache, MLP, norms, masks and
``generate()`` to run as they are.

- q / k / v and gate / up are column-parallel: each rank keeps its rows of the weight (its
  query heads and key / value heads, its part of the MLP's width), so attention runs on this
  rank's heads only and the KV cache holds only them.
- o_proj and down_proj are row-parallel: each rank multiplies its slice of the input by its
  columns of the weight, and the partial sums are joined across ranks.
- The join. ``fused=False``: the row-parallel layer calls ``join(partial)`` (default
  ``comm.all_reduce``; any all-reduce with that shape of call fits, ``dist.all_reduce``
  wrapped, or none at all to leave the partial sums unjoined) and the decoder layer's own
  forward adds the residual and applies the next RMSNorm. ``fused=True``: each join is
  ``join(partial, residual, norm) -> (norm(h), h)`` with ``h = residual + sum of partials``
  (default ``comm.all_reduce_residual_rmsnorm``: all-reduce, residual add and the next RMSNorm
  in one call). transformers' decoder layer adds the residual inline, between its calls to
  ``self_attn`` and ``post_attention_layernorm``, where no hook reaches, so the fused mode gives
  each decoder layer a forward of its own (``fused_layer_forward``) that calls the layer's own
  modules in the layer's order and makes its two joins. The join after down_proj takes the
  *next* norm's weight (the next layer's ``input_layernorm``, or the model's final ``norm``),
  and that norm hands back the join's output when it is called on the join's residual.
- The embedding is replicated; lm_head is vocab-parallel: each rank computes the logits of its
  slice of the vocabulary and ``comm.all_gather_2d`` puts every rank's slice in place (token
  major), so every rank holds the whole logits and ``generate()`` picks the same tokens.

Requires ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size`` and
``vocab_size`` to be multiples of the world size. ``comm`` may be anything with ``rank`` and
``world_size`` (and the calls of the joins it is asked to make). Plain torch on the modules
transformers built: this module imports no transformers code.
"""
from __future__ import annotations

import functools
import types
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class RowParallelLinear(nn.Module):
    """This rank's input columns of an ``nn.Linear``; the partial products are joined across
    ranks by ``join`` (an all-reduce: tensor in, joined tensor out), or left unjoined
    (``join=None``) for a caller that joins them itself (the fused decoder layer). A bias is
    added once, by rank 0.

    A join with a ``target(shape, dtype)`` method (torch symmetric memory) gets the partial
    product written straight into the tensor that method returns."""

    def __init__(self, linear: nn.Linear, comm, join: Callable | None = None):
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
        join = self.join
        target = getattr(join, "target", None)
        if target is not None and self.bias is None:
            y = target((*x.shape[:-1], self.weight.shape[0]), x.dtype)
            torch.mm(x.reshape(-1, x.shape[-1]), self.weight.t(), out=y.view(-1, y.shape[-1]))
            return join(y)
        y = F.linear(x, self.weight, self.bias)
        return y if join is None else join(y.contiguous())


def column_parallel(linear: nn.Linear, comm) -> nn.Linear:
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

    def __init__(self, linear: nn.Linear, comm):
        super().__init__()
        self.inner = column_parallel(linear, comm)
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


def fused_join(comm, partial: torch.Tensor, residual: torch.Tensor,
               norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(residual + sum of partial), residual + sum of partial)``, one llcomm call
    (``comm.all_reduce_residual_rmsnorm``)."""
    shape = residual.shape
    h = shape[-1]
    # plain tensors (the weight detached from its Parameter): llcomm's per-shape fast path
    # takes those only
    out, res = comm.all_reduce_residual_rmsnorm(partial.reshape(-1, h).contiguous(),
                                                residual.reshape(-1, h).contiguous(),
                                                norm.weight.detach(), rms_eps(norm))
    return out.view(shape), res.view(shape)


def fused_layer_forward(layer: nn.Module, hidden_states: torch.Tensor, next_norm: nn.Module,
                        join: Callable, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """A Llama decoder layer with its two joins fused: the layer's own modules, called as the
    layer's forward calls them, with o_proj and down_proj unjoined (``join=None``) and each
    partial sum joined by ``join(partial, residual, norm) -> (norm(h), h)``. ``kwargs`` go to
    ``self_attn`` (position embeddings, mask, cache). Returns ``(h, next_norm(h))``: the
    layer's output and the next norm applied to it."""
    residual = hidden_states
    x = layer.input_layernorm(hidden_states)      # a JoinedNorm after the first layer
    x, _ = layer.self_attn(hidden_states=x, **kwargs)       # o_proj's partial sums
    x, residual = join(x, residual, layer.post_attention_layernorm)
    x = layer.mlp(x)                                        # down_proj's partial sums
    normed, hidden = join(x, residual, next_norm)
    return hidden, normed


def _fused_forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    """A decoder layer's forward in the fused mode (bound to the layer by ``tensor_parallel``):
    ``fused_layer_forward`` with the layer's own join and next norm, the next norm's output
    handed over to it."""
    hidden, normed = fused_layer_forward(self, hidden_states, self.tp_next_norm, self.tp_join,
                                         **kwargs)
    self.tp_next_norm.hand_over(hidden, normed)
    return hidden


def check_divisible(cfg, world_size: int, fields=("num_attention_heads", "num_key_value_heads",
                                                  "intermediate_size", "vocab_size"),
                    what: str = "tensor_parallel") -> None:
    """``ValueError`` naming each config field that is not a multiple of ``world_size``."""
    bad = [f"{k}={getattr(cfg, k)}" for k in fields if getattr(cfg, k) % world_size]
    if bad:
        raise ValueError(f"{what}: {', '.join(bad)} not a multiple of the world size "
                         f"{world_size}")


def shard_decoder_layer(layer: nn.Module, comm, join: Callable | None = None) -> nn.Module:
    """Shard one Llama decoder layer's linear layers in place (module doc): q / k / v, gate /
    up column-parallel, o_proj and down_proj row-parallel joined by ``join``. Returns it."""
    attn, mlp = layer.self_attn, layer.mlp
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, column_parallel(getattr(attn, name), comm))
    attn.o_proj = RowParallelLinear(attn.o_proj, comm, join)
    for name in ("gate_proj", "up_proj"):
        setattr(mlp, name, column_parallel(getattr(mlp, name), comm))
    mlp.down_proj = RowParallelLinear(mlp.down_proj, comm, join)
    return layer


def set_join(module: nn.Module, join: Callable | None) -> None:
    """Make every ``RowParallelLinear`` under ``module`` join by ``join`` (None: unjoined)."""
    for m in module.modules():
        if isinstance(m, RowParallelLinear):
            m.join = join


def tensor_parallel(model: nn.Module, comm, *, fused: bool = True,
                    join: Callable | None = None) -> nn.Module:
    """Shard a ``LlamaForCausalLM`` (or a model of the same layout) in place over ``comm``'s
    ranks (see the module doc); returns it. Every rank must pass the same weights. ``join``
    replaces the default join of the mode (``comm.all_reduce`` unfused,
    ``comm.all_reduce_residual_rmsnorm`` fused)."""
    check_divisible(model.config, comm.world_size)
    base = model.model
    layers = list(base.layers)
    if fused:
        layer_join = join or functools.partial(fused_join, comm)
        for layer in layers:
            shard_decoder_layer(layer, comm, None)
        for i, layer in enumerate(layers):
            if i + 1 < len(layers):
                nxt = layers[i + 1].input_layernorm = JoinedNorm(layers[i + 1].input_layernorm)
            else:
                nxt = base.norm = JoinedNorm(base.norm)
            layer.tp_next_norm = nxt
            layer.tp_join = layer_join
            layer.forward = types.MethodType(_fused_forward, layer)
    else:
        for layer in layers:
            shard_decoder_layer(layer, comm, join or comm.all_reduce)
    model.lm_head = VocabParallelLMHead(model.lm_head, comm)
    return model

"""The decode steps ``llcomm bench decode`` times, built from transformers' own modules and
sharded by ``llcomm.hf`` as examples/hf_llama_tp.py and examples/hf_moe_ep.py shard them.
Random weights (the same on every rank, so the shards are of one model), bf16 on GPUs.

**Dense TP step** (``DenseTP``): transformers' ``LlamaDecoderLayer`` at a 70B-class shape
(Llama-2/3-70B: hidden 8192, 64 query heads and 8 KV heads of 128, MLP intermediate 28672, 80
layers) sharded at TP = world size W by ``llcomm.hf.llama_tp``: q / k / v and gate / up
column-parallel, o_proj and down_proj row-parallel, so a layer makes two joins of ``[B, 1,
hidden]``. One step is one new token for each of B sequences at position ``context``:

    cos, sin = rotary(position ``context``)            computed once per step, outside the layers
    for l in 0 .. layers-1:
        h = layer[l % weight_sets](h)                    the layer's own forward (norms, q/k/v,
                                                         rotary, attention, o_proj + join, MLP,
                                                         down_proj + join)
    out = norm(h)                                        the model's final norm

Attention is transformers' SDPA attention over a KV cache of ``context + 1`` positions per
layer (``SlotKVCache``: the layer's cache API, ``update(key, value, ...)``, on static tensors):
``context`` filled positions (random keys and values, this rank's KV heads) and the slot the
step writes its own key and value into. Every step writes the same slot, so a replayed step
is the same step at the same context length; all positions are valid, so there is no mask.
The fused variant runs each layer through ``llcomm.hf.llama_tp.fused_layer_forward``: the same
modules with the joins made by ``all_reduce_residual_rmsnorm``.

What it is not: a 70B model. The layers use ``weight_sets`` distinct weight sets in turn
(layer l runs set l % weight_sets; one set is 0.86 GB per rank at W = 2, far beyond the 50 MB
L2, so every layer streams its weights from HBM as a real model does) instead of 80 (68 GB per
rank); each layer has a KV cache of its own. No embedding, LM head or sampling.

**MoE EP step** (``MoEEP``): transformers' ``Qwen3MoeSparseMoeBlock`` configured at DeepSeek-V3's
MoE shape (hidden 7168, 256 routed experts, top-8) at EP = world size, T tokens per rank (the
tokens differ per rank), ``layers`` blocks, each wrapped by ``llcomm.hf.moe_ep.ExpertParallelMoE``:

    h = h + block(h)     the block's own router (softmax top-8, normalised), dispatch by the
                         EPBuffer (the weights carried with it), this rank's experts (the
                         block's own weights), combine

The experts run on a fixed R rows each (``grouped_experts``: batched matmuls over the block's
own ``gate_up_proj`` / ``down_proj``; R is twice the mean W*T*topk/256 rows, rounded up to 8),
so the step has fixed shapes and no host sync and is captured in a CUDA graph; rows past R of
an expert that got more are not computed (a timing budget, the same for every transport).
The CPU run computes every row (R = W*T), exactly the module's forward. The router is
Qwen3-MoE's, not DeepSeek-V3's group-limited sigmoid router; the traffic (top-8 of 256) is
the same. The expert intermediate I (default 128, DeepSeek-V3's is 2048) makes a rank read as
many expert-weight bytes per layer at W = 2 (128 experts x 3 x 7168 x 128 x 2 B = 705 MB) as
one rank of a 32-way EP DeepSeek-V3 deployment (8 experts x 3 x 7168 x 2048 x 2 B), without
holding 11 GB of random expert weights per rank and layer (DeepSeek-V3's own I at W = 2). No
shared expert, attention or dense layers.

The ``none`` variants: TP, the row-parallel layers unjoined (each rank's partial product used as
is); EP, the router and the experts on a static ``recv_x``, no dispatch, no combine. So step -
none is the time communication adds.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from llcomm.hf import llama_tp as T
from llcomm.hf import moe_ep as E
from llcomm.hf import require_transformers

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
    context: int = 1024


#: The tiny CPU stand-in (runs in seconds on two gloo processes).
DENSE_CPU = DenseShape(hidden=256, q_heads=4, kv_heads=2, head_dim=64, intermediate=512, layers=2,
                       context=16)


@dataclass(frozen=True)
class Group:
    """Who this rank is (what ``llcomm.hf``'s sharding asks of a communicator)."""
    rank: int
    world_size: int


def _fill_(module: nn.Module, gen: torch.Generator) -> None:
    """Random weights from ``gen``, drawn in name order: norm weights around 1, matrices
    (2-D and 3-D) scaled by 1/sqrt(fan-in) so activations keep unit size."""
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            r = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
            if name.endswith("norm.weight") or p.dim() == 1:
                p.copy_(1 + 0.25 * r)
            else:
                p.copy_(r * p.shape[-1] ** -0.5)


def _build(make, device, dtype, gen) -> nn.Module:
    """``make()`` built on the meta device, then materialised on ``device`` in ``dtype`` and
    filled from ``gen`` (no initialisation on the host)."""
    with torch.device("meta"):
        module = make()
    module = module.to_empty(device=device).to(dtype)
    _fill_(module, gen)
    return module.eval().requires_grad_(False)


# -- dense TP --------------------------------------------------------------------------------
def llama_config(shape: DenseShape):
    """A ``LlamaConfig`` of ``shape`` (SDPA attention, the default rotary embedding)."""
    tf = require_transformers("llcomm bench decode")
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=shape.hidden,
                         intermediate_size=shape.intermediate, num_hidden_layers=1,
                         num_attention_heads=shape.q_heads, num_key_value_heads=shape.kv_heads,
                         head_dim=shape.head_dim, max_position_embeddings=shape.context + 1,
                         rms_norm_eps=NORM_EPS, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    return cfg


def dense_modules(shape: DenseShape, weight_sets: int, seed: int, device, dtype, shard=None):
    """``(layers, norm, rotary)``: ``weight_sets`` LlamaDecoderLayers (each passed through
    ``shard`` as soon as it is built: a full 70B-class layer is 1.7 GB in bf16), the final
    LlamaRMSNorm and the LlamaRotaryEmbedding, from ``seed`` (the same on every rank)."""
    from transformers.models.llama import modeling_llama as ml

    cfg = llama_config(shape)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    layers = []
    for i in range(max(1, min(weight_sets, shape.layers))):
        layer = _build(lambda: ml.LlamaDecoderLayer(cfg, i), device, dtype, gen)
        layers.append(shard(layer) if shard else layer)
        del layer
    norm = _build(lambda: ml.LlamaRMSNorm(shape.hidden, eps=NORM_EPS), device, dtype, gen)
    rotary = (ml.LlamaRotaryEmbedding(cfg, device=device) if _takes_device()
              else ml.LlamaRotaryEmbedding(cfg).to(device))
    return layers, norm, rotary


def _takes_device() -> bool:
    from transformers.models.llama import modeling_llama as ml
    return "device" in inspect.signature(ml.LlamaRotaryEmbedding.__init__).parameters


@functools.lru_cache(maxsize=None)
def cache_argument() -> str:
    """The name transformers' decoder layer takes its cache by (``cache``, formerly
    ``past_key_values``)."""
    from transformers.models.llama import modeling_llama as ml
    params = inspect.signature(ml.LlamaDecoderLayer.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class _Slot:
    """One layer's KV cache, with the layer's cache API: ``update`` writes the step's key and
    value into the last slot and returns the whole cache (static tensors, no allocation)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys[:, :, -1:].copy_(key_states)
        self.values[:, :, -1:].copy_(value_states)
        return self.keys, self.values


class SlotKVCache:
    """The KV caches of ``layers`` layers for ``batch`` sequences: ``context`` random filled
    positions of all ``kv_heads`` (drawn from ``seed``, the same on every rank) of which this
    rank keeps its heads ``[rank * kv_heads / W, ...)``, and one slot for the step's own token;
    ``positions [batch, 1]``, the step's position (``context``), a static tensor."""

    def __init__(self, shape: DenseShape, batch: int, group: Group, seed: int, device, dtype):
        per = shape.kv_heads // group.world_size
        heads = slice(group.rank * per, (group.rank + 1) * per)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        self.positions = torch.full((batch, 1), shape.context, dtype=torch.long, device=device)
        self.slots = []
        for _ in range(shape.layers):
            kv = [torch.randn(batch, shape.kv_heads, shape.context + 1, shape.head_dim,
                              generator=gen, device=device, dtype=torch.float32)[:, heads]
                  .to(dtype).contiguous() for _ in range(2)]
            self.slots.append(_Slot(*kv))

    def layer(self, i: int) -> _Slot:
        return self.slots[i]


def run_layers(layers: list, norm: nn.Module, rotary: nn.Module, h: torch.Tensor,
               cache: SlotKVCache, num_layers: int, fused_join=None) -> torch.Tensor:
    """``num_layers`` decoder layers (``layers`` in turn) on ``h [B, 1, hidden]`` at the
    cache's position, then ``norm``: each layer's own forward, or with ``fused_join`` each
    through ``fused_layer_forward`` (its norms must be ``JoinedNorm``\\ s, which take the
    hand-over)."""
    emb = rotary(h, cache.positions)
    name = cache_argument()
    for i in range(num_layers):
        layer = layers[i % len(layers)]
        kw = {name: cache.layer(i), "position_embeddings": emb, "attention_mask": None}
        if fused_join is None:
            h = layer(h, **kw)
            continue
        nxt = layers[(i + 1) % len(layers)].input_layernorm if i + 1 < num_layers else norm
        h, normed = T.fused_layer_forward(layer, h, nxt, fused_join, **kw)
        nxt.hand_over(h, normed)
    return norm(h)


class DenseTP:
    """One rank's sharded weight sets of the dense TP step (module doc); ``step`` runs it."""

    def __init__(self, shape: DenseShape, group: Group, weight_sets: int, seed: int, device,
                 dtype):
        T.check_divisible(shape, group.world_size, ("q_heads", "kv_heads", "intermediate"),
                          "llcomm bench decode")
        self.shape, self.group, self.seed = shape, group, seed
        self.device, self.dtype = device, dtype
        self.layers, norm, self.rotary = dense_modules(
            shape, weight_sets, seed, device, dtype, lambda m: T.shard_decoder_layer(m, group))
        for layer in self.layers:      # the fused join hands its output to the next norm
            layer.input_layernorm = T.JoinedNorm(layer.input_layernorm)
        self.norm = T.JoinedNorm(norm)

    def cache(self, batch: int) -> SlotKVCache:
        return SlotKVCache(self.shape, batch, self.group, self.seed + 1, self.device, self.dtype)

    def set_join(self, join) -> None:
        """Join the row-parallel layers by ``join`` (None: unjoined, or joined by a fused
        join in ``step``)."""
        for layer in self.layers:
            T.set_join(layer, join)

    def step(self, h: torch.Tensor, cache: SlotKVCache, fused_join=None) -> torch.Tensor:
        """One decode step on ``h [B, 1, hidden]`` (the same on every rank)."""
        return run_layers(self.layers, self.norm, self.rotary, h, cache, self.shape.layers,
                          fused_join)


# -- MoE EP ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoEShape:
    hidden: int = 7168
    experts: int = 256
    topk: int = 8
    intermediate: int = 128
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


def moe_blocks(shape: MoEShape, seed: int, device, dtype):
    """``shape.layers`` full ``Qwen3MoeSparseMoeBlock``\\ s at ``shape``, from ``seed`` (the
    same on every rank), yielded one at a time."""
    tf = require_transformers("llcomm bench decode")
    from transformers.models.qwen3_moe import modeling_qwen3_moe as mq

    cfg = tf.Qwen3MoeConfig(vocab_size=128, hidden_size=shape.hidden,
                            moe_intermediate_size=shape.intermediate,
                            num_experts=shape.experts, num_experts_per_tok=shape.topk,
                            norm_topk_prob=True, num_hidden_layers=1, num_attention_heads=8,
                            num_key_value_heads=8, head_dim=16, rms_norm_eps=NORM_EPS,
                            pad_token_id=0)
    cfg._experts_implementation = "eager"   # the module's own loop, where its forward is run
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for _ in range(shape.layers):
        yield _build(lambda: mq.Qwen3MoeSparseMoeBlock(cfg), device, dtype, gen)


class LocalOnly:
    """The ``none`` transport: no dispatch, no combine. The experts run on a static
    ``recv_x``, and the block adds zeros."""

    def __init__(self, num_experts: int, group: Group, recv: torch.Tensor,
                 expert_out: torch.Tensor, tokens: int):
        self.num_experts, self.rank, self.world_size = num_experts, group.rank, group.world_size
        self.recv, self.expert_out = recv, expert_out
        self.zeros = torch.zeros(tokens, recv.shape[-1], dtype=recv.dtype, device=recv.device)

    def dispatch(self, x, topk_idx, topk_weights=None):
        return self.recv, None, None, self.expert_out

    def combine(self, expert_out, topk_idx, topk_weights, handle):
        return self.zeros[:topk_idx.shape[0]]


class MoEEP:
    """One rank's MoE blocks (module doc); ``step`` runs them through a transport."""

    def __init__(self, shape: MoEShape, group: Group, tokens: int, seed: int, device, dtype,
                 rows: int | None = None):
        if shape.experts % group.world_size:
            raise ValueError(f"llcomm bench decode: {shape.experts} experts do not split over "
                             f"{group.world_size} ranks")
        self.shape, self.group, self.tokens = shape, group, tokens
        self.rows = rows if rows is not None else expert_rows(group.world_size, tokens, shape)
        self.recv_shape = (shape.experts // group.world_size, group.world_size * tokens,
                           shape.hidden)
        self.dtype, self.device = dtype, device
        placeholder = SimpleNamespace(num_experts=shape.experts, rank=group.rank,
                                      world_size=group.world_size)
        self.blocks = []
        for block in moe_blocks(shape, seed, device, dtype):
            self.blocks.append(E.ExpertParallelMoE(block, placeholder, self.rows))
            del block                   # the other ranks' experts go

    def buffers(self):
        """``(recv_x, expert_out)`` of one implementation, zeroed."""
        return (torch.zeros(self.recv_shape, dtype=self.dtype, device=self.device),
                torch.zeros(self.recv_shape, dtype=self.dtype, device=self.device))

    def transport(self, buf, recv: torch.Tensor, expert_out: torch.Tensor):
        """``buf`` (an EPBuffer) as the blocks' transport, the weights carried by the dispatch,
        into these fixed tensors; ``buf=None``: ``LocalOnly``."""
        if buf is None:
            return LocalOnly(self.shape.experts, self.group, recv, expert_out, self.tokens)
        return E.EPBufferTransport(buf, carry_weights=True, recv_out=recv,
                                   expert_out=expert_out)

    def step(self, h: torch.Tensor, transport) -> torch.Tensor:
        """The MoE stack on ``h [T, hidden]`` through ``transport``."""
        for block in self.blocks:
            block.transport = transport
            h = h + block(h)
        return h

"""Tensor parallelism for transformers' own Llama model, joined by llcomm (docs/integration.md,
"Real model code").

``tensor_parallel(model, comm)`` (``llcomm.hf.llama_tp``, which says how each layer is split and
joined) shards a ``transformers.LlamaForCausalLM`` in place over the ranks of an
``llcomm.Communicator``: it swaps the model's ``nn.Linear`` layers for sharded ones and leaves
transformers' attention, rotary embedding, KV cache, MLP, norms, masks and ``generate()`` to run
as they are. ``fused=True`` makes each decoder layer's two joins
``comm.all_reduce_residual_rmsnorm`` calls; ``fused=False`` joins with ``comm.all_reduce``.

The check below builds a tiny Llama with random weights (nothing is downloaded), shards a copy,
and compares the logits of a batch of prompts and the tokens ``generate()`` picks (with its KV
cache) against the unsharded model on every rank, fused and unfused.

    python examples/hf_llama_tp.py          # 2 local processes (GPUs if there are two, else CPU)
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import llcomm
from _launch import device, launch
from llcomm.hf.llama_tp import tensor_parallel


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

"""transformers' own models through llcomm on the CPU (gloo, reference backend, float32), with
the sharding code of ``llcomm.hf`` (``llama_tp``, ``moe_ep``) and the tiny models of
examples/hf_llama_tp.py and examples/hf_moe_ep.py, against the same model unsharded, on fresh
random weights and inputs every run (the seed is in the failure message):

- tensor parallelism of a Llama (2 and 3 ranks, fused and unfused joins): logits of a batch of
  prompts within float32 rounding of the unsharded model's, and the same greedy tokens over
  several ``generate()`` steps with the KV cache, with each step's logits as close;
- expert parallelism of a Qwen3-MoE sparse block (2 ranks): the block's output within float32
  rounding of the block's own forward, for tokens routed only to another rank's experts, only
  to this rank's, and at random, a different number on each rank and none on one; the combine
  input poisoned with NaN; the same through the capturable path (``rows=``: a fixed number of
  rows per expert, here all of them); then the whole model generating.

Each also breaks the sharding on purpose (a join skipped on one layer, the other rank's experts
run) and requires the comparison to fail by far. The tolerance is each example's
``tolerance()``: 64 float32 ulps of the largest output (its docstring says why).

Skipped where transformers is not installed (the ``hf`` extra; scripts/venv.sh installs it).
"""
from __future__ import annotations

import copy
import importlib.util
import random
import sys
from pathlib import Path

import pytest

from _dist import run_distributed

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
#: greedy decode steps compared after the prompt
STEPS = 5

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install -e '.[hf]')")


def _examples():
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))


def _max_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def _same_greedy(tokens, logits, want_tokens, want_logits, atol: float) -> None:
    """The sharded model's greedy tokens equal the unsharded model's, and so do the logits of
    every step. A row may part ways only where the unsharded model's top two logits lie within
    ``2 * atol`` (a tie that rounding decides); that row is compared up to there."""
    import torch

    for b in range(want_tokens.shape[0]):
        differ = (tokens[b] != want_tokens[b]).nonzero()
        upto = int(differ[0]) if len(differ) else want_tokens.shape[1]
        if upto < want_tokens.shape[1]:
            top2 = want_logits[b, upto].topk(2).values
            assert float(top2[0] - top2[1]) <= 2 * atol, (
                f"row {b}: token {int(tokens[b, upto])} at step {upto}, the unsharded model "
                f"picked {int(want_tokens[b, upto])} (top-2 gap {float(top2[0] - top2[1]):.3g}, "
                f"no tie)")
        n = min(upto + 1, want_tokens.shape[1])
        torch.testing.assert_close(logits[b, :n], want_logits[b, :n], rtol=0, atol=atol)


def _skip_join(partial, residual, norm):
    """A fused join without its all-reduce: this rank's partial sum taken for the whole."""
    import torch

    from llcomm.hf.llama_tp import rms_eps

    h = residual + partial
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + rms_eps(norm)) * norm.weight
    return y, h


def _tp_body(rank, ws, seed):
    _examples()
    import torch
    import torch.distributed as dist

    import hf_llama_tp as H
    import llcomm
    from llcomm.hf import llama_tp as T

    ref = H.tiny_llama(seed, ranks=ws)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(1, ref.config.vocab_size, (3, 6), generator=g)      # batch of 3
    with torch.no_grad():
        want = ref(ids).logits
    want_tokens, want_steps = H.greedy(ref, ids, STEPS)
    tol = H.tolerance(want)
    comm = llcomm.Communicator(max_bytes=1 << 20)
    errs = {}
    for fused in (True, False):
        tp = T.tensor_parallel(copy.deepcopy(ref), comm, fused=fused)
        with torch.no_grad():
            got = tp(ids).logits
        errs[fused] = _max_err(got, want)
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"seed {seed}: {m}")
        tokens, steps = H.greedy(tp, ids, STEPS)
        _same_greedy(tokens, steps, want_tokens, want_steps, tol["atol"])
        everyone = [None] * ws
        dist.all_gather_object(everyone, tokens)
        assert all(torch.equal(t, tokens) for t in everyone), "ranks picked different tokens"
        if fused:   # every down_proj join handed its norm over: 1 forward + STEPS in generate
            hits = [m.hits for m in tp.modules() if isinstance(m, T.JoinedNorm)]
            assert hits == [1 + STEPS] * ref.config.num_hidden_layers, hits
            tp.model.layers[1].tp_join = _skip_join            # broken on purpose
        else:
            tp.model.layers[1].self_attn.o_proj.join = None    # broken on purpose
        with torch.no_grad():
            broken = _max_err(tp(ids).logits, want)
        assert broken > 100 * tol["atol"], (fused, broken, tol)

    bad = copy.deepcopy(ref)
    bad.config.num_key_value_heads = 2 * ws + 1
    with pytest.raises(ValueError, match="num_key_value_heads=.*world size"):
        T.tensor_parallel(bad, comm)
    comm.check()
    comm.close()
    return errs, tol["atol"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_llama_tensor_parallel(world_size):
    seed = random.randrange(1 << 30)
    results = run_distributed(_tp_body, world_size, seed, timeout=240)
    errs, atol = results[0]
    print(f"seed {seed}: largest logit error fused {errs[True]:.3g}, unfused {errs[False]:.3g}"
          f" (tolerance {atol:.3g})")


def _transport(name: str, num_experts: int, hidden: int, max_tokens: int, dtype):
    """(the transport called ``name``, its close) over a new buffer, with the combine input the
    experts write to poisoned (NaN) on every call, so a row the experts did not write and
    combine reads shows."""
    import torch.distributed as dist

    import llcomm
    from llcomm.hf.moe_ep import DeepEPTransport, EPBufferTransport

    nan = float("nan")
    if name == "EPBuffer":
        buf = llcomm.EPBuffer(num_experts=num_experts, hidden=hidden,
                              num_max_dispatch_tokens_per_rank=max_tokens, dtype=dtype)
        combine_input = buf.get_combine_input
        buf.get_combine_input = lambda handle: combine_input(handle).fill_(nan)

        def close():
            buf.check()
            buf.close()
        return EPBufferTransport(buf), close
    if name == "deep_ep":
        import llcomm.deep_ep as deep_ep
        buf = deep_ep.Buffer(None, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
            max_tokens, hidden, dist.get_world_size(), num_experts))
        next_buffer = buf.get_next_low_latency_combine_buffer
        buf.get_next_low_latency_combine_buffer = lambda handle: next_buffer(handle).fill_(nan)
        return DeepEPTransport(buf, num_experts, max_tokens), buf.destroy
    raise ValueError(f"no transport {name!r}")


#: The transports the expert-parallel block is checked through (llcomm/hf/moe_ep.py).
TRANSPORTS = ["EPBuffer", "deep_ep"]


def _ep_body(rank, ws, seed, transport_name):
    _examples()
    import torch

    import hf_moe_ep as M
    from llcomm.hf import moe_ep as E

    ref = M.tiny_qwen3_moe(seed, ranks=ws)
    cfg = ref.config
    block = ref.model.layers[1].mlp
    transport, close = _transport(transport_name, cfg.num_experts, cfg.hidden_size, 16,
                                  torch.float32)
    ep = E.ExpertParallelMoE(block, transport)

    per = cfg.num_experts // ws
    mine = list(range(rank * per, (rank + 1) * per))
    elsewhere = [e for e in range(cfg.num_experts) if e not in mine]
    g = torch.Generator().manual_seed(seed + 100 + rank)
    with torch.no_grad():
        x = torch.cat([M.routed_tokens(block.gate, elsewhere, 3, g),
                       torch.randn(5 + 3 * rank, cfg.hidden_size, generator=g),
                       M.routed_tokens(block.gate, mine, 2, g)])[None]
        want = block(x)
        got = ep(x)
        err = _max_err(got, want)
        tol = M.tolerance(want)
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"seed {seed}: {m}")
        # the capturable path: a fixed number of rows per expert, every row here (W * T)
        fixed = E.ExpertParallelMoE(block, transport, rows=ws * 16)
        torch.testing.assert_close(fixed(x), want, **tol, msg=lambda m: f"seed {seed}: {m}")
        # rank 1 sends nothing, rank 0 a few tokens that the other ranks' experts serve
        x = x[:, :3] if rank == 0 else x[:, :0]
        got = ep(x)
        assert got.shape == x.shape
        if rank == 0:
            torch.testing.assert_close(got, block(x), **tol)
        # broken on purpose: run the next rank's experts in place of this rank's
        wrong = E.ExpertParallelMoE(block, transport)
        wrong.experts = E.local_experts(block.experts, (rank + 1) % ws, ws)
        x = torch.randn(1, 8, cfg.hidden_size, generator=g)
        broken = _max_err(wrong(x), block(x))
        assert broken > 100 * tol["atol"], (broken, tol)

    # the whole model, every MoE block expert-parallel, each rank with prompts of its own
    model = E.expert_parallel(copy.deepcopy(ref), transport)
    ids = torch.randint(1, cfg.vocab_size, (2, 5), generator=g)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, min_new_tokens=STEPS,
              do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    want, got = ref.generate(ids, **kw), model.generate(ids, **kw)
    want_logits, got_logits = torch.stack(want.logits, 1), torch.stack(got.logits, 1)
    n = ids.shape[1]
    _same_greedy(got.sequences[:, n:], got_logits, want.sequences[:, n:], want_logits,
                 M.tolerance(want_logits)["atol"])
    close()
    return err, tol["atol"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_qwen3_moe_expert_parallel(transport):
    seed = random.randrange(1 << 30)
    results = run_distributed(_ep_body, 2, seed, transport, timeout=240)
    print(f"seed {seed}: largest block output error {max(e for e, _ in results):.3g} "
          f"(tolerance {min(t for _, t in results):.3g})")

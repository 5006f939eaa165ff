"""The steps ``llcomm bench decode`` times (llcomm/bench/decode_models.py) compute what the
transformers modules they are built from compute, on fresh random weights and inputs every run
(the seed is in the failure message):

- TP (2 ranks, gloo, reference backend, float32, a tiny Llama shape with more layers than
  weight sets): the bench's step through each join it times on the CPU (``reference``: the
  layers' own forward with ``Communicator.all_reduce``; ``reference_fused``: the fused joins)
  equals the unsharded ``LlamaDecoderLayer``\\ s' own forward within float32 rounding, with
  transformers' ``DynamicCache`` prefilled with the same context as the oracle's cache, and
  leaves every rank the same bits; with the joins dropped (the bench's ``none``) or one fused
  join made without its all-reduce it is far off.
- EP (2 ranks, reference backend, float32): the bench's MoE stack with every row computed
  equals the ``Qwen3MoeSparseMoeBlock``\\ s' own forward; without dispatch / combine (``none``)
  or with too few rows per expert it is far off.
- GPU (2 GPUs, bf16, marked gpu): the steps captured in one CUDA graph and replayed give the
  eager step's bits; TP through llcomm, its fused join and NCCL within bf16 rounding of the
  unsharded layers; EP on the peer backend bit for bit the reference backend's.

The tolerance is 64 float32 ulps of the largest output, as in examples/hf_llama_tp.py.
Skipped where transformers is not installed (the ``hf`` extra).
"""
from __future__ import annotations

import importlib.util
import random

import pytest

from _dist import run_distributed

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install -e '.[hf]')")

#: float32 tolerance in ulps of the largest output.
FP32_ULPS = 64


def _tol(want) -> float:
    import torch
    return FP32_ULPS * torch.finfo(torch.float32).eps * float(want.abs().max())


def _err(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def _dense_shape():
    from llcomm.bench import decode_models as M
    # 5 layers over 3 weight sets: each set runs with more than one next norm
    return M.DenseShape(hidden=64, q_heads=4, kv_heads=2, head_dim=16, intermediate=96,
                        layers=5, context=7)


def _unsharded_step(shape, weight_sets, seed, x, device, dtype):
    """The oracle: the unsharded layers' own forward over transformers' DynamicCache, prefilled
    with the context positions the bench's cache holds (all KV heads), then the final norm."""
    import torch
    from transformers import DynamicCache

    from llcomm.bench import decode_models as M

    layers, norm, rotary = M.dense_modules(shape, weight_sets, seed, device, dtype)
    full = M.SlotKVCache(shape, x.shape[0], M.Group(0, 1), seed + 1, device, dtype)
    cache = DynamicCache()
    for i in range(shape.layers):
        s = full.layer(i)
        cache.update(s.keys[:, :, :-1], s.values[:, :, :-1], i)
    pos = torch.full((x.shape[0], 1), shape.context, dtype=torch.long, device=device)
    emb = rotary(x, pos)
    h = x
    with torch.no_grad():
        for i in range(shape.layers):
            layer = layers[i % len(layers)]
            layer.self_attn.layer_idx = i            # this use of the weight set is layer i
            h = layer(h, attention_mask=None, position_embeddings=emb,
                      **{M.cache_argument(): cache})
        assert cache.get_seq_length() == shape.context + 1
        return norm(h)


def _hits(model) -> int:
    """Hand-overs the bench's JoinedNorms have taken so far."""
    return sum(n.hits for n in [layer.input_layernorm for layer in model.layers] + [model.norm])


def _no_reduce_fused(partial, residual, norm):
    """A fused join without its all-reduce: this rank's partial sum taken for the whole."""
    import torch

    from llcomm.hf.llama_tp import rms_eps

    h = residual + partial
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + rms_eps(norm)) * norm.weight, h


def _tp_body(rank, ws, seed):
    import torch

    import llcomm
    from llcomm.bench import decode as D
    from llcomm.bench import decode_models as M

    shape, sets, batch = _dense_shape(), 3, 3
    dev, dtype = torch.device("cpu"), torch.float32
    x = torch.randn(batch, 1, shape.hidden, generator=torch.Generator().manual_seed(seed + 7))
    want = _unsharded_step(shape, sets, seed, x, dev, dtype)
    tol = _tol(want)

    model = M.DenseTP(shape, M.Group(rank, ws), sets, seed, dev, dtype)
    cache = model.cache(batch)
    comm = llcomm.Communicator(max_bytes=1 << 16)
    cfg = D.Config(parts=("tp",), batches=[batch], ep_tokens=[], dense=shape, moe=M.MOE_CPU,
                   weight_sets=sets)
    joins = D.tp_joins(D.Rank(rank, ws, cfg), comm, (None, None, "CPU"), batch)
    assert set(joins) == {"none", "reference", "reference_fused"}, joins
    errs = {}
    with torch.no_grad():
        for name, (_, join, fused) in joins.items():
            model.set_join(join)
            hits = _hits(model)
            got = model.step(x, cache, fused)
            assert got.shape == want.shape
            # fused: every join's norm output is taken by the next norm, not computed again
            assert _hits(model) - hits == (shape.layers if fused else 0), name
            errs[name] = _err(got, want)
            wrong = D._cross_rank_wrong(got)       # a collective: every rank, every join
            if name == "none":          # broken on purpose: every join dropped
                assert errs[name] > 100 * tol, (seed, errs, tol)
                assert wrong > 0 or rank == 0, name     # each rank kept its own partials
            else:
                assert wrong == 0, name
                torch.testing.assert_close(got, want, rtol=0, atol=tol,
                                           msg=lambda m: f"seed {seed}, {name}: {m}")
        # broken on purpose: one layer's fused join without its all-reduce
        model.set_join(None)
        real = joins["reference_fused"][2]
        calls = [0]

        def one_broken(partial, residual, norm):
            calls[0] += 1
            return (_no_reduce_fused if calls[0] == 3 else real)(partial, residual, norm)

        broken = _err(model.step(x, cache, one_broken), want)
        assert calls[0] == 2 * shape.layers
        assert broken > 100 * tol, (seed, broken, tol)
    comm.check()
    comm.close()
    return errs, tol


def test_tp_step_equals_the_unsharded_layers():
    seed = random.randrange(1 << 30)
    results = run_distributed(_tp_body, 2, seed, timeout=240)
    errs, tol = results[0]
    print(f"seed {seed}: largest step output error {errs} (tolerance {tol:.3g})")


def _ep_body(rank, ws, seed):
    import torch

    import llcomm
    from llcomm.bench import decode_models as M

    shape = M.MoEShape(hidden=64, experts=8, topk=2, intermediate=16, layers=3)
    tokens, dev, dtype = 6, torch.device("cpu"), torch.float32
    g = torch.Generator().manual_seed(seed + 11 + rank)
    x = torch.randn(tokens, shape.hidden, generator=g)     # each rank its own tokens
    want = x
    with torch.no_grad():
        for block in M.moe_blocks(shape, seed, dev, dtype):
            want = want + block(want[None])[0]           # the module's own forward
    tol = _tol(want)

    buf = llcomm.EPBuffer(num_experts=shape.experts, hidden=shape.hidden,
                          num_max_dispatch_tokens_per_rank=tokens, dtype=dtype)
    errs = {}
    with torch.no_grad():
        for rows in (ws * tokens, 1):
            model = M.MoEEP(shape, M.Group(rank, ws), tokens, seed, dev, dtype, rows=rows)
            recv, y = model.buffers()
            y.fill_(float("nan"))   # poison: a row combine reads that no expert wrote shows
            got = model.step(x, model.transport(buf, recv, y))
            errs[rows] = _err(got, want)
            if rows == ws * tokens:
                torch.testing.assert_close(got, want, rtol=0, atol=tol,
                                           msg=lambda m: f"seed {seed}: {m}")
                # broken on purpose: no dispatch, no combine
                errs["none"] = _err(model.step(x, model.transport(None, *model.buffers())),
                                    want)
                assert errs["none"] > 100 * tol, (seed, errs, tol)
            else:       # broken on purpose: one row per expert leaves rows uncomputed (NaN)
                assert not bool(torch.isfinite(got).all()), (seed, errs)
    buf.check()
    buf.close()
    return errs, tol


def test_ep_step_equals_the_blocks_own_forward():
    seed = random.randrange(1 << 30)
    results = run_distributed(_ep_body, 2, seed, timeout=240)
    print(f"seed {seed}: rank 0 errors {results[0][0]} (tolerance {results[0][1]:.3g})")


# -- GPU ---------------------------------------------------------------------------------------
def _gpu_tp_body(rank, ws, seed):
    import torch

    import llcomm
    from llcomm.bench import decode as D
    from llcomm.bench import decode_models as M
    from llcomm.bench.timing import capture

    shape = M.DenseShape(hidden=1024, q_heads=16, kv_heads=4, head_dim=64, intermediate=2048,
                         layers=6, context=256)
    sets, batch, dev, dtype = 4, 8, torch.device("cuda", rank), torch.bfloat16
    x = torch.randn(batch, 1, shape.hidden, device=dev,
                    generator=torch.Generator(device=dev).manual_seed(seed)).to(dtype)
    want = _unsharded_step(shape, sets, seed, x, dev, dtype)
    model = M.DenseTP(shape, M.Group(rank, ws), sets, seed, dev, dtype)
    cache = model.cache(batch)
    comm = llcomm.Communicator(max_bytes=batch * shape.hidden * 2)
    cfg = D.Config(parts=("tp",), batches=[batch], ep_tokens=[], dense=shape, moe=M.MOE_CPU,
                   weight_sets=sets)
    symm = D.timing.torch_symm_buffer(batch * shape.hidden, dtype, dev)
    joins = D.tp_joins(D.Rank(rank, ws, cfg), comm, symm, batch)
    assert {"none", "llcomm", "llcomm_fused", "nccl"} <= set(joins)
    out = torch.empty_like(x)
    atol = float(want.float().abs().max()) / 16          # bf16: every layer rounds to 8 bits
    with torch.no_grad():
        for name, (_, join, fused) in joins.items():
            def step(join=join, fused=fused):
                model.set_join(join)
                out.copy_(model.step(x, cache, fused))
            step()
            eager = out.clone()
            graph = capture(step, 2)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out.view(torch.int16), eager.view(torch.int16)), name
            wrong = D._cross_rank_wrong(out)
            err = _err(out, want)
            if name == "none":
                assert err > atol and (wrong > 0 or rank == 0), (name, err, atol)
            else:
                assert err <= atol and wrong == 0, (name, err, atol, wrong)
    comm.check()
    comm.close()


@pytest.mark.gpu
def test_tp_step_on_gpus_graph_captured():
    run_distributed(_gpu_tp_body, 2, random.randrange(1 << 30), backend="nccl", timeout=600)


def _gpu_ep_body(rank, ws, seed):
    import torch

    import llcomm
    from llcomm.bench import decode_models as M
    from llcomm.bench.timing import capture

    shape = M.MoEShape(hidden=1024, experts=32, topk=4, intermediate=64, layers=2)
    tokens, dev, dtype = 16, torch.device("cuda", rank), torch.bfloat16
    x = torch.randn(tokens, shape.hidden, device=dev,
                    generator=torch.Generator(device=dev).manual_seed(seed + rank)).to(dtype)
    model = M.MoEEP(shape, M.Group(rank, ws), tokens, seed, dev, dtype)
    kw = dict(num_experts=shape.experts, hidden=shape.hidden,
              num_max_dispatch_tokens_per_rank=tokens, dtype=dtype)
    ref, peer = (llcomm.EPBuffer(backend=b, **kw) for b in ("reference", "peer"))
    with torch.no_grad():
        want = model.step(x, model.transport(ref, *model.buffers()))
        transport = model.transport(peer, *model.buffers())
        out = torch.empty_like(x)

        def step():
            out.copy_(model.step(x, transport))
        step()
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))
        graph = capture(step, 2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    peer.check()
    for b in (ref, peer):
        b.close()


@pytest.mark.gpu
def test_ep_step_on_gpus_graph_captured():
    run_distributed(_gpu_ep_body, 2, random.randrange(1 << 30), backend="nccl", timeout=600)

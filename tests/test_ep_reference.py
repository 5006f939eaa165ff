"""EPBuffer on the reference backend (gloo, CPU) against the single-process oracle, and the
validation of every argument. Each distributed body runs many cases in one process group, so
the CPU suite stays fast."""
import pytest
import torch

import llcomm

from _dist import run_distributed
from test_ep_oracle import (KINDS, expert_fn, make_case, oracle_combine, oracle_combine_f64,
                            oracle_dispatch)


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _expect(errors, what, exc, words, fn):
    """Run ``fn``; append to ``errors`` unless it raises ``exc`` with every one of ``words``."""
    try:
        fn()
    except exc as e:
        missing = [wd for wd in words if wd not in str(e)]
        if missing:
            errors.append(f"{what}: message lacks {missing}: {e}")
        return
    except Exception as e:  # noqa: BLE001  (any other error is the finding, recorded)
        errors.append(f"{what}: raised {type(e).__name__}: {e}")
        return
    errors.append(f"{what}: did not raise {exc.__name__}")


def _check_one(buf, rank, W, E, T, H, topk, seed, kind, dtype):
    """Dispatch + experts + combine of one case; returns a list of failure strings."""
    xs, topks, weights = make_case(W, E, T, H, topk, seed, kind, dtype)
    fails = []
    tag = f"[W={W} E={E} T={T} H={H} topk={topk} seed={seed} kind={kind} {dtype}]"
    out_poison = torch.full((E // W, W * T, H), float("nan"), dtype=dtype)
    recv_x, recv_count, handle = buf.dispatch(xs[rank], topks[rank], out=out_poison)
    if recv_x.data_ptr() != out_poison.data_ptr():
        fails.append(f"{tag} dispatch did not fill out=")
    exp_x, exp_count, exp_src = oracle_dispatch(xs, topks, W, E, T)[rank]
    if not torch.equal(recv_count, exp_count):
        fails.append(f"{tag} recv_count {recv_count.tolist()} != {exp_count.tolist()}")
        return fails
    for e in range(E // W):
        c = int(exp_count[e])
        if not torch.equal(_bits(recv_x[e, :c]), _bits(exp_x[e, :c])):
            fails.append(f"{tag} recv_x rows of local expert {e} differ")
        if not torch.equal(handle.src_info[e, :c], exp_src[e, :c]):
            fails.append(f"{tag} src_info of local expert {e}: {handle.src_info[e, :c].tolist()} "
                         f"!= {exp_src[e, :c].tolist()}")
        # self-checking payload: column 0 = source rank + 1, column 1 = source token + 1
        if c and not (torch.equal(recv_x[e, :c, 0].float() - 1, handle.src_rank()[e, :c].float())
                      and torch.equal(recv_x[e, :c, 1].float() - 1,
                                      handle.src_token()[e, :c].float())):
            fails.append(f"{tag} payload of local expert {e} does not match its source")
    # experts, then combine (every rank computes every rank's expert outputs for the oracle)
    all_out = [expert_fn(*oracle_dispatch(xs, topks, W, E, T)[q][:2], q) for q in range(W)]
    mine = expert_fn(recv_x, recv_count, rank)
    y = buf.combine(mine, topks[rank], weights[rank], handle)
    exp = oracle_combine(all_out, topks, weights, W, E, dtype)[rank]
    if y.shape != exp.shape or not torch.equal(_bits(y), _bits(exp)):
        fails.append(f"{tag} combine differs from the ordered oracle "
                     f"(max abs diff {(y.float() - exp.float()).abs().max() if y.numel() else 0})")
    ref = oracle_combine_f64(all_out, topks, weights, W, E)[rank]
    tol = 2 ** -6 if dtype != torch.float32 else 1e-5
    if y.numel() and not torch.allclose(y.double(), ref, rtol=tol, atol=tol):
        fails.append(f"{tag} combine is not close to the exact sum")
    y2 = buf.combine(mine, topks[rank], weights[rank], handle,
                     out=torch.full_like(exp, float("nan")))
    if not torch.equal(_bits(y2), _bits(y)):
        fails.append(f"{tag} combine is not reproducible")
    return fails


def _reference_body(rank, W, configs):
    import llcomm.ep as ep
    fails = []
    for (E, T, H, topk, dtype, seeds) in configs:
        buf = ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                          dtype=dtype, backend="reference")
        assert buf.backend == "reference" and buf.device.type == "cpu"
        for seed in seeds:
            for kind in KINDS:
                fails += _check_one(buf, rank, W, E, T, H, topk, seed, kind, dtype)
    return fails


CONFIGS_2 = [
    (8, 6, 32, 3, torch.bfloat16, (1, 2, 3)),
    (4, 9, 16, 1, torch.bfloat16, (4, 5)),
    (16, 4, 8, 4, torch.float32, (6,)),
    (2, 5, 24, 2, torch.float16, (7,)),
]
CONFIGS_4 = [
    (8, 5, 32, 2, torch.bfloat16, (1, 2, 3)),
    (12, 3, 16, 5, torch.float32, (4,)),
]


@pytest.mark.parametrize("W,configs", [(2, CONFIGS_2), (4, CONFIGS_4)], ids=["w2", "w4"])
def test_reference_matches_oracle(W, configs):
    results = run_distributed(_reference_body, W, configs)
    fails = [f for r in results for f in r]
    assert not fails, "\n".join(fails[:20])


def _lifetime_body(rank, W):
    import llcomm.ep as ep
    E, T, H, K = 8, 4, 16, 2
    buf = ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                      backend="reference")
    cases = [make_case(W, E, T, H, K, seed, "random") for seed in (11, 12, 13)]
    got = []
    # two outstanding dispatches, combined in reverse order
    h = []
    for xs, topks, _ in cases[:2]:
        rx, rc, hd = buf.dispatch(xs[rank], topks[rank])
        h.append((rx.clone(), rc.clone(), hd))
    for i in (1, 0):
        xs, topks, ws = cases[i]
        rx, rc, hd = h[i]
        got.append(buf.combine(expert_fn(rx, rc, rank), topks[rank], ws[rank], hd))
    # a third dispatch reuses the first handle's slot: the first handle is refused
    xs, topks, ws = cases[2]
    buf.dispatch(xs[rank], topks[rank])
    try:
        buf.combine(expert_fn(*h[0][:2], rank), cases[0][1][rank], cases[0][2][rank], h[0][2])
        stale = None
    except ValueError as e:
        stale = str(e)
    other = ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                        backend="reference")
    try:
        other.combine(expert_fn(*h[1][:2], rank), cases[1][1][rank], cases[1][2][rank], h[1][2])
        foreign = None
    except ValueError as e:
        foreign = str(e)
    return stale, foreign, [g.shape for g in got]


def test_handle_lifetime():
    for stale, foreign, shapes in run_distributed(_lifetime_body, 2):
        assert stale is not None and "reused its buffer slot" in stale
        assert foreign is not None and "another EPBuffer" in foreign


def _validation_body(rank, W):
    import llcomm.ep as ep
    E, T, H, K = 8, 4, 16, 2
    L = E // W
    buf = ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                      backend="reference")
    x = torch.randn(3, H).to(torch.bfloat16)
    idx = torch.tensor([[0, 5], [7, -1], [-1, -1]])
    w = torch.rand(3, K)
    good_out = torch.empty(L, W * T, H, dtype=torch.bfloat16)
    _, _, handle = buf.dispatch(x, idx)   # collective: both ranks, same sequence
    eo = torch.zeros(L, W * T, H, dtype=torch.bfloat16)

    results = []

    def expect(what, exc, words, fn):
        try:
            fn()
        except exc as e:
            msg = str(e)
            missing = [wd for wd in words if wd not in msg]
            results.append((what, None if not missing else f"message lacks {missing}: {msg}"))
            return
        except Exception as e:  # noqa: BLE001  (any other error is the finding, recorded)
            results.append((what, f"raised {type(e).__name__}: {e}"))
            return
        results.append((what, "did not raise"))

    d = buf.dispatch
    expect("x not a tensor", TypeError, ["x must be a torch.Tensor"], lambda: d([[1.0]], idx))
    expect("x dtype", TypeError, ["x has dtype float32"], lambda: d(x.float(), idx))
    expect("x shape", ValueError, ["x has shape (3, 8)"], lambda: d(x[:, :8].contiguous(), idx))
    expect("x 1-D", ValueError, ["x has shape"], lambda: d(x[0], idx))
    expect("x too many tokens", ValueError, ["num_max_dispatch_tokens_per_rank=4"],
           lambda: d(torch.zeros(5, H, dtype=torch.bfloat16), torch.zeros(5, K, dtype=torch.int64)))
    expect("x not contiguous", ValueError, ["x is not contiguous"],
           lambda: d(torch.zeros(H, 3, dtype=torch.bfloat16).t(), idx))
    expect("topk dtype", TypeError, ["topk_idx has dtype int32"], lambda: d(x, idx.int()))
    expect("topk rows", ValueError, ["topk_idx has 2 rows"], lambda: d(x, idx[:2]))
    expect("topk 1-D", ValueError, ["topk_idx has shape"], lambda: d(x, idx[:, 0].contiguous()))
    expect("topk too wide", ValueError, ["topk=33"],
           lambda: d(x, torch.zeros(3, 33, dtype=torch.int64)))
    expect("topk values high", ValueError, ["[0, 8)"], lambda: d(x, idx.clamp(max=6) + 2))
    expect("topk values low", ValueError, ["-1 (no expert)"], lambda: d(x, idx - 1))
    expect("dispatch out shape", ValueError, ["out has shape"],
           lambda: d(x, idx, out=torch.empty(L, W * T - 1, H, dtype=torch.bfloat16)))
    expect("dispatch out not contiguous", ValueError, ["out is not contiguous"],
           lambda: d(x, idx, out=good_out.transpose(1, 2).contiguous().transpose(1, 2)))
    expect("dispatch out dtype", TypeError, ["out has dtype"],
           lambda: d(x, idx, out=good_out.float()))
    expect("two problems at once", TypeError, ["x has dtype", "topk_idx has dtype"],
           lambda: d(x.float(), idx.int()))

    c = buf.combine
    expect("handle type", TypeError, ["handle must be the EPHandle"], lambda: c(eo, idx, w, None))
    expect("expert_out shape", ValueError, ["expert_out has shape"],
           lambda: c(eo[:, :4].contiguous(), idx, w, handle))
    expect("expert_out dtype", TypeError, ["expert_out has dtype"],
           lambda: c(eo.float(), idx, w, handle))
    expect("combine topk rows", ValueError, ["expected num_tokens=3"],
           lambda: c(eo, idx[:2], w[:2], handle))
    expect("combine topk width", ValueError, ["the dispatch had 2"],
           lambda: c(eo, idx[:, :1].contiguous(), w[:, :1].contiguous(), handle))
    expect("weights dtype", TypeError, ["topk_weights has dtype bfloat16"],
           lambda: c(eo, idx, w.to(torch.bfloat16), handle))
    expect("weights shape", ValueError, ["topk_weights has shape (3, 1)"],
           lambda: c(eo, idx, w[:, :1].contiguous(), handle))
    expect("combine out shape", ValueError, ["out has shape (2, 16)"],
           lambda: c(eo, idx, w, handle, out=torch.empty(2, H, dtype=torch.bfloat16)))

    mk = ep.EPBuffer
    expect("experts not divisible", ValueError, ["not a multiple of the number of ranks"],
           lambda: mk(num_experts=E + 1, hidden=H, num_max_dispatch_tokens_per_rank=T,
                      backend="reference"))
    expect("hidden alignment", ValueError, ["multiple of 16 bytes"],
           lambda: mk(num_experts=E, hidden=12, num_max_dispatch_tokens_per_rank=T,
                      backend="reference"))
    expect("tokens zero", ValueError, ["num_max_dispatch_tokens_per_rank=0"],
           lambda: mk(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=0,
                      backend="reference"))
    expect("backend name", ValueError, ["backend='nvshmem'", "auto, peer, reference"],
           lambda: mk(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                      backend="nvshmem"))
    expect("dtype", TypeError, ["dtype=torch.int8"],
           lambda: mk(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                      dtype=torch.int8, backend="reference"))
    expect("peer without GPUs", Exception, ["backend='reference'"],
           lambda: mk(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                      backend="peer"))
    # FP8 arguments
    expect("use_fp8 needs hidden % 128", ValueError, ["use_fp8=True", "hidden=16"],
           lambda: d(x, idx, use_fp8=True))
    expect("round_scale without use_fp8", ValueError, ["round_scale=True needs use_fp8=True"],
           lambda: d(x, idx, round_scale=True))
    expect("use_fp8 not a bool", TypeError, ["use_fp8='yes'"], lambda: d(x, idx, use_fp8="yes"))
    expect("fp8 buffer with hidden 16", ValueError, ["hidden=16", "fp8=True"],
           lambda: mk(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                      backend="reference", fp8=True))
    expect("fp8 not a bool", TypeError, ["fp8=1"],
           lambda: mk(num_experts=E, hidden=128, num_max_dispatch_tokens_per_rank=T,
                      backend="reference", fp8=1))
    b8 = mk(num_experts=E, hidden=128, num_max_dispatch_tokens_per_rank=T, backend="reference",
            fp8=True)
    x8 = torch.randn(3, 128).to(torch.bfloat16)
    expect("bf16 dispatch on an fp8 buffer", ValueError, ["created with fp8=True"],
           lambda: b8.dispatch(x8, idx))
    expect("fp8 out not a pair", TypeError, ["out must be the pair"],
           lambda: b8.dispatch(x8, idx, use_fp8=True,
                               out=torch.empty(L, W * T, 128, dtype=torch.float8_e4m3fn)))
    expect("fp8 out dtypes and shapes", TypeError, ["out[0] has dtype bfloat16",
                                                    "out[1] has shape (4, 8, 2)"],
           lambda: b8.dispatch(x8, idx, use_fp8=True,
                               out=(torch.empty(L, W * T, 128, dtype=torch.bfloat16),
                                    torch.empty(L, W * T, 2))))
    # wait_stats: checked as a tensor first, then refused on this backend (peer only)
    i64 = torch.zeros(W, dtype=torch.int64)
    for name, call in (("dispatch", lambda s: d(x, idx, wait_stats=s)),
                       ("combine", lambda s: buf.combine(eo, idx, w, handle, wait_stats=s))):
        expect(f"{name} wait_stats dtype", TypeError, [f"EPBuffer.{name}",
                                                       "wait_stats has dtype int32"],
               lambda call=call: call(i64.int()))
        expect(f"{name} wait_stats shape", ValueError, ["wait_stats has shape (3,)",
                                                        f"[num_ranks] = [{W}]"],
               lambda call=call: call(torch.zeros(3, dtype=torch.int64)))
        expect(f"{name} wait_stats type", TypeError, ["wait_stats must be a torch.Tensor"],
               lambda call=call: call([0] * W))
        expect(f"{name} wait_stats device", ValueError, ["wait_stats is on meta"],
               lambda call=call: call(torch.zeros(W, dtype=torch.int64, device="meta")))
        expect(f"{name} wait_stats on reference", NotImplementedError,
               [f"EPBuffer.{name}", "wait_stats needs the kernels"],
               lambda call=call: call(i64))
    if i64.tolist() != [0] * W:
        results.append(("wait_stats", f"a refused call changed it: {i64.tolist()}"))
    # after all those refusals the buffer still works (nothing was touched)
    rx, rc, h2 = buf.dispatch(x, idx)
    y = buf.combine(expert_fn(rx, rc, rank), idx, w, h2)
    results.append(("still works", None if y.shape == (3, H) else f"shape {y.shape}"))
    # closed: every op refuses, the hooks of a split-phase call too (a collective, both ranks)
    _, _, h3, recv = buf.dispatch(x, idx, return_recv_hook=True)
    buf.close()
    buf.close()                                 # twice: a no-op
    closed = ["this EPBuffer was closed"]
    expect("dispatch after close", llcomm.CommClosedError, ["EPBuffer.dispatch"] + closed,
           lambda: d(x, idx))
    expect("combine after close", llcomm.CommClosedError, ["EPBuffer.combine"] + closed,
           lambda: c(eo, idx, w, h2))
    expect("hook after close", llcomm.CommClosedError, ["receive hook"] + closed, recv)
    return results


def test_validation():
    results = run_distributed(_validation_body, 2)
    bad = [f"rank {r}: {what}: {why}" for r, res in enumerate(results) for what, why in res if why]
    assert not bad, "\n".join(bad)


# -- FP8 dispatch ---------------------------------------------------------------------------
def _fp8_body(rank, W, configs):
    """FP8 dispatch on the reference backend against the oracle: e4m3 codes and scales exact,
    dequantised rows within FP8 tolerance of the input, combine after an FP8 dispatch."""
    import llcomm.ep as ep
    from llcomm.runtime.fp8_format import dequantize
    from test_ep_oracle import oracle_dispatch_fp8
    fails = []
    for (E, T, H, topk, dtype, seeds, fp8_only) in configs:
        buf = ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                          dtype=dtype, backend="reference", fp8=fp8_only)
        L = E // W
        for seed in seeds:
            for kind in KINDS:
                for round_scale in (False, True):
                    tag = f"[W={W} E={E} T={T} H={H} {dtype} seed={seed} {kind} " \
                          f"round_scale={round_scale} fp8_only={fp8_only}]"
                    xs, topks, weights = make_case(W, E, T, H, topk, seed, kind, dtype)
                    poison = (torch.full((L, W * T, H), 0x7F, dtype=torch.uint8)
                              .view(torch.float8_e4m3fn),
                              torch.full((L, W * T, H // 128), float("nan")))
                    (q, sc), cnt, handle = buf.dispatch(xs[rank], topks[rank], use_fp8=True,
                                                        round_scale=round_scale, out=poison)
                    if (q.data_ptr() != poison[0].data_ptr()
                            or sc.data_ptr() != poison[1].data_ptr()):
                        fails.append(f"{tag} dispatch did not fill out=")
                    codes, scales, ec, es = oracle_dispatch_fp8(xs, topks, W, E, T,
                                                                round_scale)[rank]
                    if not torch.equal(cnt, ec):
                        fails.append(f"{tag} recv_count {cnt.tolist()} != {ec.tolist()}")
                        continue
                    for e in range(L):
                        c = int(ec[e])
                        if not torch.equal(q[e, :c].view(torch.uint8), codes[e, :c]):
                            fails.append(f"{tag} e4m3 rows of local expert {e} differ")
                        if not torch.equal(sc[e, :c], scales[e, :c]):
                            fails.append(f"{tag} scales of local expert {e} differ")
                        if not torch.equal(handle.src_info[e, :c], es[e, :c]):
                            fails.append(f"{tag} src_info of local expert {e} differs")
                        if round_scale and c:
                            m, _ = torch.frexp(sc[e, :c])
                            if not bool((m == 0.5).all()):
                                fails.append(f"{tag} scales are not powers of two")
                        # dequantised rows within FP8 tolerance of the source rows
                        src_rows = torch.stack([xs[s][t] for s, t in (
                            divmod(int(v), T) for v in es[e, :c])]) if c else None
                        if c:
                            deq = dequantize(q[e, :c], sc[e, :c], torch.float32)
                            blk = src_rows.float().view(c, H // 128, 128)
                            amax = blk.abs().amax(-1, keepdim=True)
                            # half an e4m3 ulp at the block max (2**-4 relative), doubled for
                            # power-of-two scales (the block max then sits lower in the range)
                            tol = amax * (2 ** -3 if round_scale else 2 ** -4) + 1e-30
                            if bool(((deq.view(c, H // 128, 128) - blk).abs() > tol).any()):
                                fails.append(f"{tag} dequantised rows of expert {e} off by more "
                                             "than FP8 rounding")
                    # combine after an FP8 dispatch: experts see the dequantised rows
                    deq_all = dequantize(q, sc, dtype)
                    y = buf.combine(expert_fn(deq_all, cnt, rank), topks[rank], weights[rank],
                                    handle)
                    all_out = []
                    for r2, (c2, s2, n2, _) in enumerate(
                            oracle_dispatch_fp8(xs, topks, W, E, T, round_scale)):
                        all_out.append(expert_fn(
                            dequantize(c2.view(torch.float8_e4m3fn), s2, dtype), n2, r2))
                    exp = oracle_combine(all_out, topks, weights, W, E, dtype)[rank]
                    if not torch.equal(_bits(y), _bits(exp)):
                        fails.append(f"{tag} combine after the FP8 dispatch differs")
        if not fp8_only:   # the same buffer still does bf16 dispatches
            fails += _check_one(buf, rank, W, E, T, H, topk, 99, "random", dtype)
    return fails


FP8_CONFIGS = [
    (8, 5, 256, 3, torch.bfloat16, (1, 2), False),
    (4, 4, 128, 2, torch.float32, (3,), True),
]


def test_fp8_dispatch_matches_oracle():
    results = run_distributed(_fp8_body, 2, FP8_CONFIGS)
    fails = [f for r in results for f in r]
    assert not fails, "\n".join(fails[:20])


# -- split phase (return_recv_hook) ---------------------------------------------------------
def _hook_body(rank, W):
    """Every result with a receive hook equals the one without; the lifetime rules hold."""
    import llcomm.ep as ep
    E, T, H, K = 8, 5, 128, 3
    L = E // W
    buf = ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                      backend="reference")
    fails = []
    for seed in (1, 2):
        for kind in KINDS:
            for fp8 in (False, True):
                tag = f"[seed={seed} {kind} fp8={fp8}]"
                xs, topks, ws = make_case(W, E, T, H, K, seed, kind)
                x, idx, w = xs[rank], topks[rank], ws[rank]
                rx, rc, h = buf.dispatch(x, idx, use_fp8=fp8)
                rx2, rc2, h2, hook = buf.dispatch(x, idx, use_fp8=fp8, return_recv_hook=True)
                x.fill_(float("nan"))           # the send half has taken the rows already
                hook()
                a = rx if fp8 else (rx,)
                b = rx2 if fp8 else (rx2,)
                if not torch.equal(rc, rc2):
                    fails.append(f"{tag} recv_count differs with the hook")
                    continue
                for e in range(L):
                    c = int(rc[e])
                    if any(not torch.equal(_bits(p[e, :c]), _bits(q[e, :c]))
                           for p, q in zip(a, b)):
                        fails.append(f"{tag} recv_x of expert {e} differs with the hook")
                    if not torch.equal(h.src_info[e, :c], h2.src_info[e, :c]):
                        fails.append(f"{tag} src_info of expert {e} differs with the hook")
                rows = ep_fp8_dequant(rx2) if fp8 else rx2
                eo = expert_fn(rows, rc2, rank)
                y = buf.combine(eo, idx, w, h)
                y2, chook = buf.combine(eo, idx, w, h2, return_recv_hook=True)
                eo.fill_(float("nan"))          # the send half has read the expert outputs
                if chook() is not None:
                    fails.append(f"{tag} the combine hook returned something")
                if not torch.equal(_bits(y), _bits(y2)):
                    fails.append(f"{tag} combine differs with the hook")

    errors = []

    def expect(what, exc, words, fn):
        _expect(errors, what, exc, words, fn)

    xs, topks, ws = make_case(W, E, T, H, K, 3, "random")
    x, idx, w = xs[rank], topks[rank], ws[rank]
    rx, rc, h, hook = buf.dispatch(x, idx, return_recv_hook=True)
    expect("dispatch while a hook is pending", ValueError, ["receive hook of dispatch #"],
           lambda: buf.dispatch(x, idx))
    expect("combine of a pending handle", ValueError, ["whose receive hook has not been"],
           lambda: buf.combine(rx, idx, w, h))
    expect("return_recv_hook not a bool", TypeError, ["return_recv_hook=1"],
           lambda: buf.combine(rx, idx, w, h, return_recv_hook=1))
    hook()
    expect("hook twice", RuntimeError, ["already been called"], hook)
    y, chook = buf.combine(expert_fn(rx, rc, rank), idx, w, h, return_recv_hook=True)
    expect("combine while a combine hook is pending", ValueError, ["receive hook of combine #"],
           lambda: buf.combine(rx, idx, w, h))
    # a dispatch may run while a combine hook is pending (separate regions and counters)
    rx3, rc3, h3 = buf.dispatch(x, idx)
    chook()
    y_ref = buf.combine(expert_fn(rx, rc, rank), idx, w, h)
    if not torch.equal(_bits(y), _bits(y_ref)):
        fails.append("combine hook with a dispatch in between differs")
    return fails + errors


def ep_fp8_dequant(pair):
    from llcomm.runtime.fp8_format import dequantize
    return dequantize(*pair)


def test_recv_hook_gives_the_same_results():
    results = run_distributed(_hook_body, 2)
    fails = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res]
    assert not fails, "\n".join(fails[:20])


def _carried_weights_body(rank, W):
    """dispatch(topk_weights=w) then combine(..., None, handle) gives the bits of combine(...,
    w, handle), with the weights' values at the time of the dispatch, plain and split-phase;
    a combine that passes weights for a carrying handle, or none for another, is refused."""
    import llcomm.ep as ep
    E, T, H, K = 8, 5, 32, 3
    buf = ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                      backend="reference")
    fails = []
    for seed in (1, 2):
        for kind in KINDS:
            tag = f"[seed={seed} {kind}]"
            xs, topks, ws = make_case(W, E, T, H, K, seed, kind)
            x, idx, w = xs[rank], topks[rank], ws[rank]
            rx, rc, h = buf.dispatch(x, idx)
            y = buf.combine(expert_fn(rx, rc, rank), idx, w, h)
            wc = w.clone()
            rx2, rc2, h2 = buf.dispatch(x, idx, topk_weights=wc)
            wc.fill_(float("nan"))          # the dispatch has taken the weights already
            if not h2.carries_weights or h.carries_weights:
                fails.append(f"{tag} carries_weights {h.carries_weights} / {h2.carries_weights}")
            y2 = buf.combine(expert_fn(rx2, rc2, rank), idx, None, h2)
            y3, hook = buf.combine(expert_fn(rx2, rc2, rank), idx, None, h2,
                                   return_recv_hook=True)
            hook()
            for got, how in ((y2, "plain"), (y3, "hook")):
                if not torch.equal(_bits(got), _bits(y)):
                    fails.append(f"{tag} combine with carried weights ({how}) differs")
    errors = []
    xs, topks, ws = make_case(W, E, T, H, K, 3, "random")
    x, idx, w = xs[rank], topks[rank], ws[rank]
    rx, rc, carrying = buf.dispatch(x, idx, topk_weights=w)
    rx2, rc2, plain = buf.dispatch(x, idx)
    for what, exc, words, fn in (
            ("weights for a carrying handle", ValueError, ["topk_weights must be None"],
             lambda: buf.combine(rx, idx, w, carrying)),
            ("no weights for a plain handle", TypeError, ["topk_weights must be a torch.Tensor"],
             lambda: buf.combine(rx2, idx, None, plain)),
            ("dispatch weights shape", ValueError, ["topk_weights has shape (1, 3)"],
             lambda: buf.dispatch(x, idx, topk_weights=w[:1].contiguous())),
            ("dispatch weights dtype", TypeError, ["topk_weights has dtype float16"],
             lambda: buf.dispatch(x, idx, topk_weights=w.half()))):
        _expect(errors, what, exc, words, fn)
    return fails + errors


def test_weights_carried_by_the_dispatch():
    results = run_distributed(_carried_weights_body, 2)
    fails = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res]
    assert not fails, "\n".join(fails[:20])


def _combine_input_body(rank, W):
    """get_combine_input: one tensor per handle slot, combine reads it like any expert_out."""
    import llcomm.ep as ep
    E, T, H, K = 8, 4, 32, 2
    buf = ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                      backend="reference")
    out = []
    handles = []
    for seed in (1, 2, 3):
        xs, topks, ws = make_case(W, E, T, H, K, seed, "random")
        rx, rc, h = buf.dispatch(xs[rank], topks[rank])
        handles.append(h)
        ci = buf.get_combine_input(h)
        out.append(tuple(ci.shape) == (E // W, W * T, H) and ci.dtype == torch.bfloat16)
        eo = expert_fn(rx, rc, rank)
        ci.copy_(eo)                        # "the experts write into it"
        y = buf.combine(ci, topks[rank], ws[rank], h)
        out.append(torch.equal(_bits(y), _bits(buf.combine(eo, topks[rank], ws[rank], h))))
    same = buf.get_combine_input(handles[2]).data_ptr() == \
        buf._combine_inputs[0].data_ptr()
    other = buf.get_combine_input(handles[1]).data_ptr() != \
        buf.get_combine_input(handles[2]).data_ptr()
    try:
        buf.get_combine_input(handles[0])
        stale = None
    except ValueError as e:
        stale = str(e)
    return out, same, other, stale


def test_get_combine_input():
    for out, same, other, stale in run_distributed(_combine_input_body, 2):
        assert all(out), out
        assert same and other
        assert stale is not None and "reused its buffer slot" in stale


def _masks_body(rank, W):
    """Rank masks need the kernels (peer, or SHMEM across hosts): the reference backend
    refuses enable_masks=True, by request or through "auto" (no CUDA here), on every rank; a
    buffer without masks still works, and the mask API and its validation behave as
    documented."""
    import llcomm
    import llcomm.ep as ep
    fails = []
    E, T, H, K = 8, 5, 16, 3
    for backend in ("reference", "auto"):
        if backend == "auto" and torch.cuda.is_available():
            continue
        try:
            ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                        backend=backend, enable_masks=True)
            fails.append(f"backend={backend!r}: enable_masks=True was accepted")
        except llcomm.UnsupportedConfigError as e:
            if "enable_masks=True" not in str(e) or "reference backend" not in str(e):
                fails.append(f"backend={backend!r}: message lacks the argument or 'reference "
                             f"backend': {e}")
    plain = ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                        backend="reference")
    fails += _check_one(plain, rank, W, E, T, H, K, 21, "random", torch.bfloat16)
    for fn in (plain.query_mask, plain.clean_mask, lambda: plain.set_mask(0, True)):
        name = "set_mask" if fn.__name__ == "<lambda>" else fn.__name__
        try:
            fn()
            fails.append(f"{name}() without enable_masks did not raise")
        except ValueError as e:
            if "enable_masks=True" not in str(e) or name not in str(e):
                fails.append(f"{name}(): message lacks the name or enable_masks: {e}")
    # set_mask's arguments are checked first, whatever the buffer, each named
    for args, exc, words in (((W, True), ValueError, [f"rank={W}", f"[0, {W})"]),
                             ((-1, False), ValueError, ["rank=-1"]),
                             (("0", True), TypeError, ["rank='0'"]),
                             ((True, True), TypeError, ["rank=True"]),
                             ((0, 1), TypeError, ["masked=1", "True or False"]),
                             ((W, None), TypeError, [f"rank={W}", "masked=None"])):
        try:
            plain.set_mask(*args)
            fails.append(f"set_mask{args} did not raise")
        except exc as e:
            if not all(w in str(e) for w in words) or "set_mask" not in str(e):
                fails.append(f"set_mask{args}: message lacks {words}: {e}")
        except Exception as e:  # noqa: BLE001  (any other error is the finding, recorded)
            fails.append(f"set_mask{args}: {type(e).__name__} instead of {exc.__name__}: {e}")
    try:
        ep.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                    backend="reference", enable_masks=1)
        fails.append("enable_masks=1 was accepted")
    except TypeError as e:
        if "enable_masks=1" not in str(e):
            fails.append(f"enable_masks=1: message lacks the argument: {e}")
    return fails


def test_masks_are_refused_on_reference_backend():
    fails = [f for r in run_distributed(_masks_body, 2) for f in r]
    assert not fails, "\n".join(fails)

"""Two send halves in flight per op (``EPBuffer(sends_in_flight=2)``, two-batch overlap).

- The real kernels (peer backend) on two virtual ranks under ``TRITON_INTERPRET=1``
  (``test_ep_sequences_cpu._virtual_buffers``: plain CPU regions, one thread per rank), in the
  orders engines issue: A's send, B's send, A's hook, B's hook for the dispatch and then the
  combine, and interleavings of the two ops, with full calls mixed in, over rounds enough for
  the four buffer sets to wrap; both dispatch kernels, weights carried or not. Every result is
  compared bit for bit with the oracle (``test_ep_oracle``) of fresh random inputs.
- A late receive: one rank holds back the hook of its oldest dispatch (and later combine)
  until the other rank has issued the next send half after its own two hooks, the order in
  which two buffer sets would let that send overwrite a set still to be read. With four sets
  the results are right; with the set rotation forced back to two (``REGIONS.SETS`` = 2, the
  counters still apart), the same run fails.
- The reference backend on gloo (2 and 3 ranks): the same orders, and the refusals (a third
  send half, hooks out of order, a call without a hook while one is pending, a dispatch that
  would reuse the handle slot of a combine whose hook is pending), raised before anything is
  launched and leaving the buffer usable; the size hint, argument checks, the refusal across
  hosts and ``deep_ep.Buffer``'s buffer.
- On two GPUs (``pytest -m gpu``, skipped elsewhere): the peer kernels in every order, the late
  rank's stream held back with ``torch.cuda._sleep`` before its hooks.
"""
from __future__ import annotations

import threading

import pytest
import torch

from _dist import run_distributed
from _interp import run_in_interpreter
from test_ep_oracle import expert_fn, make_case, oracle_combine, oracle_dispatch

#: Steps of one round (per rank): ``DX`` dispatch send half of batch X (its hook later: ``hDX``),
#: ``dX`` a whole dispatch; ``CX`` / ``cX`` / ``hCX`` the same for the combine of X.
#: ``r?e``: rank r waits until event e is set; ``r!e``: rank r sets event e.
ORDERS = {
    "tbo": "DA DB hDA hDB CA CB hCA hCB",
    "interleaved": "DA DB hDA CA hDB CB hCA hCB",
    "mixed": "dA DB hDB CA CB hCA hCB DA DB hDA hDB cA cB",
    # rank 0 issues send 2 after its hooks 0 and 1 while rank 1 still holds back hook 0:
    # the dispatch (weights carried, so no combine send waits for the late rank) then the
    # combine
    "late": "DA DB 1?d hDA hDB DC 0!d DD hDC hDD CA CB 1?c hCA hCB CC 0!c CD hCC hCD",
}
W_VIRTUAL, E, T, H, K = 2, 8, 4, 128, 2
#: GPU cycles a late rank's stream sleeps before its held-back hook (about 0.1 s).
LATE_CYCLES = 200_000_000


def _case(W, E, rnd, x, seed, dtype):
    return make_case(W, E, T, H, K, seed * 1000 + rnd * 10 + "ABCD".index(x), "random", dtype)


def run_order(buf, rank, W, order, rounds, seed, dtype, carry, events=None, device="cpu"):
    """Run ``ORDERS[order]`` ``rounds`` times on ``buf``; every dispatch and combine checked
    against the oracle when its results are complete. Returns the failures (an exception
    ends the run and is one). Without ``events`` (GPUs), ``r?e`` holds rank r's stream back
    (``torch.cuda._sleep``) so that its next receive half runs late."""
    fails = []
    late = order == "late"
    E = buf.num_experts
    try:
        for rnd in range(rounds):
            live: dict = {}
            for step in ORDERS[order].split():
                if "?" in step or "!" in step:
                    r, e = int(step[0]), step[2]
                    if r == rank and events is not None:
                        (events[e].wait(120) if step[1] == "?" else events[e].set())
                    elif r == rank and step[1] == "?":
                        torch.cuda._sleep(LATE_CYCLES)
                    continue
                op, x = step[:-1], step[-1]
                xs, topks, ws = _case(W, E, rnd, x, seed, dtype)
                exp = oracle_dispatch(xs, topks, W, E, T)
                xr, ir, wr = (t[rank].to(device) for t in (xs, topks, ws))
                tag = f"round {rnd} {step}"
                if op in ("D", "d"):
                    cw = late or (carry and (rnd + "ABCD".index(x)) % 2 == 1)
                    got = buf.dispatch(xr, ir, return_recv_hook=op == "D",
                                       topk_weights=wr if cw else None)
                    live[x] = dict(got=got, cw=cw)
                    if op == "d":
                        fails += _check_dispatch(got, exp[rank], tag)
                elif op == "hD":
                    live[x]["got"][3]()
                    fails += _check_dispatch(live[x]["got"], exp[rank], tag)
                else:
                    outs = [expert_fn(*exp[q][:2], q) for q in range(W)]
                    want = oracle_combine(outs, topks, ws, W, E, dtype)[rank]
                    b = live[x]
                    w = None if b["cw"] else wr
                    eo = outs[rank].to(device)
                    if op == "c":
                        y = buf.combine(eo, ir, w, b["got"][2])
                        fails += _check_combine(y, want, tag)
                    elif op == "C":
                        b["comb"] = buf.combine(eo, ir, w, b["got"][2], return_recv_hook=True)
                    else:
                        b["comb"][1]()
                        fails += _check_combine(b["comb"][0], want, tag)
        buf.check()
    except Exception as e:  # noqa: BLE001  (the finding, with what the run got to)
        fails.append(f"{type(e).__name__}: {e}")
    return [f"rank {rank} {order}: {f}" for f in fails]


def _check_dispatch(got, exp, tag):
    recv_x, recv_count, handle = got[:3]
    want_x, want_count, want_src = exp
    if not torch.equal(recv_count.cpu(), want_count):
        return [f"{tag}: recv_count {recv_count.tolist()}, expected {want_count.tolist()}"]
    for e, c in enumerate(want_count.tolist()):
        if not (torch.equal(recv_x[e, :c].cpu().view(torch.uint8),
                            want_x[e, :c].view(torch.uint8))
                and torch.equal(handle.src_info[e, :c].cpu(), want_src[e, :c])):
            return [f"{tag}: rows or src_info of local expert {e} differ from the oracle"]
    return []


def _check_combine(y, want, tag):
    if not torch.equal(y.cpu().view(torch.uint8), want.view(torch.uint8)):
        return [f"{tag}: combine differs from the oracle"]
    return []


# -- the kernels on virtual ranks (interpreter) -------------------------------------------------
def simulate_in_flight(order, ll, rounds, seed, force_two_sets=False, timeout_ms=None,
                       masks=False):
    """``order`` on two virtual ranks with sends_in_flight=2 (LL or flag dispatch; ``masks``:
    rank masks, the flag dispatch); the failures. ``force_two_sets``: the kernels rotate over
    two sets, not four."""
    import triton.language as tl
    from _interp import run_ranks
    from llcomm.ep import peer
    from test_ep_sequences_cpu import _virtual_buffers

    if not hasattr(tl.constexpr, "__rand__"):     # as simulate_sequences (test_ep_sequences_cpu)
        tl.constexpr.__rand__ = lambda self, other: tl.constexpr(
            other & tl.core._unwrap_if_constexpr(self))
    if force_two_sets:
        consts = peer.kernel_consts

        def two_sets(*a, **k):
            d, c, nw = consts(*a, **k)
            return (dict(d, REGIONS=d["REGIONS"]._replace(SETS=2)),
                    dict(c, REGIONS=c["REGIONS"]._replace(SETS=2)), nw)
        peer.kernel_consts = two_sets
    bufs = _virtual_buffers(W_VIRTUAL, E, T, H, torch.float32, 1, ll, masks, sends_in_flight=2)
    for b in bufs:
        if timeout_ms:
            b.timeout_ms, b._impl.timeout_us = timeout_ms, timeout_ms * 1000
    events = {e: threading.Event() for e in "dc"}
    fns = [lambda r=r: run_order(bufs[r], r, W_VIRTUAL, order, rounds, seed, torch.float32,
                                 True, events) for r in range(W_VIRTUAL)]
    return [f for fs in run_ranks(fns, timeout=900) for f in fs]


@pytest.mark.parametrize("order", ["tbo", "interleaved", "mixed"])
@pytest.mark.parametrize("ll", [1, 0], ids=["ll", "flag"])
def test_two_sends_in_flight_on_virtual_ranks(order, ll):
    fails = run_in_interpreter("test_ep_in_flight_cpu", "simulate_in_flight", order, ll, 3,
                               7 + ll)
    assert not fails, "\n".join(fails[:20])


def test_two_sends_in_flight_with_rank_masks():
    """The kernels' rank-mask variants (every wait masks instead of failing; none is late)."""
    fails = run_in_interpreter("test_ep_in_flight_cpu", "simulate_in_flight", "interleaved", 0,
                               3, 11, False, None, True)
    assert not fails, "\n".join(fails[:20])


@pytest.mark.parametrize("ll", [1, 0], ids=["ll", "flag"])
def test_a_late_receive_with_four_sets_and_with_two(ll):
    """Four sets: right. Two (forced): rank 0's third send overwrites the set rank 1 has not
    read yet, and the run fails (a mismatched flag or word, or wrong rows)."""
    fails = run_in_interpreter("test_ep_in_flight_cpu", "simulate_in_flight", "late", ll, 2, 3)
    assert not fails, "\n".join(fails[:20])
    fails = run_in_interpreter("test_ep_in_flight_cpu", "simulate_in_flight", "late", ll, 1, 3,
                               True, 3000)
    assert fails, "two buffer sets with two sends in flight did not fail"


# -- the peer backend on GPUs (pytest -m gpu on a 2-GPU host) -----------------------------------
def _gpu_body(rank, W):
    from llcomm.ep import EPBuffer
    buf = EPBuffer(num_experts=4 * W, hidden=H, num_max_dispatch_tokens_per_rank=T,
                   dtype=torch.float32, backend="peer", sends_in_flight=2)
    fails = []
    for i, order in enumerate(ORDERS):      # "late": rank 1's stream sleeps before its hooks
        fails += run_order(buf, rank, W, order, 3, 40 + i, torch.float32, True,
                           device=buf.device)
    buf.close()
    return fails


@pytest.mark.gpu
def test_two_sends_in_flight_on_gpus():
    """The peer kernels on two GPUs, every order, the oracle bit for bit."""
    fails = [f for fs in run_distributed(_gpu_body, 2, backend="nccl", timeout=600) for f in fs]
    assert not fails, "\n".join(fails[:20])


# -- the reference backend (gloo) ---------------------------------------------------------------
def _reference_body(rank, W):
    from llcomm.ep import EPBuffer
    buf = EPBuffer(num_experts=4 * W, hidden=H, num_max_dispatch_tokens_per_rank=T,
                   dtype=torch.float32, backend="reference", sends_in_flight=2)
    fails = []
    for i, order in enumerate(("tbo", "interleaved", "mixed")):
        fails += run_order(buf, rank, W, order, 3, 20 + i, torch.float32, True)
    fails += _refusals(buf, rank, W)
    buf.close()
    return fails


def test_reference_backend_two_ranks():
    fails = [f for fs in run_distributed(_reference_body, 2, timeout=300) for f in fs]
    assert not fails, "\n".join(fails[:20])


def test_reference_backend_three_ranks():
    fails = [f for fs in run_distributed(_reference_body, 3, timeout=300) for f in fs]
    assert not fails, "\n".join(fails[:20])


def _refusals(buf, rank, W):
    """Each refusal raises before anything is launched; the calls after it are right."""
    from test_ep_reference import _expect
    errors: list[str] = []
    E = buf.num_experts
    xs, topks, ws = _case(W, E, 0, "A", 99, torch.float32)
    x, idx, w = xs[rank], topks[rank], ws[rank]
    exp = oracle_dispatch(xs, topks, W, E, T)
    outs = [expert_fn(*exp[q][:2], q) for q in range(W)]
    want = oracle_combine(outs, topks, ws, W, E, torch.float32)[rank]
    a = buf.dispatch(x, idx, return_recv_hook=True)
    b = buf.dispatch(x, idx, return_recv_hook=True)
    _expect(errors, "third send", ValueError,
            ["dispatch #", "sends_in_flight=2", "before the next dispatch"],
            lambda: buf.dispatch(x, idx, return_recv_hook=True))
    _expect(errors, "whole call while sends are pending", ValueError,
            ["receive hook of dispatch #", "not been called"],
            lambda: buf.dispatch(x, idx))
    _expect(errors, "hook out of order", RuntimeError,
            [f"dispatch #{b[2].index}", f"dispatch #{a[2].index}'s first"], b[3])
    a[3]()
    b[3]()
    _expect(errors, "hook twice", RuntimeError, ["already been called"], a[3])
    errors += _check_dispatch(a, exp[rank], "after the refusals (A)")
    errors += _check_dispatch(b, exp[rank], "after the refusals (B)")
    ya = buf.combine(outs[rank], idx, w, a[2], return_recv_hook=True)
    yb = buf.combine(outs[rank], idx, w, b[2], return_recv_hook=True)
    _expect(errors, "third combine send", ValueError, ["combine #", "sends_in_flight=2"],
            lambda: buf.combine(outs[rank], idx, w, b[2], return_recv_hook=True))
    _expect(errors, "combine hook out of order", RuntimeError, ["called before that of"], yb[1])
    ya[1]()
    # handle a's combine hook ran, b's has not: dispatches may go on until one would reuse b's
    # handle slot (handle_slots = 4 dispatches after it)
    c = [buf.dispatch(x, idx) for _ in range(buf.handle_slots - 1)]
    _expect(errors, "dispatch onto a pending combine's handle slot", ValueError,
            [f"handle slot of dispatch #{b[2].index}", "receive hook"],
            lambda: buf.dispatch(x, idx))
    yb[1]()
    errors += _check_combine(ya[0], want, "combine A after the refusals")
    errors += _check_combine(yb[0], want, "combine B after the refusals")
    c.append(buf.dispatch(x, idx))           # now it may
    for h in c[-2:]:
        errors += _check_dispatch(h, exp[rank], "dispatch after the refusals")
        errors += _check_combine(buf.combine(outs[rank], idx, w, h[2]), want,
                                 "combine after the refusals")
    return [f"rank {rank} refusals: {e}" for e in errors]


def test_size_hint_and_arguments():
    from llcomm import UnsupportedConfigError
    from llcomm.ep import EPBuffer
    one = EPBuffer.size_hint(128, 7168, 8, 256)
    two = EPBuffer.size_hint(128, 7168, 8, 256, sends_in_flight=2)
    assert two == 2 * one
    for bad, exc in ((3, ValueError), (0, ValueError), (True, TypeError), (2.0, TypeError)):
        with pytest.raises(exc, match="sends_in_flight"):
            EPBuffer.size_hint(128, 7168, 8, 256, sends_in_flight=bad)
    with pytest.raises(UnsupportedConfigError, match="sends_in_flight=2"):
        EPBuffer.size_hint(128, 7168, 8, 256, num_ranks_per_host=4, sends_in_flight=2)


def _construct_body(rank, W):
    import os

    from llcomm import UnsupportedConfigError
    from llcomm.deep_ep import Buffer
    from llcomm.ep import EPBuffer
    got = []
    try:
        EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                 backend="reference", sends_in_flight=3)
        got.append("sends_in_flight=3 accepted")
    except ValueError as e:
        if "sends_in_flight=3" not in str(e):
            got.append(str(e))
    d = Buffer(None, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(T, H, W, E),
               low_latency_mode=True)
    xs, topks, _ = _case(W, E, 0, "A", 5, torch.bfloat16)
    d.low_latency_dispatch(xs[rank], topks[rank], T, E)
    ep = d.ep_buffer
    if (ep.sends_in_flight, ep.handle_slots) != (2, 4):
        got.append(f"deep_ep.Buffer's EPBuffer: {ep.sends_in_flight}, {ep.handle_slots}")
    if Buffer.get_low_latency_rdma_size_hint(T, H, W, E) != EPBuffer.size_hint(
            T, H, W, E, sends_in_flight=2):
        got.append("deep_ep's size hint is not that of two sends in flight")
    # ranks declared on one host each: the two-level exchange refuses two sends in flight
    os.environ["LLCOMM_EP_RANKS_PER_HOST"] = "1"
    try:
        EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                 backend="reference", sends_in_flight=2)
        got.append("sends_in_flight=2 accepted across hosts")
    except UnsupportedConfigError as e:
        if "sends_in_flight=2" not in str(e):
            got.append(str(e))
    d2 = Buffer(None, low_latency_mode=True)      # deep_ep falls back to one
    d2.low_latency_dispatch(xs[rank], topks[rank], T, E)
    if d2.ep_buffer.sends_in_flight != 1:
        got.append("deep_ep.Buffer across hosts did not fall back to one send in flight")
    return got


def test_construction_deep_ep_and_across_hosts():
    fails = [f for fs in run_distributed(_construct_body, 2, timeout=300) for f in fs]
    assert not fails, "\n".join(fails)

"""The two-level EP kernels (``llcomm/ep/hosts/kernels/*.py``) on the CPU, under
``TRITON_INTERPRET=1``: virtual ranks grouped into virtual hosts (2x2, 2x3, 3x2: ranks per host
x hosts), the inter-host puts simulated (``SHMEM`` = 0) as stores into a simulated symmetric
heap, one CPU region per virtual rank, with the same signals and waits.

Two ways to run a call. *Concurrent*: every rank's whole kernel at once, one thread per rank,
one block each (the interpreter runs a launch's blocks one after another, so a block waiting
for a peer's second block would wait for ever), through every bounded wait. *Staged*: two
blocks per rank, the stages grouped between waits run for every rank in turn (send, forward,
expand; weights, forward, partials, host sums, out), each group's waits finding their signals
set, so the blocks' division of the work is exercised too; the ranks take their turns in
descending order in one group, ascending in the next, so a put that reaches past its slot is
caught whichever way it overlaps.

Outputs are poisoned first. Dispatch is checked byte for byte against the single-level oracle
(``test_ep_oracle``: the same rows, counts and ``src_info`` whatever the hosts; FP8 against its
quantiser), combine against ``test_ep_hosts.oracle_combine_hosts`` (the documented order: bit
for bit in fp32 and fp16, within interpreter rounding in bf16), and the bytes each rank put on
the rail against their formula here: a row once per (token, other host holding one of its
experts), so a kernel that sent a copy per expert (or per rank) fails.
"""
from __future__ import annotations

import pytest
import torch
import triton.language as tl

from _interp import run_in_interpreter
from test_ep_kernels_cpu import _rows_fails, _same_up_to_interpreter_rounding

from llcomm.ep.hosts.nic import simulated_heap

#: (ranks per host, hosts).
SHAPES = [(2, 2), (2, 3), (3, 2), (4, 2)]
#: Seeds of the lazy NIC (``llcomm/ep/hosts/nic.py``), one per shape and test.
NIC_SEEDS = {shape: i for i, shape in enumerate(SHAPES)}


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def wire_formula(topks, W: int, E: int, R: int, rank: int, row_bytes: int, H: int,
                 itemsize: int, K: int, carry: bool = False,
                 rail_fp8: bool = False) -> tuple[dict, dict]:
    """What ``rank`` sends across hosts in one call, from every rank's routing, as ``{dest:
    (messages, flags, bytes)}`` for the dispatch and the combine: one message, with one flag,
    per row out (a token and another host holding one of its experts), per id block (one to
    each other host; with ``carry`` the weights after the ids), per weights block (one to each
    other host; with ``carry`` 16 bytes that only mark the call's entry) and per host sum back
    (a token of the other host's same local rank that names this host; with ``rail_fp8`` its
    e4m3 bytes and scales). Nothing depends on the blocks, let alone the threads."""
    from llcomm.ep.hosts.layout import fp8_sum_bytes
    sum_bytes = fp8_sum_bytes(H) if rail_fp8 else H * itemsize
    L, N = E // W, W // R
    host, local = divmod(rank, R)
    n = topks[rank].shape[0]

    def hosts(entry):
        return {v // L // R for v in entry if 0 <= v < E}
    d, c = {}, {}
    for g in range(N):
        if g == host:
            continue
        dest = g * R + local
        rows = sum(g in hosts(e) for e in topks[rank].tolist())
        sums = sum(host in hosts(e) for e in topks[dest].tolist())
        d[dest] = (rows + 1, rows + 1,
                   rows * row_bytes + _align16(4 * (4 + n * K * (2 if carry else 1))))
        c[dest] = (sums + 1, sums + 1, sums * sum_bytes + (16 if carry else _align16(4 * n * K)))
    return d, c


def poisoned_handles(N, R, L, T, K):
    """Every rank's dispatch index outputs and handle slots, poisoned with -7: (row_of,
    src_info, recv_count, ntok, fwd_ids, fwd_ntok)."""
    W = N * R
    shapes = ((W, T, K), (L, W * T), (L,), (W,), (N, T, K), (N,))
    return tuple([torch.full(s, -7, dtype=torch.int32) for _ in range(W)] for s in shapes)


def stage_groups(staged: bool):
    """(dispatch, combine) stage groups: the stages between waits, or whole kernels."""
    from llcomm.ep.hosts.kernels import combine as HC
    from llcomm.ep.hosts.kernels import dispatch as HD
    if staged:
        return HD.HOSTS_DISPATCH_STEPS, HC.HOSTS_COMBINE_STEPS
    return (HD.HOSTS_DISPATCH_ALL,), (HC.HOSTS_COMBINE_ALL,)


def run_groups(groups, launch, ranks, staged: bool) -> None:
    """``launch(r, stages)`` for every rank: staged, group by group with the ranks in turn
    (descending in one group, ascending in the next); else every rank's whole kernel at once."""
    from _interp import concurrent_kernels, run_ranks
    if staged:
        with concurrent_kernels():
            for i, stages in enumerate(groups):
                for r in (ranks if i % 2 else ranks[::-1]):
                    launch(r, stages)
    else:
        run_ranks([lambda r=r: launch(r, groups[0]) for r in ranks])


def simulate_hosts(R, N, E, T, H, K, NB, dtype_name, seeds, kinds, fp8=0, staged=False,
                   nic_seed=None, carry=False, rail_fp8=False):
    """Dispatch + combine for each (seed, kind) in turn on N hosts of R virtual ranks, the
    messages across hosts landed by a lazy NIC of seed ``nic_seed`` (None: whole, at once);
    ``carry``: the dispatch carries the weights (the combine's own are poisoned, so a combine
    that read them would fail); ``rail_fp8``: the host sums cross in FP8 (against the oracle
    that quantises them, and within the documented bound of the exact sum). Return a list of
    failures (empty: all right)."""
    import triton  # noqa: F401  (TRITON_INTERPRET is set by the caller)
    from llcomm.ep.hosts import nic as NIC
    from llcomm.ep.hosts.peer import hosts_consts, ledger_by_rank, size_tag
    from llcomm.ep.hosts.layout import hosts_layout, row_bytes
    from llcomm.ep.hosts.kernels import combine as HC
    from llcomm.ep.hosts.kernels import dispatch as HD
    from llcomm.runtime import protocol as P
    from llcomm.runtime.fp8_format import dequantize
    from test_ep_hosts import oracle_combine_hosts, rail_fp8_bound_fails
    from test_ep_oracle import (expert_fn, make_case, oracle_dispatch, oracle_dispatch_fp8)

    dtype = getattr(torch, dtype_name)
    W = N * R
    L = E // W
    isz = torch.tensor([], dtype=dtype).element_size()
    # FP8 calls in a buffer sized for buffer-dtype rows, as an EPBuffer without fp8=True
    lay = hosts_layout(T, H, N, R, K, isz, NB, False, E)
    heap, tab, host_words, err, ctrl, ledger = simulated_heap(lay, NB, nic_seed=nic_seed)
    dc, cc, _ = hosts_consts(lay, E, K, fp8)
    timeout_us = 20_000_000
    d_tag = size_tag(P.OP_DISPATCH, H, K, fp8, dtype)
    c_tag = size_tag(P.OP_COMBINE, H, K, int(rail_fp8), dtype)
    d_groups, c_groups = stage_groups(staged)

    def run(groups, launch):
        run_groups(groups, launch, list(range(W)), staged)

    fails = []
    for seed in seeds:
        for kind in kinds:
            tag = f"[{N} hosts x {R} ranks, NB={NB} {dtype_name} fp8={fp8} seed={seed} {kind}]"
            xs, topks, weights = make_case(W, E, T, H, K, seed, kind, dtype)
            if fp8:
                recv = [torch.full((L, W * T, H), 0x7F, dtype=torch.uint8) for _ in range(W)]
            else:
                recv = [torch.full((L, W * T, H), float("nan"), dtype=dtype) for _ in range(W)]
            scales = [torch.full((L, W * T, max(H // 128, 1)), float("nan")) for _ in range(W)]
            row_of, src, cnt, ntok, fwd_ids, fwd_ntok = poisoned_handles(N, R, L, T, K)
            w_of = [torch.full((W, T, K), float("nan")) for _ in range(W)]
            d_carry = dict(wts=None, w_of=None, CARRY=0)
            if carry:
                d_carry = [dict(wts=weights[r], w_of=w_of[r], CARRY=1) for r in range(W)]

            def dispatch(r, stages):
                HD.hosts_dispatch_kernel[(NB,)](
                    xs[r], topks[r], xs[r].shape[0], recv[r], scales[r], row_of[r], src[r],
                    cnt[r], ntok[r], fwd_ids[r], fwd_ntok[r], tab, ctrl[r][0], err[r], r, d_tag,
                    timeout_us, ledger[r][0], None, **dict(dc, STAGES=stages, SHMEM=0),
                    **(d_carry[r] if carry else d_carry))
            run(d_groups, dispatch)

            if fp8:
                exp8 = oracle_dispatch_fp8(xs, topks, W, E, T, fp8 == 2)
                for r in range(W):
                    ec = exp8[r][2]
                    if not torch.equal(cnt[r], ec):
                        fails.append(f"{tag} rank {r} recv_count {cnt[r].tolist()} != "
                                     f"{ec.tolist()}")
                        continue
                    for e in range(L):
                        c = int(ec[e])
                        if not (torch.equal(recv[r][e, :c], exp8[r][0][e, :c])
                                and torch.equal(scales[r][e, :c], exp8[r][1][e, :c])
                                and torch.equal(src[r][e, :c], exp8[r][3][e, :c])):
                            fails.append(f"{tag} rank {r} fp8 rows, scales or src_info of "
                                         f"local expert {e} differ from the oracle")
                recv = [dequantize(recv[r].view(torch.float8_e4m3fn), scales[r], dtype)
                        for r in range(W)]
            else:
                exp = oracle_dispatch(xs, topks, W, E, T)
                for r in range(W):
                    fails += _rows_fails(tag, r, exp[r], cnt, recv, src, L)
            for r in range(W):
                if ntok[r].tolist() != [x.shape[0] for x in xs]:
                    fails.append(f"{tag} rank {r} ntok {ntok[r].tolist()}")
            if fails:
                return fails

            outs_e = [expert_fn(recv[r], cnt[r], r) for r in range(W)]
            outs = [torch.full((x.shape[0], H), float("nan"), dtype=dtype) for x in xs]

            poisoned_w = [torch.full_like(w, float("nan")) for w in weights]

            def combine(r, stages):
                HC.hosts_combine_kernel[(NB,)](
                    outs_e[r], topks[r], poisoned_w[r] if carry else weights[r],
                    xs[r].shape[0], outs[r], row_of[r], ntok[r], fwd_ids[r], fwd_ntok[r], tab,
                    ctrl[r][1], err[r], r, c_tag, timeout_us, ledger[r][1], None,
                    **dict(cc, STAGES=stages, SHMEM=0, RAIL_FP8=int(rail_fp8)),
                    **(dict(w_of=w_of[r], CARRIED=1) if carry else {}))
            run(c_groups, combine)

            want = oracle_combine_hosts(outs_e, topks, weights, W, E, R, dtype, rail_fp8)
            if rail_fp8:
                fails += rail_fp8_bound_fails(outs, outs_e, topks, weights, W, E, R, dtype, tag)
            for r in range(W):
                if not _same_up_to_interpreter_rounding(outs[r], want[r]):
                    d = (outs[r].float() - want[r].float()).abs()
                    worst = d.max() if d.numel() else 0
                    fails.append(f"{tag} rank {r} combine differs (max {worst})")
            carried = {}
            for r in range(W):
                got = (ledger_by_rank(ledger[r][0], r, R), ledger_by_rank(ledger[r][1], r, R))
                want_w = wire_formula(topks, W, E, R, r, row_bytes(H, isz, bool(fp8)), H, isz, K,
                                      carry, rail_fp8)
                if got != want_w:
                    fails.append(f"{tag} rank {r} wire ledger {got} != formula {want_w}")
                for led in got:
                    for q, v in led.items():
                        carried[q] = [a + b for a, b in zip(carried.get(q, [0, 0, 0]), v)]
            nic = NIC.current()
            if nic is not None:     # the NIC carried what the kernels counted, and all of it
                if nic.carried != carried or nic.pending:
                    fails.append(f"{tag} the NIC carried {nic.carried} ({len(nic.pending)} "
                                 f"pending), the kernels counted {carried}")
                nic.carried = {}
    calls = len(seeds) * len(kinds)
    for r in range(W):
        if ctrl[r].tolist() != [[calls] * NB, [calls] * NB]:
            fails.append(f"rank {r}: op counters {ctrl[r].tolist()}, expected {calls}")
        if int(err[r][0]) or int(host_words[r][0]):
            fails.append(f"rank {r}: error word {int(err[r][0]):#x}")
    return fails


@pytest.mark.parametrize("R,N", SHAPES)
def test_two_level_kernels_concurrent(R, N):
    """Whole kernels, every rank at once through every wait; three calls in one heap (the
    buffer sets alternate); the third with the weights carried by the dispatch."""
    seed = NIC_SEEDS[(R, N)]
    fails = run_in_interpreter("test_ep_hosts_kernels_cpu", "simulate_hosts", R, N, 4 * R * N,
                               5, 32, 3, 1, "float32", [1, 2], ["random"], 0, False, seed)
    fails += run_in_interpreter("test_ep_hosts_kernels_cpu", "simulate_hosts", R, N, 2 * R * N,
                                4, 32, 2, 1, "float16", [3], ["dups"], 0, False, seed + 10,
                                True)
    assert not fails, "\n".join(fails[:10])


@pytest.mark.parametrize("R,N", SHAPES)
def test_two_level_kernels_staged(R, N):
    """Two blocks per rank, stage groups in turn: every kind of routing, bf16 and fp32."""
    fails = run_in_interpreter("test_ep_hosts_kernels_cpu", "simulate_hosts", R, N, 2 * R * N,
                               6, 32, 3, 2, "bfloat16", [4],
                               ["random", "one_expert", "sparse", "zero_and_max", "none"],
                               0, True, NIC_SEEDS[(R, N)] + 20)
    assert not fails, "\n".join(fails[:10])


@pytest.mark.parametrize("R,N", [(2, 3), (3, 2)])
def test_two_level_kernels_staged_carried_weights(R, N):
    """Staged, the weights carried by the dispatch: the combine's own are poisoned, and it
    sends 16 bytes per other host instead of them (the ledger's formula)."""
    fails = run_in_interpreter("test_ep_hosts_kernels_cpu", "simulate_hosts", R, N, 2 * R * N,
                               6, 32, 3, 2, "float32", [6], ["random", "sparse"],
                               0, True, NIC_SEEDS[(R, N)] + 40, True)
    assert not fails, "\n".join(fails[:10])


@pytest.mark.parametrize("R,N,dtype", [(2, 2, "float16"), (2, 3, "float32")])
def test_two_level_kernels_fp8_rail_hop(R, N, dtype):
    """The host sums cross hosts in FP8 (``RAIL_FP8``): bit for bit against the oracle that
    quantises each crossing sum, and within the documented bound of the exact fp64 sum;
    concurrent, then staged with carried weights. Not bf16: the interpreter's bf16 rounding
    is not the GPU's, and one ulp of a sum can move its e4m3 code by a whole step."""
    fails = run_in_interpreter("test_ep_hosts_kernels_cpu", "simulate_hosts", R, N, 2 * R * N,
                               4, 256, 3, 1, dtype, [7], ["random"], 0, False,
                               NIC_SEEDS[(R, N)] + 50, False, True)
    fails += run_in_interpreter("test_ep_hosts_kernels_cpu", "simulate_hosts", R, N, 2 * R * N,
                                4, 256, 3, 2, dtype, [8], ["sparse"], 0, True,
                                NIC_SEEDS[(R, N)] + 60, True, True)
    assert not fails, "\n".join(fails[:10])


@pytest.mark.parametrize("fp8", [1, 2])
def test_two_level_kernels_fp8(fp8):
    """FP8 dispatch (e4m3 bytes and scales, power-of-two scales): codes and scales byte for byte
    against the oracle's quantiser, then the combine on the dequantised rows."""
    fails = run_in_interpreter("test_ep_hosts_kernels_cpu", "simulate_hosts", 2, 2, 8, 4, 256,
                               3, 2, "bfloat16", [5], ["random"], fp8, True, 30 + fp8)
    assert not fails, "\n".join(fails[:10])


def simulate_mutated(mutation: str, nic_seed):
    """One staged run on 2 hosts of 2 with the protocol broken on purpose (``mutation``):
    ``"rows_before_flag"``, the forwarder reads another host's rows as soon as that host's id
    block is there, without waiting for the rows' own flags; ``"flag_apart"``, each message's
    flag travels as a message of its own, unordered with the data (what dropping a fence
    between messages that share a flag would do). Returns the failures."""
    import ctypes

    import triton

    from llcomm.ep.hosts import nic as NIC
    from llcomm.ep.hosts.kernels import dispatch as HD
    from llcomm.ep.hosts.kernels import forward as FW
    if mutation == "rows_before_flag":
        globals()["FW"] = FW    # the interpreted replacement below reads it as a global

        @triton.jit
        def no_wait(g, fwd_ids, fwd_ntok, msk, wh, word, timeout_us, err, S, RG,
                    SHMEM: tl.constexpr, CARRY: tl.constexpr):
            """forward.forward_host without the rows' flags: every token at once."""
            ids_at = FW._at(wh.tab, wh.rank, wh.set_off + RG.RAIL_IDS + g * RG.IDS_BYTES,
                            tl.int32)
            ng = tl.load(ids_at)
            FW._count(ids_at + FW.ID_HEADER, ng, g, wh, S, RG)
            FW.announce_count(g, ng, fwd_ntok, wh, S, RG)
            for t in range(tl.program_id(0), ng, S.NB):
                FW._forward_token(g, t, FW.ids_row(ids_at + FW.ID_HEADER + t * S.K, True, S),
                                  FW._weights_row(ids_at, FW.ID_HEADER + (ng + t) * S.K, S,
                                                  CARRY),
                                  wh.set_off + RG.RAIL_ROWS + (g * S.T + t) * S.ROW_BYTES,
                                  fwd_ids, wh, S, RG, CARRY)
            return tl.full([], 1, tl.int32) != 0
        HD.forward_host = no_wait
    else:
        scratch = ctypes.c_int64(0)
        post = NIC.LazyNIC.post

        def flag_apart(self, pe, dst, src, n_bytes, sig, word):
            post(self, pe, dst, src, n_bytes, ctypes.addressof(scratch), word)
            post(self, pe, dst, src, 0, sig, word)
        NIC.LazyNIC.post = flag_apart
    return simulate_hosts(2, 2, 8, 4, 32, 2, 2, "float32", [1, 2], ["random"], 0, True,
                          nic_seed)


@pytest.mark.parametrize("mutation", ["rows_before_flag", "flag_apart"])
def test_the_lazy_nic_catches_a_broken_protocol(mutation):
    """Each mutation fails against the lazy NIC, and passes where every message lands whole at
    once (so the NIC's laziness, not the mutation's own damage, is what catches it)."""
    assert run_in_interpreter("test_ep_hosts_kernels_cpu", "simulate_mutated", mutation, 5)
    assert not run_in_interpreter("test_ep_hosts_kernels_cpu", "simulate_mutated", mutation,
                                  None)


def simulate_absent_host(R, N, timeout_us):
    """One dispatch with the ranks of the last host absent (never launched); returns, per
    surviving rank, (its error word, its recv_count, its ntok) after the bounded waits."""
    import triton  # noqa: F401  (TRITON_INTERPRET is set by the caller)
    from _interp import run_ranks
    from llcomm.ep.hosts.layout import hosts_layout
    from llcomm.ep.hosts.peer import hosts_consts, size_tag
    from llcomm.ep.hosts.kernels import dispatch as HD
    from llcomm.runtime import protocol as P
    from test_ep_oracle import make_case

    W, E, T, H, K, NB = N * R, 2 * N * R, 4, 32, 2, 1
    L = E // W
    dtype = torch.float32
    lay = hosts_layout(T, H, N, R, K, 4, NB, False, E)
    heap, tab, host_words, err, _, _ = simulated_heap(lay, NB, nic_seed=40 + R * N)
    dc, _, _ = hosts_consts(lay, E, K, 0)
    xs, topks, _ = make_case(W, E, T, H, K, 11, "random", dtype)
    cnt = [torch.full((L,), 7, dtype=torch.int32) for _ in range(W)]
    ntok = [torch.full((W,), 7, dtype=torch.int32) for _ in range(W)]
    alive = range(W - R)

    def dispatch(r):
        HD.hosts_dispatch_kernel[(NB,)](
            xs[r], topks[r], xs[r].shape[0], torch.zeros(L, W * T, H), torch.zeros(1),
            torch.zeros(W, T, K, dtype=torch.int32), torch.zeros(L, W * T, dtype=torch.int32),
            cnt[r], ntok[r], torch.zeros(N, T, K, dtype=torch.int32),
            torch.zeros(N, dtype=torch.int32), tab, torch.zeros(NB, dtype=torch.int64), err[r],
            r, size_tag(P.OP_DISPATCH, H, K, 0, dtype), timeout_us,
            torch.zeros(NB, N, 3, dtype=torch.int64), None,
            **dict(dc, STAGES=HD.HOSTS_DISPATCH_ALL, SHMEM=0))
    run_ranks([lambda r=r: dispatch(r) for r in alive])
    return [(int(host_words[r][0]), cnt[r].tolist(), ntok[r].tolist()) for r in alive]


@pytest.mark.parametrize("R,N", [(2, 2), (1, 3)])
def test_an_absent_host_times_out_every_other_rank(R, N):
    """The ranks of one host never come: every other rank's dispatch ends by its bounded rail
    wait, reports a timeout in its host error word, naming its rail rank on that host (as
    ``HostsPeerEP.precheck`` decodes it), and leaves its counts poisoned (-1)."""
    from llcomm.runtime import protocol as P
    import types

    from llcomm.ep.hosts.peer import HostsPeerEP
    got = run_in_interpreter("test_ep_hosts_kernels_cpu", "simulate_absent_host", R, N, 300_000)
    assert len(got) == (N - 1) * R
    for r, (word, cnt, ntok) in enumerate(got):
        assert word != 0, f"rank {r}: no error reported"
        me = types.SimpleNamespace(rank=r, R=R)
        e = P.decode_error(word, r, lambda phase, i: HostsPeerEP.source_rank(me, phase, i))
        assert e.__class__.__name__ == "CommTimeoutError", (r, hex(word))
        # named by global rank: its rail rank on the absent host
        assert list(e.ranks) == [(N - 1) * R + r % R], (r, e.ranks, str(e))
        assert set(cnt) == {-1} and set(ntok) == {-1}, (r, cnt, ntok)


def simulate_held_back_host(R, N, watch_s):
    """One dispatch on N hosts of R virtual ranks with host 1's ranks held back: the others
    start, and for up to ``watch_s`` seconds the rows every forwarder of the other hosts must
    place in its host (its own tokens' and those of every host but 1) are looked for in the
    ranks' heaps; then host 1 starts. Returns (rows expected, rows seen before host 1 started,
    the failures of the whole dispatch against the oracle)."""
    import threading
    import time

    import triton  # noqa: F401  (TRITON_INTERPRET is set by the caller)
    from _interp import concurrent_kernels
    from llcomm.ep.hosts.layout import hosts_layout
    from llcomm.ep.hosts.peer import hosts_consts, size_tag
    from llcomm.ep.hosts.kernels import dispatch as HD
    from llcomm.runtime import protocol as P
    from test_ep_oracle import make_case, oracle_dispatch

    W, E, T, H, K, NB = N * R, 2 * N * R, 4, 32, 2, 1
    L, dtype, held = E // W, torch.float32, 1
    lay = hosts_layout(T, H, N, R, K, 4, NB, False, E)
    heap, tab, host_words, err, ctrl, _ = simulated_heap(lay, NB, nic_seed=50 + W)
    dc, _, _ = hosts_consts(lay, E, K, 0)
    xs, topks, _ = make_case(W, E, T, H, K, 13, "random", dtype)
    recv = [torch.full((L, W * T, H), float("nan")) for _ in range(W)]
    cnt = [torch.full((L,), -7, dtype=torch.int32) for _ in range(W)]
    src = [torch.full((L, W * T), -7, dtype=torch.int32) for _ in range(W)]
    ntok = [torch.full((W,), -7, dtype=torch.int32) for _ in range(W)]

    def dispatch(r):
        HD.hosts_dispatch_kernel[(NB,)](
            xs[r], topks[r], xs[r].shape[0], recv[r], torch.zeros(1),
            torch.zeros(W, T, K, dtype=torch.int32), src[r], cnt[r], ntok[r],
            torch.zeros(N, T, K, dtype=torch.int32), torch.zeros(N, dtype=torch.int32), tab,
            ctrl[r][0], err[r], r, size_tag(P.OP_DISPATCH, H, K, 0, dtype), 120_000_000,
            torch.zeros(NB, N, 3, dtype=torch.int64), None,
            **dict(dc, STAGES=HD.HOSTS_DISPATCH_ALL, SHMEM=0))

    # (rank q, source s, token t) of every row a forwarder on a host other than 1 places in
    # its host for a source not on host 1
    want = [(q, s, t) for q in range(W) if q // R != held for s in range(W) if s // R != held
            for t in range(xs[s].shape[0]) if any(int(e) // L == q for e in topks[s][t].tolist())]
    base = lay.offsets["d_host_rows"]

    def placed(q, s, t):
        at = base + (s * T + t) * lay.row_bytes
        return torch.equal(heap[q][at:at + 4 * H].view(torch.float32), xs[s][t])

    threads = {}
    with concurrent_kernels():
        def start(ranks):
            for r in ranks:
                threads[r] = threading.Thread(target=dispatch, args=(r,), daemon=True)
                threads[r].start()
        start([r for r in range(W) if r // R != held])
        end = time.monotonic() + watch_s
        while time.monotonic() < end and not all(placed(*w) for w in want):
            time.sleep(0.05)
        seen = sum(placed(*w) for w in want)
        start(range(held * R, (held + 1) * R))
        for t in threads.values():
            t.join(300)
        stuck = [r for r, t in threads.items() if t.is_alive()]
    fails = [f"ranks {stuck} never finished"] if stuck else []
    exp = oracle_dispatch(xs, topks, W, E, T)
    for r in range(W):
        fails += _rows_fails("[held-back host]", r, exp[r], cnt, recv, src, L)
        if int(host_words[r][0]):
            fails.append(f"rank {r}: error word {int(host_words[r][0]):#x}")
    return len(want), seen, fails


@pytest.mark.parametrize("R,N", [(2, 3), (1, 3)])
def test_a_held_back_host_does_not_hold_back_the_others_rows(R, N):
    """Per-token pipelining: with host 1 not started, the forwarders of hosts 0 and 2 place
    their own tokens' rows and each other's in their hosts; host 1's rows follow once it
    starts, and the whole dispatch then matches the oracle. A forwarder that waited for every
    host's id block before moving any row (the global wait) places none of them."""
    n_want, seen, fails = run_in_interpreter("test_ep_hosts_kernels_cpu",
                                             "simulate_held_back_host", R, N, 90)
    assert n_want > 0
    assert seen == n_want, f"{seen} of {n_want} rows placed while host 1 was held back"
    assert not fails, "\n".join(fails[:10])


def simulate_wait_stats(delay_s):
    """One dispatch on 2 hosts of 2 with wait statistics (``STATS``), rank 3 starting
    ``delay_s`` late; returns every rank's ``stats`` (ns per source rank)."""
    import time

    import triton  # noqa: F401  (TRITON_INTERPRET is set by the caller)
    from _interp import run_ranks
    from llcomm.ep.hosts.layout import hosts_layout
    from llcomm.ep.hosts.peer import hosts_consts, size_tag
    from llcomm.ep.hosts.kernels import dispatch as HD
    from llcomm.runtime import protocol as P
    from test_ep_oracle import make_case

    R, N, E, T, H, K, NB = 2, 2, 8, 4, 32, 2, 1
    W, L, dtype = N * R, E // (N * R), torch.float32
    lay = hosts_layout(T, H, N, R, K, 4, NB, False, E)
    heap, tab, host_words, err, _, _ = simulated_heap(lay, NB)
    stats = [torch.zeros(W, dtype=torch.int64) for _ in range(W)]
    dc, _, _ = hosts_consts(lay, E, K, 0)
    xs, topks, _ = make_case(W, E, T, H, K, 12, "random", dtype)

    def dispatch(r):
        if r == W - 1:
            time.sleep(delay_s)
        HD.hosts_dispatch_kernel[(NB,)](
            xs[r], topks[r], xs[r].shape[0], torch.zeros(L, W * T, H), torch.zeros(1),
            torch.zeros(W, T, K, dtype=torch.int32), torch.zeros(L, W * T, dtype=torch.int32),
            torch.zeros(L, dtype=torch.int32), torch.zeros(W, dtype=torch.int32),
            torch.zeros(N, T, K, dtype=torch.int32), torch.zeros(N, dtype=torch.int32), tab,
            torch.zeros(NB, dtype=torch.int64), err[r], r, size_tag(P.OP_DISPATCH, H, K, 0, dtype),
            20_000_000, torch.zeros(NB, N, 3, dtype=torch.int64), stats[r],
            **dict(dc, STAGES=HD.HOSTS_DISPATCH_ALL, SHMEM=0, STATS=1))
    run_ranks([lambda r=r: dispatch(r) for r in range(W)])
    return [s.tolist() for s in stats]


def test_wait_statistics_name_the_rank_each_level_waited_for():
    """Rank 3 starts late. Its rail rank (1) and its host's other rank (2) wait for it
    directly, so their entry 3 holds most of the delay; rank 0 never polls rank 3 (its waits
    poll rank 2 on the rail and rank 1 in its host), so its entry 3 is 0 and the delay shows
    at rank 1, the forwarder that relays rank 3's tokens to it. The delay is long next to the
    time an interpreted rank takes to reach its waits on a loaded machine (a few hundred ms)."""
    delay_ns = 2_000_000_000
    got = run_in_interpreter("test_ep_hosts_kernels_cpu", "simulate_wait_stats", delay_ns / 1e9)
    assert got[1][3] > delay_ns // 2 and got[2][3] > delay_ns // 2, got
    assert got[0][3] == 0 and got[0][1] > delay_ns // 2, got

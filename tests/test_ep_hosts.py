"""EPBuffer across hosts: the declared topology (``LLCOMM_EP_RANKS_PER_HOST``) and the two-level
reference exchange on gloo, CPU processes grouped into virtual hosts of 2x2, 2x3 and 3x2 (ranks
per host x hosts).

Outputs are poisoned first. Dispatch is checked byte for byte against the single-level oracle of
``test_ep_oracle`` (the same rows, counts and ``src_info`` whatever the hosts), FP8 codes and
scales against its independent quantiser; combine bit for bit against ``oracle_combine_hosts``
below, a loop over hosts, ranks and entries in the documented order (docs/multihost.md), and
within rounding of the exact sum; float32 cases too, whose fp32 folds round at almost every add,
so a fold in another order fails (a host fold in reverse rank order did, at 3 ranks per host).
The bytes each rank reports on the inter-host path are checked against their formula counted
here from every rank's routing: a token once per other host that holds one of its experts, so
an exchange that sent a copy per expert fails.
"""
from __future__ import annotations

import os

import pytest
import torch

from _dist import run_distributed
from test_ep_oracle import (KINDS, _e4m3_table, expert_fn, make_case, oracle_combine,
                            oracle_combine_f64, oracle_dispatch, oracle_dispatch_fp8,
                            oracle_quantize, rank_partial, row_index)

ENV = "LLCOMM_EP_RANKS_PER_HOST"
#: (ranks per host, hosts) of the distributed runs.
SHAPES = [(2, 2), (2, 3), (3, 2)]
#: Bytes of a row's tag word and of a row count (docs/multihost.md, "Bytes").
WORD = 8


def _bits(t):
    return t.contiguous().view(torch.uint8)


# -- oracles -------------------------------------------------------------------------------------
def oracle_combine_hosts(expert_outs, topks, weights, W: int, E: int, R: int, dtype,
                         rail_fp8: bool = False):
    """Per rank ``out [n, H]``: per expert rank the k-order fold (rounded), per host the fold of
    its ranks' partials in rank order (rounded), then the fold of the hosts in host order
    (rounded); fp32 element-wise, one operation at a time. ``rail_fp8``: another host's fold
    arrives as its e4m3 codes (``oracle_quantize`` of the fp32 fold) times their scales
    (``rail_fp8_value``)."""
    L = E // W
    where = row_index(topks, W, E)
    H = expert_outs[0].shape[2]
    outs = []
    for s in range(W):
        out = torch.empty(topks[s].shape[0], H, dtype=dtype)
        for t, entry in enumerate(topks[s].tolist()):
            total = torch.zeros(H, dtype=torch.float32)
            for g in range(W // R):
                host_acc, hit = torch.zeros(H, dtype=torch.float32), False
                for q in range(g * R, (g + 1) * R):
                    acc = rank_partial(expert_outs, weights, where, entry, s, t, q, L)
                    if acc is None:
                        continue
                    host_acc, hit = host_acc + acc.to(dtype).float(), True
                if hit and rail_fp8 and g != s // R:
                    total = total + rail_fp8_value(host_acc)
                elif hit:
                    total = total + host_acc.to(dtype).float()
            out[t] = total.to(dtype)
        outs.append(out)
    return outs


def rail_fp8_value(row: torch.Tensor) -> torch.Tensor:
    """What an fp32 host sum is after an FP8 rail hop: its e4m3 codes' values (decoded from a
    table built from the bits) times their block's scale, in fp32."""
    vals, codes = _e4m3_table()
    value = torch.zeros(256, dtype=torch.float64)
    value[codes] = vals
    q, scales = oracle_quantize(row, False)
    return value[q.long()].float() * scales.repeat_interleave(128)


def rail_fp8_bound_fails(outs, expert_outs, topks, weights, W: int, E: int, R: int, dtype,
                         tag: str, ranks=None) -> list[str]:
    """The FP8 rail hop's bound (docs/multihost.md, "FP8 rail hop") against the exact fp64 sum:
    per element, each host sum that crossed a rail within ``2**-4`` of its magnitude plus
    ``2**-10`` of its 128-channel block's scale (amax / 448), plus the dtype's roundings (half
    an ulp of each partial, host sum and output). Magnitudes in fp64 with 1% slack. ``ranks``:
    the ranks whose ``outs`` to check (default all)."""
    L, N = E // W, W // R
    where = row_index(topks, W, E)
    eps = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}[dtype]
    fails = []
    for s in range(W) if ranks is None else ranks:
        for t, entry in enumerate(topks[s].tolist()):
            exact, tol = 0.0, 0.0
            for g in range(N):
                parts = [p.double() for q in range(g * R, (g + 1) * R)
                         if (p := rank_partial(expert_outs, weights, where, entry, s, t, q, L))
                         is not None]
                if not parts:
                    continue
                hs = sum(parts)
                exact = exact + hs
                tol = tol + eps * (sum(p.abs() for p in parts) + hs.abs())
                if g != s // R:
                    scale = hs.abs().reshape(-1, 128).amax(1).repeat_interleave(128) / 448
                    tol = tol + 2.0 ** -4 * hs.abs() + 2.0 ** -10 * scale
            if isinstance(exact, float):
                continue
            tol = 1.01 * (tol + eps * exact.abs())
            err = (outs[s][t].double() - exact).abs()
            if bool((err > tol).any()):
                i = int((err - tol).argmax())
                fails.append(f"{tag} rank {s} token {t}: |out - exact| {float(err[i]):.3g} over "
                             f"the FP8 rail bound {float(tol[i]):.3g} at channel {i}")
    return fails


def expected_bytes(topks, W: int, E: int, R: int, rank: int, row_bytes: int, H: int,
                   itemsize: int) -> tuple[int, int]:
    """(dispatch, combine) bytes ``rank`` puts on the inter-host path, counted from the
    routing: rows out = (token, other host holding one of its experts) pairs of this rank, rows
    in = such pairs of the other hosts' same local rank that name this host."""
    L, N, K = E // W, W // R, topks[0].shape[1]
    host, local = divmod(rank, R)

    def hosts(entry):
        return {v // L // R for v in entry if 0 <= v < E}
    rows_out = sum(len(hosts(e) - {host}) for e in topks[rank].tolist())
    rows_in = sum(host in hosts(e) for s in range(W) if s % R == local and s // R != host
                  for e in topks[s].tolist())
    dispatch = rows_out * (row_bytes + WORD * (1 + K)) + WORD * (N - 1)
    combine = rows_out * K * 4 + rows_in * H * itemsize
    return dispatch, combine


def test_one_host_order_is_the_single_level_order():
    """With one host (or one rank per host) the documented two-level order is the single-level
    one, bit for bit: a rounded value added to +0.0 and rounded again is unchanged."""
    W, E, T, H, K = 4, 8, 6, 32, 3
    xs, topks, ws = make_case(W, E, T, H, K, 5, "random")
    outs = [expert_fn(*oracle_dispatch(xs, topks, W, E, T)[q][:2], q) for q in range(W)]
    flat = oracle_combine(outs, topks, ws, W, E, torch.bfloat16)
    for R in (W, 1):
        two = oracle_combine_hosts(outs, topks, ws, W, E, R, torch.bfloat16)
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(flat, two)), R
    # with 2 hosts of 2 the extra rounding per host shows: the orders differ in some bits
    xs, topks, ws = make_case(W, E, T, H, 8, 6, "random")
    outs = [expert_fn(*oracle_dispatch(xs, topks, W, E, T)[q][:2], q) for q in range(W)]
    flat = oracle_combine(outs, topks, ws, W, E, torch.bfloat16)
    two = oracle_combine_hosts(outs, topks, ws, W, E, 2, torch.bfloat16)
    assert any(not torch.equal(_bits(a), _bits(b)) for a, b in zip(flat, two))


# -- the distributed checks ------------------------------------------------------------------------
def _dispatch_case(buf, rank, W, E, T, H, K, seed, kind, dtype, hook, tag):
    """One bf16 dispatch + combine against the oracles; returns failures."""
    R = buf.hosts.ranks_per_host
    xs, topks, ws = make_case(W, E, T, H, K, seed, kind, dtype)
    fails = []
    recv = torch.full((E // W, W * T, H), float("nan"), dtype=dtype)
    got = buf.dispatch(xs[rank], topks[rank], out=recv, return_recv_hook=hook)
    if hook:
        got[3]()
    recv_x, recv_count, handle = got[:3]
    want_d, want_c = expected_bytes(topks, W, E, R, rank, H * dtype.itemsize, H, dtype.itemsize)
    if buf.last_inter_host_bytes != want_d:
        fails.append(f"{tag} dispatch put {buf.last_inter_host_bytes} bytes across hosts, "
                     f"expected {want_d}")
    exp_x, exp_count, exp_src = oracle_dispatch(xs, topks, W, E, T)[rank]
    if not torch.equal(recv_count, exp_count):
        return fails + [f"{tag} recv_count {recv_count.tolist()} != {exp_count.tolist()}"]
    for e in range(E // W):
        c = int(exp_count[e])
        if not torch.equal(_bits(recv_x[e, :c]), _bits(exp_x[e, :c])) \
                or not torch.equal(handle.src_info[e, :c], exp_src[e, :c]):
            fails.append(f"{tag} rows or src_info of local expert {e} differ")
    all_out = [expert_fn(*oracle_dispatch(xs, topks, W, E, T)[q][:2], q) for q in range(W)]
    mine = expert_fn(recv_x, recv_count, rank)
    out = torch.full((xs[rank].shape[0], H), float("nan"), dtype=dtype)
    got = buf.combine(mine, topks[rank], ws[rank], handle, out=out, return_recv_hook=hook)
    if hook:
        got[1]()
    y = out
    if buf.last_inter_host_bytes != want_c:
        fails.append(f"{tag} combine put {buf.last_inter_host_bytes} bytes across hosts, "
                     f"expected {want_c}")
    exp = oracle_combine_hosts(all_out, topks, ws, W, E, R, dtype)[rank]
    if not torch.equal(_bits(y), _bits(exp)):
        fails.append(f"{tag} combine differs from the two-level oracle")
    ref = oracle_combine_f64(all_out, topks, ws, W, E)[rank]
    if y.numel() and not torch.allclose(y.double(), ref, rtol=2 ** -6, atol=2 ** -6):
        fails.append(f"{tag} combine is not close to the exact sum")
    again = buf.combine(mine, topks[rank], ws[rank], handle)
    if not torch.equal(_bits(again), _bits(y)):
        fails.append(f"{tag} combine is not reproducible")
    return fails


def _fp8_case(buf, rank, W, E, T, H, K, seed, round_scale, tag, kind="random", tokens=None):
    """An FP8 dispatch against the oracle (every rank's inputs cut to ``tokens`` if given)."""
    xs, topks, _ = make_case(W, E, T, H, K, seed, kind)
    if tokens is not None:
        xs, topks = [x[:tokens] for x in xs], [t[:tokens] for t in topks]
    L = E // W
    out = (torch.full((L, W * T, H), 0xFF, dtype=torch.uint8).view(torch.float8_e4m3fn),
           torch.full((L, W * T, H // 128), float("nan")))
    (q, scales), count, handle = buf.dispatch(xs[rank], topks[rank], out=out, use_fp8=True,
                                              round_scale=round_scale)
    codes, exp_scales, exp_count, exp_src = oracle_dispatch_fp8(xs, topks, W, E, T,
                                                                round_scale)[rank]
    fails = []
    want, _ = expected_bytes(topks, W, E, buf.hosts.ranks_per_host, rank, H + H // 32, H, 2)
    if buf.last_inter_host_bytes != want:
        fails.append(f"{tag} FP8 dispatch put {buf.last_inter_host_bytes} bytes, expected {want}")
    if not torch.equal(count, exp_count):
        return fails + [f"{tag} FP8 recv_count differs"]
    for e in range(L):
        c = int(exp_count[e])
        if not (torch.equal(q.view(torch.uint8)[e, :c], codes[e, :c])
                and torch.equal(_bits(scales[e, :c]), _bits(exp_scales[e, :c]))
                and torch.equal(handle.src_info[e, :c], exp_src[e, :c])):
            fails.append(f"{tag} FP8 codes, scales or src_info of local expert {e} differ")
    return fails


def _rail_fp8_case(buf, rank, W, E, T, H, K, seed, tag):
    """A combine with ``rail_fp8=True``: bit for bit the oracle that quantises each host sum
    crossing hosts, within the documented bound of the exact sum, and ``fp8_sum_bytes`` per
    host sum across hosts."""
    from llcomm.ep.hosts.layout import fp8_sum_bytes
    R = buf.hosts.ranks_per_host
    xs, topks, ws = make_case(W, E, T, H, K, seed, "random")
    recv_x, count, handle = buf.dispatch(xs[rank], topks[rank])
    all_out = [expert_fn(*oracle_dispatch(xs, topks, W, E, T)[q][:2], q) for q in range(W)]
    y = buf.combine(expert_fn(recv_x, count, rank), topks[rank], ws[rank], handle,
                    rail_fp8=True)
    fails = []
    if not torch.equal(_bits(y), _bits(oracle_combine_hosts(all_out, topks, ws, W, E, R,
                                                              torch.bfloat16, True)[rank])):
        fails.append(f"{tag} FP8 rail combine differs from the oracle")
    mine = [y if q == rank else torch.zeros(x.shape[0], H, dtype=torch.bfloat16)
            for q, x in enumerate(xs)]
    fails += rail_fp8_bound_fails(mine, all_out, topks, ws, W, E, R, torch.bfloat16, tag,
                                  [rank])
    _, want = expected_bytes(topks, W, E, R, rank, 0, fp8_sum_bytes(H), 1)
    if buf.last_inter_host_bytes != want:
        fails.append(f"{tag} FP8 rail combine put {buf.last_inter_host_bytes} bytes, expected "
                     f"{want}")
    return fails


def _same_everywhere(buf, rank, W, E, T, H, K):
    """Every rank dispatches the same tokens: every rank's combine result has the same bits."""
    xs, topks, ws = make_case(W, E, T, H, K, 9, "random")
    x, idx, w = xs[0], topks[0], ws[0]
    recv_x, count, handle = buf.dispatch(x, idx)
    y = buf.combine(expert_fn(recv_x, count, rank), idx, w, handle)
    return _bits(y)


def _hosts_body(rank, W, R, seeds):
    os.environ[ENV] = str(R)
    import torch.distributed as dist

    import llcomm
    from llcomm.ep.hosts.reference import TwoLevelReferenceEP
    E, T, H, K = 2 * W, 6, 16, 3
    buf = llcomm.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T)
    fails = []
    if not (buf.backend == "reference" and isinstance(buf._impl, TwoLevelReferenceEP)
            and "span" in buf.backend_reason and buf.hosts.num_hosts == W // R
            and buf.hosts.ranks_per_host == R and buf.hosts.source == "declared"):
        return [f"rank {rank}: not the two-level path: {buf.backend} {buf.backend_reason} "
                f"{buf.hosts}"]
    for i, seed in enumerate(seeds):
        for j, kind in enumerate(KINDS):
            hook = (i + j) % 2 == 1
            tag = f"[{R}x{W // R} rank {rank} seed {seed} {kind} hook={hook}]"
            fails += _dispatch_case(buf, rank, W, E, T, H, K, seed, kind, torch.bfloat16,
                                    hook, tag)
    # float32: its fp32 sums round at almost every add, so any other order of the folds shows
    f32 = llcomm.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                          dtype=torch.float32)
    for j, kind in enumerate(("random", "dups")):
        fails += _dispatch_case(f32, rank, W, E, T, H, 2 * K, seeds[0] + 50, kind,
                                torch.float32, j == 1, f"[{R}x{W // R} rank {rank} f32 {kind}]")
    mine = _same_everywhere(buf, rank, W, E, T, H, K)
    every = [torch.empty_like(mine) for _ in range(W)]
    dist.all_gather(every, mine)
    if any(not torch.equal(o, every[0]) for o in every):
        fails.append(f"rank {rank}: the same tokens combined on different ranks differ")
    fp8 = llcomm.EPBuffer(num_experts=E, hidden=128, num_max_dispatch_tokens_per_rank=T)
    # FP8 rows are H + H / 32 bytes (132 at H = 128): the tags behind them are not 8-byte
    # aligned, and ranks holding 0 or 1 rows make the slices of them contiguous views
    for round_scale, kind in ((False, "random"), (True, "zero_and_max"), (False, "one_expert")):
        fails += _fp8_case(fp8, rank, W, E, T, 128, K, seeds[0], round_scale,
                           f"[{R}x{W // R} rank {rank} {kind} round_scale={round_scale}]", kind)
    fails += _rail_fp8_case(fp8, rank, W, E, T, 128, K, seeds[0] + 70,
                            f"[{R}x{W // R} rank {rank} rail_fp8]")
    return fails


@pytest.mark.parametrize("R,N", SHAPES, ids=[f"{r}x{n}" for r, n in SHAPES])
def test_two_level_matches_the_oracles(R, N):
    seeds = (1, 2) if R * N == 4 else (3,)
    fails = [f for r in run_distributed(_hosts_body, R * N, R, seeds) for f in r]
    assert not fails, "\n".join(fails[:20])


def _subgroup_body(rank, world, R):
    """An EPBuffer on a group of the first four of five ranks: the fifth never takes part."""
    os.environ[ENV] = str(R)
    import torch.distributed as dist

    import llcomm
    W = world - 1
    group = dist.new_group(list(range(W)))
    if rank == W:
        return []
    E, T, H, K = 2 * W, 6, 16, 3
    buf = llcomm.EPBuffer(group, num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T)
    assert buf.hosts.num_hosts == W // R, buf.hosts
    fails = []
    for hook, kind in ((False, "random"), (True, "dups")):
        fails += _dispatch_case(buf, rank, W, E, T, H, K, 7, kind, torch.bfloat16, hook,
                                f"[subgroup rank {rank} {kind}]")
    return fails


def test_two_level_on_a_subgroup():
    fails = [f for r in run_distributed(_subgroup_body, 5, 2) for f in r]
    assert not fails, "\n".join(fails)


# -- the topology ----------------------------------------------------------------------------------
def test_detected_topology():
    from llcomm.errors import UnsupportedConfigError
    from llcomm.runtime.hosts import detected_hosts, resolve_hosts
    h = detected_hosts("EPBuffer", [("a", 8), ("a", 8), ("b", 8), ("b", 8)])
    assert (h.num_hosts, h.ranks_per_host, h.source) == (2, 2, "detected")
    assert h.host_ranks(1) == [2, 3] and h.rail_ranks(1) == [1, 3] and h.spans_hosts
    assert not detected_hosts("EPBuffer", [("a", 0)] * 3).spans_hosts
    assert resolve_hosts("EPBuffer", [("a", 0)] * 6, 3).num_hosts == 2      # declared wins
    for infos, words in (([("a", 0), ("b", 0), ("a", 0), ("b", 0)], "not consecutive"),
                         ([("a", 0), ("a", 0), ("b", 0)], "different sizes")):
        with pytest.raises(UnsupportedConfigError) as info:
            detected_hosts("EPBuffer", infos)
        assert words in str(info.value) and ENV in str(info.value)


def _settings_body(rank, W):
    """Bad declarations raise on every rank; unset, the one host is detected."""
    import llcomm
    from llcomm.ep.reference import ReferenceEP
    kw = dict(num_experts=2 * W, hidden=16, num_max_dispatch_tokens_per_rank=4)
    got = []
    for value, exc, words in (
            ("4", llcomm.UnsupportedConfigError, [f"{ENV}=4", f"divisor of {W}"]),
            (str(1 + rank % 2), llcomm.UnsupportedConfigError, [ENV, "differs between ranks"]),
            ("two", ValueError, [ENV, "positive integer"])):
        os.environ[ENV] = value
        try:
            llcomm.EPBuffer(**kw)
            got.append(f"{ENV}={value}: no error")
        except exc as e:
            missing = [w for w in words if w not in str(e)]
            if missing:
                got.append(f"{ENV}={value}: message lacks {missing}: {e}")
    os.environ[ENV] = "2"
    try:
        llcomm.EPBuffer(backend="peer", **kw)
        got.append("backend='peer' across declared hosts: no error")
    except llcomm.UnsupportedConfigError as e:
        if "span 3 hosts" not in str(e):
            got.append(f"backend='peer': {e}")
    del os.environ[ENV]
    buf = llcomm.EPBuffer(**kw)
    if buf.hosts.num_hosts != 1 or buf.hosts.source != "detected" \
            or type(buf._impl) is not ReferenceEP or buf.last_inter_host_bytes != 0:
        got.append(f"unset: {buf.hosts}, {type(buf._impl).__name__}")
    return got


def test_bad_declarations_raise_on_every_rank():
    fails = [f for r in run_distributed(_settings_body, 6) for f in r]
    assert not fails, "\n".join(fails)


def _deep_ep_body(rank, W, R, seeds):
    """``llcomm.deep_ep``'s rounds (test_deep_ep.py) on declared hosts, unchanged."""
    os.environ[ENV] = str(R)
    import llcomm.ep.api as api
    from test_deep_ep import _rounds_body
    made = []

    class Counted(api.TwoLevelReferenceEP):
        def __init__(self, *a, **kw):
            made.append(1)
            super().__init__(*a, **kw)
    api.TwoLevelReferenceEP = Counted
    import llcomm
    import llcomm.deep_ep as deep_ep
    try:        # decided as EPBuffer decides: the hosts rule the peer backend out
        deep_ep.Buffer(None, enable_shrink=True)
        fails = ["enable_shrink=True across hosts: no error"]
    except llcomm.UnsupportedConfigError as e:
        fails = [] if f"span {W // R} hosts" in str(e) else [f"enable_shrink: {e}"]
    fails += _rounds_body(rank, W, seeds)
    return fails if made else [f"rank {rank}: deep_ep did not run the two-level exchange"]


def test_deep_ep_on_declared_hosts():
    fails = [f for r in run_distributed(_deep_ep_body, 4, 2, list(range(300, 310))) for f in r]
    assert not fails, "\n".join(fails[:20])


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def test_bench_ep_ranks_per_host(tmp_path):
    """``llcomm bench ep --cpu --ranks-per-host 1``: two gloo ranks as two hosts, every result
    right (the reference's and the two-level kernels' in the interpreter), the bytes table
    printed, and with one rank per host the bytes as each counts them: the reference's dispatch
    one row and its tag per (token, GPU) on the other host plus the row count; the kernels' one
    row per (token, other host) plus an id block (dispatch) or a weights block (combine), each
    message with its flag."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    H, K = 64, 3

    def bench(*extra):
        return subprocess.run(
            [sys.executable, "-m", "llcomm", "bench", "ep", "--cpu", "--tokens", "1,8",
             "--hidden", str(H), "--experts", "8", "--topk", str(K), "--iters", "2",
             "--warmup", "1", "--no-progress", *extra], cwd=tmp_path, env=env,
            capture_output=True, text=True, timeout=300)
    p = bench("--ranks-per-host", "1", "--json", "ep.json")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "bytes put across hosts" in p.stdout
    rows = json.loads((tmp_path / "ep.json").read_text())["rows"]
    assert {r["op"] for r in rows} == {"dispatch", "combine"}
    assert {r["impl"] for r in rows} == {"reference", "interpreter"}
    for r in rows:
        assert r["wrong"] == 0 and r["ranks_per_host"] == 1, r
        assert 0 < r["per_gpu_bytes"] <= r["per_expert_bytes"], r
        n, got = r["tokens_per_rank"], r["inter_host_bytes"]
        if r["impl"] == "interpreter":  # the kernels' own count: rows (host sums), then per
            # other host an id block (weights block); each message with its 8-byte flag. Means
            # over the 2 ranks: twice each is exact
            rows = 2 * r["per_gpu_bytes"] // (H * 2)
            extra = (_align16(4 * (4 + n * K)) if r["op"] == "dispatch"
                     else _align16(4 * n * K))
            assert 2 * got == 2 * (r["per_gpu_bytes"] + extra) + WORD * (rows + 2), r
            assert 2 * r["messages"] == rows + 2, r
        elif r["op"] == "dispatch":     # means over the 2 ranks: the sums are exact
            rows = 2 * r["per_gpu_bytes"] // (H * 2)
            assert 2 * got == rows * (H * 2 + WORD * (1 + K)) + 2 * WORD, r
    p = bench("--ranks-per-host", "3")
    assert p.returncode == 2 and "--ranks-per-host 3 does not divide" in p.stdout, p.stdout


# -- ranks that stop answering ------------------------------------------------------------------
#: Bound of every wait in the fault test (ms); a call waits on at most LEVELS such bounds in a
#: row (a rail exchange that succeeds, then a host exchange that does not); SLACK_S: scheduling.
FAULT_TIMEOUT_MS, LEVELS, SLACK_S = 300, 2, 2.0
#: The call the silent ranks skip; how long they stay alive at most, waiting to be released.
SILENT_AT, SILENT_MAX_S = 3, 20.0


def _silent_body(rank, W, R, silent, released):
    """The ``silent`` ranks stay alive but stop calling at call SILENT_AT; every other rank
    must raise CommTimeoutError in that call within LEVELS bounds, with the call check off (so
    the subgroups' own waits are what catch it), and CommBrokenError afterwards."""
    os.environ[ENV] = str(R)
    import time

    import llcomm
    E, T, H, K = 2 * W, 4, 16, 2
    buf = llcomm.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                          timeout_ms=FAULT_TIMEOUT_MS, check_calls=False)
    for i in range(SILENT_AT + 1):
        xs, topks, ws = make_case(W, E, T, H, K, 40 + i, "random")
        if rank in silent and i == SILENT_AT:
            return released.wait(SILENT_MAX_S)
        t0 = time.monotonic()
        try:
            rx, rc, handle = buf.dispatch(xs[rank], topks[rank])
            buf.combine(expert_fn(rx, rc, rank), topks[rank], ws[rank], handle)
        except llcomm.CommTimeoutError as e:
            elapsed = time.monotonic() - t0
            released.set()
            assert i == SILENT_AT and elapsed < LEVELS * FAULT_TIMEOUT_MS / 1000 + SLACK_S, \
                (i, elapsed)
            with pytest.raises(llcomm.CommBrokenError):
                buf.dispatch(xs[rank], topks[rank])
            return e.op
    raise AssertionError(f"rank {rank}: every call ran although ranks {silent} stopped")


@pytest.mark.parametrize("silent", [(3,), (2, 3)], ids=["rank", "host"])
def test_ranks_that_stop_answering_raise_on_every_other_rank(silent):
    """2 hosts of 2. Rank 3 silent: rank 1 waits for it on their rail, rank 2 inside their
    host, rank 0 inside its host for rank 1, which has given up. Host 1 silent: ranks 0 and 1
    wait on their rails."""
    import torch.multiprocessing as mp
    released = mp.get_context("spawn").Event()
    got = run_distributed(_silent_body, 4, 2, silent, released, timeout=90)
    for r, g in enumerate(got):
        assert g is True if r in silent else g == "dispatch", (r, got)

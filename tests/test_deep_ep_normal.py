"""DeepEP's normal (high-throughput) mode in ``llcomm.deep_ep``, on gloo at 2, 3 and 4 ranks
(4 also as 2 declared hosts of 2), against an oracle written here from DeepEP's documented
semantics with Python loops over every rank's inputs (all ranks' inputs come from one seed):

- ``get_dispatch_layout``: tokens per rank, per host, per expert, ``is_token_in_rank``;
- ``dispatch``: rows in (source rank, token) order, bit for bit; the source token index; top-k
  as local expert indices (-1 and weight 0 elsewhere); the per-expert list rounded up to
  ``expert_alignment``; ``handle[0]`` the rank prefix matrix; the channel matrices and
  ``send_head``; bf16, FP8 with column-major scales, int32 ``topk_idx``; ranks with different
  token counts, one with none; ``num_worst_tokens`` padding; cached dispatch with the handle;
- ``combine``: each token's rows back from every rank that received it, summed in fp32 in rank
  order plus a bias pair, bitwise against the oracle's own loop; the top-k weights summed;
- bad arguments on one rank raise on every rank, and the buffer still works afterwards.
"""
from __future__ import annotations

import os

import torch

from _dist import run_distributed

H, K, LOCAL = 256, 3, 2


def _inputs(W: int, seed: int, hidden: int = H):
    """Every rank's (x, topk_idx, topk_weights), rank r with a different token count (rank 1
    none when W > 2); some top-k entries -1."""
    g = torch.Generator().manual_seed(seed)
    E = LOCAL * W
    out = []
    for r in range(W):
        T = 0 if (W > 2 and r == 1) else 5 + 3 * r
        x = torch.randn((T, hidden), generator=g, dtype=torch.float32).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
            torch.zeros((0, K), dtype=torch.int64)
        idx[torch.rand((T, K), generator=g) < 0.2] = -1
        w = torch.rand((T, K), generator=g, dtype=torch.float32)
        out.append((x, idx, w))
    return out


def _oracle_layout(idx, W):
    T = idx.shape[0]
    per_expert = [0] * (LOCAL * W)
    in_rank = [[False] * W for _ in range(T)]
    for t in range(T):
        for e in idx[t].tolist():
            if e >= 0:
                per_expert[e] += 1
                in_rank[t][e // LOCAL] = True
    per_rank = [sum(in_rank[t][r] for t in range(T)) for r in range(W)]
    return per_rank, per_expert, in_rank


def _oracle_recv(inputs, me, W):
    """(rows, source tokens, local top-k, weights, sources) rank ``me`` receives."""
    rows, src, tk, tw, who = [], [], [], [], []
    for s, (x, idx, w) in enumerate(inputs):
        _, _, in_rank = _oracle_layout(idx, W)
        for t in range(x.shape[0]):
            if in_rank[t][me]:
                rows.append(x[t])
                src.append(t)
                tk.append([e - me * LOCAL if 0 <= e - me * LOCAL < LOCAL and e >= 0 else -1
                           for e in idx[t].tolist()])
                tw.append([float(w[t, k]) if tk[-1][k] >= 0 else 0.0 for k in range(K)])
                who.append(s)
    return rows, src, tk, tw, who


def _fp8(x):
    """Per-128-channel FP8 codes and float32 scales, scales column-major as DeepEP's test."""
    T = x.shape[0]
    blocks = x.float().view(T, x.shape[1] // 128, 128)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    codes = (blocks * (448.0 / amax)[..., None]).to(torch.float8_e4m3fn).view(T, x.shape[1])
    scales = (amax / 448.0)
    return codes, scales.T.contiguous().T


def _body(rank, W, seed, ranks_per_host):
    import torch.distributed as dist

    import llcomm.deep_ep as deep_ep
    if ranks_per_host:
        os.environ["LLCOMM_EP_RANKS_PER_HOST"] = str(ranks_per_host)
    inputs = _inputs(W, seed)
    x, idx, w = inputs[rank]
    E, fails = LOCAL * W, []
    buf = deep_ep.Buffer(dist.group.WORLD, int(1e8), 0, low_latency_mode=False,
                         explicitly_destroy=True)
    idx_in = idx.to(torch.int32) if seed % 2 else idx
    per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx_in, E)
    o_rank, o_expert, o_in = _oracle_layout(idx, W)
    if per_rank.tolist() != o_rank or per_expert.tolist() != o_expert \
            or in_rank.tolist() != o_in or per_rank.dtype != torch.int32:
        fails.append(f"layout {per_rank.tolist()} {per_expert.tolist()} vs {o_rank} {o_expert}")
    want_host = None if not ranks_per_host else [
        sum(any(o_in[t][h * ranks_per_host:(h + 1) * ranks_per_host]) for t in range(len(o_in)))
        for h in range(W // ranks_per_host)]
    if (per_host.tolist() if per_host is not None else None) != want_host:
        fails.append(f"per host {per_host} vs {want_host}")

    rows, src, tk, tw, who = _oracle_recv(inputs, rank, W)
    n = len(rows)
    config = deep_ep.Config(6, 4, 64)
    for fp8 in (True, False):          # bf16 last: its results feed the combine
        xin = _fp8(x) if fp8 else x
        recv_x, r_idx, r_w, counts, handle, ev = buf.dispatch(
            xin, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx_in, topk_weights=w,
            expert_alignment=4, config=config, async_finish=True)
        ev.current_stream_wait()
        tag = f"[W={W} rank={rank} fp8={fp8}]"
        if fp8:
            codes, sc = _fp8(torch.stack(rows)) if n else (None, None)
            if n and not (torch.equal(recv_x[0].view(torch.uint8), codes.view(torch.uint8))
                          and torch.equal(recv_x[1], sc)):
                fails.append(f"{tag} FP8 rows or scales differ")
        elif (n and not torch.equal(recv_x, torch.stack(rows))) or recv_x.shape[0] != n:
            fails.append(f"{tag} rows differ ({recv_x.shape[0]} vs {n})")
        if handle[3].tolist() != src or r_idx.tolist() != tk or r_w.tolist() != tw \
                or r_idx.dtype != idx_in.dtype:
            fails.append(f"{tag} source tokens / top-k / weights differ")
        want = [sum(1 for row in tk for e in row if e == j) for j in range(LOCAL)]
        if counts != [-(-c // 4) * 4 for c in want]:
            fails.append(f"{tag} per-expert list {counts} vs {want} aligned to 4")
        sent = [[_oracle_layout(inputs[s][1], W)[0][r] for r in range(W)] for s in range(W)]
        rpm = [[sum(sent[i][j] for i in range(k + 1)) for j in range(W)] for k in range(W)]
        if handle[0].tolist() != rpm or handle[0].dtype != torch.int32:
            fails.append(f"{tag} rank prefix matrix {handle[0].tolist()} vs {rpm}")
        C = config.num_sms // 2
        step = -(-x.shape[0] // C)
        for r in range(W):
            mine = [t for t in range(x.shape[0]) if o_in[t][r]]
            chan = [sum(1 for t in mine if t < min((c + 1) * step, x.shape[0]))
                    for c in range(C)]
            heads = [(sum(1 for u in mine if c * step <= u < t) if o_in[t][r] else -1)
                     for t in range(x.shape[0]) for c in [t // step]]
            if handle[1][r].tolist() != chan or handle[5][:, r].tolist() != heads:
                fails.append(f"{tag} channel prefix / send_head toward rank {r}")

        # cached dispatch: the same rows
        again = buf.dispatch(xin, handle=handle, config=config)
        if not torch.equal((again[0][0] if fp8 else again[0]).view(torch.uint8),
                           (recv_x[0] if fp8 else recv_x).view(torch.uint8)) \
                or again[1:5] != (None, None, None, None):
            fails.append(f"{tag} cached dispatch differs")

    # combine: each rank returns f(row) = row * (rank + 1) + source rank; bias pair
    y = (recv_x.float() * (rank + 1) + torch.tensor(who, dtype=torch.float32).view(-1, 1)
         ).to(torch.bfloat16) if n else recv_x.new_zeros((0, H))
    g = torch.Generator().manual_seed(seed + 1)
    b0 = torch.randn((x.shape[0], H), generator=g).to(torch.bfloat16)
    b1 = torch.randn((x.shape[0], H), generator=g).to(torch.bfloat16)
    combined, cw, _ = buf.combine(y, handle, topk_weights=r_w, bias=(b0, b1), config=config)
    want = torch.zeros((x.shape[0], H), dtype=torch.float32)
    wsum = torch.zeros((x.shape[0], K), dtype=torch.float32)
    for t in range(x.shape[0]):
        for r in range(W):
            if o_in[t][r]:
                f = (x[t].float() * (r + 1) + rank).to(torch.bfloat16)   # what rank r returns
                want[t] = want[t] + f.float()
                lw = torch.tensor([float(w[t, k]) if idx[t, k] >= 0 and idx[t, k] // LOCAL == r
                                   else 0.0 for k in range(K)])
                wsum[t] = wsum[t] + lw
    want = ((want + b0.float()) + b1.float()).to(torch.bfloat16)
    if not torch.equal(combined, want):
        fails.append(f"[W={W} rank={rank}] combine differs from the rank-order fp32 sum")
    if not torch.equal(cw, wsum):
        fails.append(f"[W={W} rank={rank}] combined weights differ")

    # num_worst_tokens: padded results, the same prefix, top-k -1 after it
    worst = sum(inp[0].shape[0] for inp in inputs)
    wr = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                      num_tokens_per_expert=per_expert, topk_idx=idx_in, topk_weights=w,
                      num_worst_tokens=worst)
    if wr[0].shape[0] != worst or wr[3] != [] or not torch.equal(wr[0][:n], recv_x_bf16(
            rows, n, H)) or not bool((wr[1][n:] == -1).all()):
        fails.append(f"[W={W} rank={rank}] num_worst_tokens results")
    yw = torch.full((worst, H), float("nan"), dtype=torch.bfloat16)    # padding: never read
    yw[:n] = y
    cw2 = buf.combine(yw, wr[4], config=config)[0]
    if not torch.equal(cw2, _sum_no_bias(x, o_in, rank, W)):
        fails.append(f"[W={W} rank={rank}] combine of a num_worst_tokens handle")

    # bad arguments on one rank only: every rank raises, nothing moves, the buffer still works
    bad_idx = idx_in.clone()
    try:
        buf.dispatch(x, num_tokens_per_rank=per_rank + (1 if rank == 0 else 0),
                     is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                     topk_idx=bad_idx, topk_weights=w)
        fails.append(f"[rank={rank}] a wrong num_tokens_per_rank on rank 0 did not raise")
    except ValueError as e:
        if "num_tokens_per_rank" not in str(e) or "rank(s) [0]" not in str(e):
            fails.append(f"[rank={rank}] error does not name it: {e}")
    try:
        buf.combine(y if rank else y.float(), handle)
        fails.append(f"[rank={rank}] a combine whose ranks disagree on dtype did not raise")
    except ValueError as e:
        if "disagree" not in str(e) and "rank(s) [0]" not in str(e):
            fails.append(f"[rank={rank}] error does not say why: {e}")
    for bad in ({"topk_idx": [[0]] if rank == 0 else idx_in},
                {"num_worst_tokens": "many" if rank == W - 1 else 0}):
        args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                    num_tokens_per_expert=per_expert, topk_idx=idx_in, topk_weights=w)
        args.update(bad)
        try:
            buf.dispatch(x, **args)
            fails.append(f"[rank={rank}] {list(bad)} bad on one rank did not raise")
        except (TypeError, ValueError) as e:
            if list(bad)[0] not in str(e) and "passed bad arguments" not in str(e):
                fails.append(f"[rank={rank}] error does not say why: {e}")
    try:                                    # not a tensor on rank 0: no rank may hang
        buf.combine("y" if rank == 0 else y, handle)
        fails.append(f"[rank={rank}] a combine with a bad x on rank 0 did not raise")
    except (TypeError, ValueError) as e:
        if ("x must be" if rank == 0 else "rank(s) [0]") not in str(e):
            fails.append(f"[rank={rank}] error does not say why: {e}")
    again = buf.combine(y, handle, topk_weights=r_w, bias=(b0, b1), config=config)[0]
    if not torch.equal(again, want):
        fails.append(f"[rank={rank}] the buffer is broken after the refused calls")
    buf.destroy()
    return fails


def recv_x_bf16(rows, n, hidden):
    return torch.stack(rows) if n else torch.zeros((0, hidden), dtype=torch.bfloat16)


def _sum_no_bias(x, o_in, rank, W):
    out = torch.zeros((x.shape[0], H), dtype=torch.float32)
    for t in range(x.shape[0]):
        for r in range(W):
            if o_in[t][r]:
                out[t] = out[t] + (x[t].float() * (r + 1) + rank).to(torch.bfloat16).float()
    return out.to(torch.bfloat16)


def _run(W, seed, ranks_per_host=0):
    fails = run_distributed(_body, W, seed, ranks_per_host)
    assert not any(fails), "\n".join(f for f_r in fails for f in f_r)


def test_normal_mode_two_ranks():
    _run(2, 10)


def test_normal_mode_three_ranks_one_empty_int32_topk():
    _run(3, 11)


def test_normal_mode_four_ranks_as_two_declared_hosts():
    _run(4, 12, ranks_per_host=2)


def _modes_body(rank, W):
    """One Buffer, both modes in turn, as SGLang's ``auto`` mode uses it: normal dispatch and
    combine, ``clean_low_latency_buffer``, a low-latency round (checked by test_deep_ep's
    round), then the normal mode again; every result against its oracle."""
    import torch.distributed as dist

    import llcomm.deep_ep as deep_ep
    from _deep_ep_case import VARIANTS, Quant
    from test_deep_ep import H as LL_H
    from test_deep_ep import L as LL_L
    from test_deep_ep import T as LL_T
    from test_deep_ep import _round

    buf = deep_ep.Buffer(dist.group.WORLD, int(1e8), deep_ep.Buffer.get_low_latency_rdma_size_hint(
        LL_T, LL_H, W, LL_L * W), low_latency_mode=True)
    fails = []
    for turn in range(2):
        inputs = _inputs(W, 20 + turn)
        x, idx, w = inputs[rank]
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, LOCAL * W)
        recv_x, _, r_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        rows = _oracle_recv(inputs, rank, W)[0]
        if not torch.equal(recv_x, recv_x_bf16(rows, len(rows), H)):
            fails.append(f"[rank={rank} turn={turn}] normal dispatch rows")
        combined = buf.combine(recv_x, handle)[0]
        o_in = _oracle_layout(idx, W)[2]
        want = torch.stack([sum((x[t].float() for r in range(W) if o_in[t][r]),
                                torch.zeros(H)) for t in range(x.shape[0])]) \
            if x.shape[0] else torch.zeros((0, H))
        if not torch.equal(combined, want.to(torch.bfloat16)):
            fails.append(f"[rank={rank} turn={turn}] normal combine sums")
        if turn == 0:
            buf.clean_low_latency_buffer(LL_T, LL_H, LL_L * W)
            stats = torch.zeros(LL_L, dtype=torch.int32)
            more, _ = _round(buf, rank, W, 7, VARIANTS[0], False, stats, Quant())
            fails += more
    buf.destroy()
    return fails


def test_one_buffer_serves_both_modes():
    fails = run_distributed(_modes_body, 2)
    assert not any(fails), "\n".join(f for f_r in fails for f in f_r)

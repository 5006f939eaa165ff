"""Single-process oracle of EP dispatch / combine, the test inputs, and checks of the oracle.

Every EP test imports from here: ``make_case`` builds every rank's inputs from a seed (so each
rank of a distributed test can compute every other rank's inputs, and the oracle, locally),
``oracle_dispatch`` / ``oracle_combine`` are plain loops over ranks, experts and tokens that
follow the documented order (docs/ep.md) one element-wise fp32 operation at a time.

Payloads check themselves: column 0 of token t of rank s holds ``s + 1`` and column 1 holds
``t + 1`` (exact in bf16 for up to 256 ranks and tokens), the rest is random.
"""
from __future__ import annotations

import torch

KINDS = ("random", "one_expert", "sparse", "dups", "zero_and_max", "none")


def make_case(W: int, E: int, T: int, H: int, topk: int, seed: int, kind: str = "random",
              dtype: torch.dtype = torch.bfloat16):
    """Inputs of every rank: lists ``xs``, ``topks``, ``weights`` (index = rank).

    kinds: ``random`` (uniform experts, about 15% -1 entries, random token counts up to T),
    ``one_expert`` (every token of every rank to expert E // 2, other entries -1),
    ``sparse`` (only experts 1 and E - 1 used: most experts get nothing),
    ``dups`` (experts repeat within a token's top-k), ``zero_and_max`` (even ranks send 0
    tokens, odd ranks T), ``none`` (every entry -1).
    """
    g = torch.Generator().manual_seed(seed)
    xs, topks, weights = [], [], []
    for s in range(W):
        if kind == "zero_and_max":
            n = 0 if s % 2 == 0 else T
        elif kind in ("one_expert", "sparse", "dups", "none"):
            n = T if s == 0 else int(torch.randint(0, T + 1, (1,), generator=g))
        else:
            n = int(torch.randint(0, T + 1, (1,), generator=g)) if seed % 3 else T
        x = torch.randn(n, H, generator=g).to(dtype)
        if n:
            x[:, 0] = s + 1
            x[:, 1] = torch.arange(n) + 1
        if kind == "one_expert":
            idx = torch.full((n, topk), -1, dtype=torch.int64)
            idx[:, int(torch.randint(0, topk, (1,), generator=g))] = E // 2
        elif kind == "sparse":
            idx = torch.where(torch.rand(n, topk, generator=g) < 0.5, 1, E - 1).to(torch.int64)
            idx[:, 1:] = torch.where(idx[:, 1:] == idx[:, :1], -1, idx[:, 1:])
        elif kind == "dups":
            idx = torch.randint(0, min(E, 3), (n, topk), generator=g)
        elif kind == "none":
            idx = torch.full((n, topk), -1, dtype=torch.int64)
        else:
            # distinct experts per token (the usual router output), some dropped to -1
            idx = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(n)]) \
                if n else torch.empty(0, topk, dtype=torch.int64)
            idx = torch.where(torch.rand(n, topk, generator=g) < 0.15, -1, idx)
        w = torch.rand(n, topk, generator=g, dtype=torch.float32) + 0.1
        xs.append(x.contiguous())
        topks.append(idx.to(torch.int64).contiguous())
        weights.append(w.contiguous())
    return xs, topks, weights


def oracle_rows(topks, W: int, E: int):
    """``rows[r][e]``: list of ``(s, t)`` for local expert e of rank r, in row order."""
    L = E // W
    rows = [[[] for _ in range(L)] for _ in range(W)]
    for s in range(W):
        for t, entry in enumerate(topks[s].tolist()):
            for e in sorted({v for v in entry if 0 <= v < E}):
                rows[e // L][e % L].append((s, t))
    # each list was built source rank major, token order: exactly the documented row order
    return rows


def oracle_dispatch(xs, topks, W: int, E: int, T: int):
    """Per rank: ``(recv_x [L, W*T, H] with unused rows zero, recv_count [L] int32, src_info)``."""
    L = E // W
    H = xs[0].shape[1]
    out = []
    for r, per_expert in enumerate(oracle_rows(topks, W, E)):
        recv = torch.zeros(L, W * T, H, dtype=xs[0].dtype)
        count = torch.zeros(L, dtype=torch.int32)
        src = torch.full((L, W * T), -1, dtype=torch.int32)
        for e, lst in enumerate(per_expert):
            count[e] = len(lst)
            for j, (s, t) in enumerate(lst):
                recv[e, j] = xs[s][t]
                src[e, j] = s * T + t
        out.append((recv, count, src))
    return out


def _e4m3_table():
    """Every finite float8_e4m3fn value and its code, decoded from the bits by hand."""
    vals, codes = [], []
    for code in range(256):
        sign, exp, man = code >> 7, (code >> 3) & 0xF, code & 7
        if exp == 0xF and man == 7:
            continue                                    # NaN (e4m3fn has no inf)
        mag = man * 2.0 ** -9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
        vals.append(-mag if sign else mag)
        codes.append(code)
    return torch.tensor(vals, dtype=torch.float64), torch.tensor(codes, dtype=torch.int64)


def oracle_e4m3(v: torch.Tensor) -> torch.Tensor:
    """uint8 codes of fp32 ``v`` (|v| <= 448): the nearest e4m3 value, ties to the even code
    (even mantissa); -0.0 keeps its sign. A search over the table, not a cast."""
    vals, codes = _e4m3_table()
    d = (v.double().reshape(-1, 1) - vals.reshape(1, -1)).abs()
    best = d.min(1, keepdim=True).values
    cand = d == best
    # among the (at most two) nearest: the even code; between +0 and -0: the input's sign
    neg = torch.signbit(v.reshape(-1, 1))
    score = cand.to(torch.int64) * 4 + ((codes & 1) == 0).to(torch.int64) * 2 \
        + (((codes >> 7) == 1) == neg).to(torch.int64)
    return codes[score.argmax(1)].to(torch.uint8).reshape(v.shape)


def oracle_quantize(row: torch.Tensor, round_scale: bool):
    """One token row -> (uint8 e4m3 codes [H], fp32 scales [H // 128]), block by block, with
    scalar fp32 arithmetic and math.frexp for the power-of-two rounding (docs/ep.md)."""
    import math
    H = row.shape[0]
    codes = torch.empty(H, dtype=torch.uint8)
    scales = torch.empty(H // 128, dtype=torch.float32)
    for i in range(H // 128):
        blk = row[i * 128:(i + 1) * 128].float()
        amax = float(blk.abs().max())
        s = torch.tensor(1.0 if amax == 0 else amax, dtype=torch.float32)
        if amax != 0:
            s = s / torch.tensor(448.0, dtype=torch.float32)
        if round_scale:
            m, e = math.frexp(float(s))
            s = torch.tensor(float(s) if m == 0.5 else 2.0 ** e, dtype=torch.float32)
        q = torch.clamp(blk / s, -448.0, 448.0)
        codes[i * 128:(i + 1) * 128] = oracle_e4m3(q)
        scales[i] = s
    return codes, scales


def oracle_dispatch_fp8(xs, topks, W: int, E: int, T: int, round_scale: bool):
    """Per rank: ``(codes [L, W*T, H] uint8, scales [L, W*T, H // 128], recv_count, src_info)``
    with unused rows zero: the rows of ``oracle_dispatch``, each quantised by the oracle."""
    L = E // W
    H = xs[0].shape[1]
    quant = [[oracle_quantize(x[t], round_scale) for t in range(x.shape[0])] for x in xs]
    out = []
    for r, per_expert in enumerate(oracle_rows(topks, W, E)):
        codes = torch.zeros(L, W * T, H, dtype=torch.uint8)
        scales = torch.zeros(L, W * T, H // 128, dtype=torch.float32)
        count = torch.zeros(L, dtype=torch.int32)
        src = torch.full((L, W * T), -1, dtype=torch.int32)
        for e, lst in enumerate(per_expert):
            count[e] = len(lst)
            for j, (s, t) in enumerate(lst):
                codes[e, j], scales[e, j] = quant[s][t]
                src[e, j] = s * T + t
        out.append((codes, scales, count, src))
    return out


def expert_fn_all_rows(recv_x: torch.Tensor, rank: int) -> torch.Tensor:
    """``expert_fn``'s formula on every row, filled or not: no count is read, so a CUDA graph
    can capture it."""
    L = recv_x.shape[0]
    e = torch.arange(L, device=recv_x.device, dtype=torch.float32).view(L, 1, 1)
    return (recv_x.float() * (1 + e / 8) + (rank - e / 4)).to(recv_x.dtype)


def expert_fn(recv_x: torch.Tensor, recv_count: torch.Tensor, rank: int) -> torch.Tensor:
    """A stand-in for the experts: rows < count get ``x * (1 + e / 8) + rank - e / 4``, every
    other row NaN (combine must never read them)."""
    L = recv_x.shape[0]
    out = torch.full_like(recv_x, float("nan"))
    for e in range(L):
        c = int(recv_count[e])
        if c:
            y = recv_x[e, :c].float() * (1 + e / 8) + (rank - e / 4)
            out[e, :c] = y.to(recv_x.dtype)
    return out


def oracle_combine(expert_outs, topks, weights, W: int, E: int, dtype: torch.dtype):
    """Per rank: ``out [n, H]``, in the documented order, one fp32 element-wise op at a time."""
    where = row_index(topks, W, E)
    H = expert_outs[0].shape[2]
    outs = []
    for s in range(W):
        n = topks[s].shape[0]
        out = torch.empty(n, H, dtype=dtype)
        for t in range(n):
            entry = topks[s][t].tolist()
            total = torch.zeros(H, dtype=torch.float32)
            for q in range(W):
                acc = rank_partial(expert_outs, weights, where, entry, s, t, q, E // W)
                if acc is not None:
                    total = total + acc.to(dtype).float()
            out[t] = total.to(dtype)
        outs.append(out)
    return outs


def row_index(topks, W: int, E: int) -> list[dict]:
    """``where[q][(e, s, t)]``: the row of expert e on rank q that holds source s's token t."""
    rows = oracle_rows(topks, W, E)
    return [{(e,) + st: j for e in range(E // W) for j, st in enumerate(rows[q][e])}
            for q in range(W)]


def rank_partial(expert_outs, weights, where, entry, s: int, t: int, q: int, L: int):
    """Rank q's fp32 fold, in k order, of token (s, t)'s weighted expert rows (``entry``: its
    top-k ids), unrounded; None when the token has no expert on q."""
    ks = [k for k, v in enumerate(entry) if 0 <= v and v // L == q]
    if not ks:
        return None
    acc = torch.zeros(expert_outs[q].shape[2], dtype=torch.float32)
    for k in ks:
        e = entry[k] % L
        acc = acc + weights[s][t, k:k + 1] * expert_outs[q][e, where[q][(e, s, t)]].float()
    return acc


def oracle_combine_f64(expert_outs, topks, weights, W: int, E: int):
    """The exact sum in float64 (order free), for a tolerance check of the ordered result."""
    L = E // W
    rows = oracle_rows(topks, W, E)
    outs = []
    for s in range(W):
        n, H = topks[s].shape[0], expert_outs[0].shape[2]
        out = torch.zeros(n, H, dtype=torch.float64)
        for t in range(n):
            for k, v in enumerate(topks[s][t].tolist()):
                if 0 <= v < E:
                    q, e = v // L, v % L
                    j = rows[q][e].index((s, t))
                    out[t] += float(weights[s][t, k]) * expert_outs[q][e, j].double()
        outs.append(out)
    return outs


# -- checks of the oracle itself ---------------------------------------------------------------

def test_oracle_rows_by_hand():
    # 2 ranks, 4 experts (2 local each). rank 0: t0 -> {1, 2}, t1 -> {2, 2(dup)}, t2 -> {-1, 0}
    # rank 1: t0 -> {3, 0}
    topks = [torch.tensor([[1, 2], [2, 2], [-1, 0]]), torch.tensor([[3, 0]])]
    rows = oracle_rows(topks, 2, 4)
    assert rows[0] == [[(0, 2), (1, 0)], [(0, 0)]]
    assert rows[1] == [[(0, 0), (0, 1)], [(1, 0)]]


def test_oracle_combine_by_hand():
    W, E, T, H = 2, 4, 3, 16
    topks = [torch.tensor([[1, 2], [2, 2], [-1, -1]]), torch.tensor([[3, 0]])]
    weights = [torch.tensor([[0.5, 2.0], [1.0, 3.0], [1.0, 1.0]]), torch.tensor([[0.25, 1.0]])]
    xs = [torch.ones(3, H), torch.ones(1, H)]
    disp = oracle_dispatch([x.to(torch.float32) for x in xs], topks, W, E, T)
    outs_e = [torch.full_like(d[0], float("nan")) for d in disp]
    # rank 0 experts: e0 rows [(1,0)], e1 rows [(0,0)]; rank 1: e2 rows [(0,0),(0,1)], e3 [(1,0)]
    outs_e[0][0, 0] = 10.0
    outs_e[0][1, 0] = 20.0
    outs_e[1][0, 0] = 30.0
    outs_e[1][0, 1] = 40.0
    outs_e[1][1, 0] = 50.0
    got = oracle_combine(outs_e, topks, weights, W, E, torch.float32)
    assert torch.equal(got[0][0], torch.full((H,), 0.5 * 20 + 2.0 * 30))
    assert torch.equal(got[0][1], torch.full((H,), 1.0 * 40 + 3.0 * 40))   # both weights apply
    assert torch.equal(got[0][2], torch.zeros(H))                          # no expert: zeros
    assert torch.equal(got[1][0], torch.full((H,), 0.25 * 50 + 1.0 * 10))
    ref = oracle_combine_f64(outs_e, topks, weights, W, E)
    assert all(torch.allclose(a.double(), b) for a, b in zip(got, ref))


def test_make_case_kinds():
    for kind in KINDS:
        xs, topks, ws = make_case(4, 8, 6, 32, 3, seed=1, kind=kind)
        for s, (x, k, w) in enumerate(zip(xs, topks, ws)):
            assert x.shape[0] == k.shape[0] == w.shape[0] <= 6
            assert k.dtype == torch.int64 and w.dtype == torch.float32
            assert k.numel() == 0 or (int(k.min()) >= -1 and int(k.max()) < 8)
            if x.shape[0]:
                assert torch.equal(x[:, 0], torch.full((x.shape[0],), s + 1.0).to(x.dtype))


def test_oracle_e4m3_by_hand():
    v = torch.tensor([0.0, -0.0, 1.0, 1.0625, 1.1875, 448.0, -448.0, 2.0 ** -9, 2.0 ** -10,
                      3 * 2.0 ** -10, 0.0146484375, 17.0])
    got = oracle_e4m3(v).tolist()
    # 1.0625 is halfway between 1.0 (code 0x38, even) and 1.125 (0x39): even wins; 1.1875
    # between 1.125 (0x39) and 1.25 (0x3a): 0x3a. 2**-10 ties 0 and 2**-9: 0. 3 * 2**-10 ties
    # 2**-9 (0x01) and 2**-8 (0x02): 0x02. 7.5 * 2**-9 ties 0x07 and 0x08 (2**-6, the first
    # normal): 0x08. 17 ties 16 (0x58) and 18 (0x59): 0x58.
    assert got == [0x00, 0x80, 0x38, 0x38, 0x3A, 0x7E, 0xFE, 0x01, 0x00, 0x02, 0x08, 0x58]

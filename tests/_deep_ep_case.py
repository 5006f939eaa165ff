"""Inputs, checks and the MoE round of the ``llcomm.deep_ep`` tests (CPU and GPU share them).

Every rank builds every rank's inputs from the seed (``case``), so each can compute the oracle
for what it receives without an exchange. Payloads check themselves: channels ``0 .. 127`` of
token t of rank s hold ``s + 1``, the last 128 channels hold ``t + 1``, the rest is random (exact
in bf16, and in FP8 too: one constant per 128-channel block dequantises to itself, for up to 15
tokens). ``round_checks`` runs one dispatch + experts + combine through ``deep_ep.Buffer`` and
returns a list of failures: every received row against its source through ``src_info`` and
``layout_range``, FP8 codes and scales against the independent quantiser of
``test_ep_oracle``, UE8M0 words unpacked by hand, the combine against an fp64 weighted sum of the
expert outputs.
"""
from __future__ import annotations

import torch

from test_ep_oracle import oracle_quantize

#: Channels per FP8 scale; UE8M0 packs four scales per int32 word.
BLOCK = 128
VARIANTS = ((False, False, False), (True, False, False), (True, True, False), (True, True, True))


def case(W: int, E: int, T: int, H: int, K: int, seed: int, dtype=torch.bfloat16):
    """Every rank's ``(x, topk_idx, topk_weights)``: distinct experts per token (a router's
    top-k), about one entry in six masked to -1, token counts in [0, T] (T when seed % 3 == 0)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(W):
        n = T if seed % 3 == 0 else int(torch.randint(0, T + 1, (1,), generator=g))
        x = torch.randn(n, H, generator=g) * 0.5
        x[:, :BLOCK] = s + 1
        x[:, -BLOCK:] = (torch.arange(n, dtype=torch.float32) + 1).view(-1, 1)
        scores = torch.rand(n, E, generator=g)
        idx = scores.topk(K, dim=-1).indices if n else torch.empty(0, K, dtype=torch.int64)
        idx = torch.where(torch.rand(n, K, generator=g) < 0.17, -1, idx)
        w = torch.rand(n, K, generator=g) + 0.1
        out.append((x.to(dtype).contiguous(), idx.to(torch.int64).contiguous(), w.contiguous()))
    return out


def expected_rows(inputs, g: int) -> list[list[int]]:
    """Per source rank: the tokens that route to global expert ``g``, in token order."""
    return [[t for t, row in enumerate(idx.tolist()) if g in row] for _, idx, _ in inputs]


def unpack_ue8m0(words: torch.Tensor, groups: int) -> torch.Tensor:
    """int32 ``[..., groups / 4]`` -> float64 ``[..., groups]``: byte b of word i (bits
    ``8 b .. 8 b + 7``, read arithmetically) is the biased exponent of scale ``4 i + b``."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(*words.shape[:-1], groups, dtype=torch.float64)
    for i in range(groups):
        byte = (w[..., i // 4] >> (8 * (i % 4))) & 0xFF
        out[..., i] = torch.pow(2.0, (byte - 127).double())
    return out


def scales_of(scales: torch.Tensor, ue8m0: bool, H: int) -> torch.Tensor:
    """DeepEP's scales (any strides) as float64 ``[..., H / 128]``."""
    s = scales.cpu()
    return unpack_ue8m0(s, H // BLOCK) if ue8m0 else s.double()


def dequant(q: torch.Tensor, scales64: torch.Tensor) -> torch.Tensor:
    """float64 ``q * scale`` per 128-channel block (q: float8_e4m3fn rows)."""
    H = q.shape[-1]
    v = q.cpu().double().reshape(*q.shape[:-1], H // BLOCK, BLOCK)
    return (v * scales64.unsqueeze(-1)).reshape(q.shape)


def expert(rows: torch.Tensor, g: int) -> torch.Tensor:
    """The stand-in expert of global id g: ``x * (1 + g / 8) + g / 4`` (float64)."""
    return rows.double() * (1 + g / 8) + g / 4


class Quant:
    """``oracle_quantize`` of every token row, computed once per (seed, round_scale)."""

    def __init__(self):
        self.memo = {}

    def __call__(self, key, inputs, round_scale: bool):
        k = (key, round_scale)
        if k not in self.memo:
            self.memo[k] = [[oracle_quantize(x[t], round_scale) for t in range(x.shape[0])]
                            for x, _, _ in inputs]
        return self.memo[k]


def check_layouts(tag, recv_x, handle, fp8, ue8m0, L, W, T, H) -> list[str]:
    """Shapes, dtypes and strides of DeepEP's outputs."""
    fails = []
    if not (isinstance(handle, tuple) and len(handle) == 5 and tuple(handle[2:]) == (T, H, L * W)):
        fails.append(f"{tag} handle is not DeepEP's 5-tuple (.., .., {T}, {H}, {L * W})")
    src_info, layout = handle[0], handle[1]
    if (src_info.dtype, tuple(src_info.shape)) != (torch.int32, (L, W * T)):
        fails.append(f"{tag} src_info is {src_info.dtype} {tuple(src_info.shape)}")
    if (layout.dtype, tuple(layout.shape)) != (torch.int64, (L, W)):
        fails.append(f"{tag} layout_range is {layout.dtype} {tuple(layout.shape)}")
    if not fp8:
        return fails
    q, sc = recv_x
    groups = H // (4 * BLOCK) if ue8m0 else H // BLOCK
    want = (torch.int32 if ue8m0 else torch.float32, (L, W * T, groups), (groups * W * T, 1, W * T))
    if (sc.dtype, tuple(sc.shape), sc.stride()) != want:
        fails.append(f"{tag} scales are {sc.dtype} {tuple(sc.shape)} strides {sc.stride()}; "
                     f"DeepEP's: {want}")
    if (q.dtype, tuple(q.shape)) != (torch.float8_e4m3fn, (L, W * T, H)) or not q.is_contiguous():
        fails.append(f"{tag} recv_x[0] is {q.dtype} {tuple(q.shape)}")
    return fails


def check_dispatch(tag, rank, inputs, recv_x, recv_count, handle, variant, quant, key,
                   W, E, T, H) -> tuple[list[str], list[torch.Tensor]]:
    """Every received row against its source; returns (failures, this rank's expert inputs as
    float64 ``[count, H]`` per local expert, from what was received)."""
    fp8, round_scale, ue8m0 = variant
    L = E // W
    fails = check_layouts(tag, recv_x, handle, fp8, ue8m0, L, W, T, H)
    if fails:
        return fails, []
    counts = recv_count.cpu().tolist()
    src_info = handle[0].cpu()
    layout = handle[1].cpu()
    q_oracle = quant(key, inputs, round_scale) if fp8 else None
    rows_in = []
    for e in range(L):
        g = rank * L + e
        want = expected_rows(inputs, g)
        c = counts[e]
        if c != sum(map(len, want)):
            fails.append(f"{tag} expert {g}: recv_count {c} != {sum(map(len, want))}")
            rows_in.append(None)
            continue
        if fp8:
            got = dequant(recv_x[0][e, :c], scales_of(recv_x[1][e, :c], ue8m0, H))
        else:
            got = recv_x[e, :c].cpu().double()
        rows_in.append(got)
        for s in range(W):
            begin, n = int(layout[e, s]) >> 32, int(layout[e, s]) & 0xFFFFFFFF
            if n != len(want[s]) or begin != sum(map(len, want[:s])):
                fails.append(f"{tag} expert {g} source {s}: layout_range (begin {begin}, count "
                             f"{n}); expected ({sum(map(len, want[:s]))}, {len(want[s])})")
                continue
            toks = src_info[e, begin:begin + n].tolist()
            if toks != want[s]:
                fails.append(f"{tag} expert {g} source {s}: src_info {toks} != {want[s]}")
                continue
            rows = got[begin:begin + n]
            # self-checking payload, decoded from the received row alone
            if n and not (torch.equal(rows[:, 0].round(), torch.full((n,), s + 1.0,
                                                                      dtype=torch.float64))
                          and rows[:, -1].round().tolist() == [t + 1.0 for t in toks]):
                fails.append(f"{tag} expert {g} source {s}: payload names another (rank, token)")
            for j, t in enumerate(toks):
                src = inputs[s][0][t]
                if not fp8:
                    if not torch.equal(recv_x[e, begin + j].cpu(), src):
                        fails.append(f"{tag} expert {g} row {begin + j}: not token {t} of {s}")
                    continue
                codes, sc = q_oracle[s][t]
                if not torch.equal(recv_x[0][e, begin + j].cpu().view(torch.uint8), codes):
                    fails.append(f"{tag} expert {g} row {begin + j}: FP8 codes differ")
                if not torch.equal(scales_of(recv_x[1][e, begin + j], ue8m0, H), sc.double()):
                    fails.append(f"{tag} expert {g} row {begin + j}: scales differ")
                if not torch.allclose(rows[j], src.double(), rtol=2 ** -4, atol=2 ** -6):
                    fails.append(f"{tag} expert {g} row {begin + j}: dequantised row is not "
                                 "close to the source")
    return fails, rows_in


def expert_outputs(rows_in, rank, L, W, T, H, dtype, device) -> torch.Tensor:
    """``[L, W * T, H]`` outputs of the stand-in experts for the received rows; NaN elsewhere
    (combine must not read past recv_count)."""
    out = torch.full((L, W * T, H), float("nan"), dtype=dtype)
    for e, rows in enumerate(rows_in):
        if rows is not None and rows.shape[0]:
            out[e, :rows.shape[0]] = expert(rows, rank * L + e).to(dtype)
    return out.to(device)


def combine_oracle(inputs, rank, variant, quant, key, E, dtype):
    """``(want, bound)`` float64 ``[n, H]``: the weighted sum of the experts' outputs of this
    rank's tokens (each expert output rounded to ``dtype`` first, as the experts produce it)
    and the sum of magnitudes, for the tolerance."""
    fp8, round_scale, _ = variant
    x, idx, w = inputs[rank]
    want = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    bound = torch.zeros_like(want)
    q_oracle = quant(key, inputs, round_scale) if fp8 else None
    for t in range(x.shape[0]):
        if fp8:
            codes, sc = q_oracle[rank][t]
            row = dequant(codes.view(torch.float8_e4m3fn).view(1, -1), sc.double().view(1, -1))[0]
        else:
            row = x[t].double()
        for k, g in enumerate(idx[t].tolist()):
            if g >= 0:
                y = expert(row, g).to(dtype).double() * float(w[t, k])
                want[t] += y
                bound[t] += y.abs()
    return want, bound


def check_combine(tag, y, want, bound) -> list[str]:
    y = y.cpu().double()
    if y.shape != want.shape:
        return [f"{tag} combine shape {tuple(y.shape)} != {tuple(want.shape)}"]
    err = (y - want).abs()
    ok = bool((err <= 2 ** -6 * bound + 1e-3).all()) and not bool(torch.isnan(y).any())
    return [] if ok else [f"{tag} combine differs from the weighted sum (max err "
                          f"{float(err.max()) if err.numel() else 0})"]

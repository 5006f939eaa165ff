"""``to_deep_ep_kernel`` (llcomm/deep_ep/kernels.py) under ``TRITON_INTERPRET=1`` against the torch
conversions of llcomm/deep_ep/convert.py, bitwise.

Inputs are made fresh for every run (the seed is printed on a failure): per local expert a random
count of rows (0, full ``W * T`` and values between), the rows a sorted random set of distinct
``source_rank * T + token`` values, some cases with one rank sending nothing (as a masked rank),
and garbage past the count (negative, huge, and in-range values, which the kernel must not
count). Scales: random fp32 bits (NaN and infinities among them) for the fp32 layout, powers of
two from 2^-40 to 2^40 for UE8M0 (exponent bytes above and below 128). Outputs are poisoned
first: the filled rows must equal the oracle's, the rows past the count must keep the poison
(the kernel writes only filled rows), ``layout_range`` and ``stats`` must be equal everywhere.
The GPU test runs the same cases compiled, through llcomm's launcher; one more test compiles
every variant for sm_90 without a GPU.
"""
from __future__ import annotations

import os

import pytest

from _interp import run_in_interpreter

#: (W, T, L, G): W = 1, 2, 3, 8; T not a power of two; L = 1; G = 0 (bf16), 3, 4, 56 groups.
CASES = ((1, 5, 1, 0), (2, 7, 3, 4), (3, 13, 2, 3), (8, 6, 4, 56), (2, 128, 1, 56),
         (3, 50, 5, 8), (1, 300, 2, 4))
POISON = -0x5A5A5A5B
#: Cases ``compare`` runs: per CASES entry, its scale modes x masked rank or not x stats or not.
EXPECTED_CASES = sum((1 + (G > 0) + (G > 0 and G % 4 == 0)) * (2 if W > 1 else 1) * 2
                     for W, T, L, G in CASES)


def _case(gen, W, T, L, G, mode, masked_rank):
    import torch
    R = W * T
    counts = torch.randint(0, R + 1, (L,), generator=gen)
    counts[0] = R if L > 1 else counts[0]
    counts[-1] = 0 if L > 2 else counts[-1]
    src = torch.randint(-(1 << 30), 1 << 30, (L, R), generator=gen, dtype=torch.int64)
    src[:, ::3] = torch.randint(0, R, (L, (R + 2) // 3), generator=gen)  # in-range garbage too
    src = src.to(torch.int32)
    for e in range(L):
        pool = torch.arange(R)
        if masked_rank is not None:
            pool = pool[pool // T != masked_rank]
        n = min(int(counts[e]), len(pool))
        counts[e] = n
        pick = pool[torch.randperm(len(pool), generator=gen)[:n]]
        src[e, :n] = pick.sort().values.to(torch.int32)
    scales = None
    if mode == "fp32":
        scales = torch.randint(-(1 << 31), 1 << 31, (L, R, G), generator=gen,
                               dtype=torch.int64).to(torch.int32).view(torch.float32)
    elif mode == "ue8m0":
        exp = torch.randint(-40, 41, (L, R, G), generator=gen).double()
        scales = torch.pow(2.0, exp).float()
        for e in range(L):      # past the count: anything
            scales[e, int(counts[e]):] = torch.randn(R - int(counts[e]), G, generator=gen)
    return counts.to(torch.int32), src, scales


def _launch(fn, grid, args, num_warps, **consts):
    fn[(grid,)](*args, num_warps=num_warps, **consts)


def compare(seed: int, device: str = "cpu") -> tuple[list[str], int]:
    """Every case of CASES in every scale mode: the mismatches, described, and the number of
    cases run. On a GPU the kernel goes through llcomm's launcher, as ``deep_ep.Buffer``
    launches it."""
    import torch

    from llcomm.deep_ep import convert as C
    launch = _launch
    if device != "cpu":
        from llcomm.runtime.launch import Launcher
        launch = Launcher(torch.device(device), pdl=False)
    gen = torch.Generator().manual_seed(seed)
    bad, ran = [], 0
    for W, T, L, G in CASES:
        modes = ["none"] + (["fp32"] if G else []) + (["ue8m0"] if G and G % 4 == 0 else [])
        for mode in modes:
            for masked_rank in (None, W // 2) if W > 1 else (None,):
                for with_stats in (False, True):
                    name = f"W={W} T={T} L={L} G={G} {mode} masked={masked_rank} " \
                           f"stats={with_stats}"
                    bad += _one(C, gen, name, W, T, L, G, mode, masked_rank, with_stats,
                                device, launch)
                    ran += 1
    return bad, ran


def _one(C, gen, name, W, T, L, G, mode, masked_rank, with_stats, device, launch):
    import torch
    R = W * T
    counts, src, scales = _case(gen, W, T, L, G, mode, masked_rank)
    ue8m0 = mode == "ue8m0"
    stats0 = torch.randint(0, 1000, (L,), generator=gen, dtype=torch.int32)
    counts, src, stats0 = counts.to(device), src.to(device), stats0.to(device)
    scales = scales.to(device) if scales is not None else None
    # the oracle
    want_src = torch.empty(L, R, dtype=torch.int32, device=device)
    C.source_token(src, T, want_src)
    want_lay = torch.empty(L, W, dtype=torch.int64, device=device)
    C.layout_range(src, counts, C.layout_aux(L, R, T, W, src.device), want_lay)
    want_sc = None
    if scales is not None:
        want_sc = C.scales_storage(L, R, G * C.FP8_BLOCK, ue8m0, src.device)
        C.fill_scales(want_sc, scales, ue8m0)
    want_stats = stats0 + counts
    # the kernel, on poisoned outputs
    src_in, counts_in = src.clone(), counts.clone()
    got_src = torch.full((L, R), POISON, dtype=torch.int32, device=device)
    got_lay = torch.full((L, W), POISON, dtype=torch.int64, device=device)
    got_sc = None
    if scales is not None:
        got_sc = C.scales_storage(L, R, G * C.FP8_BLOCK, ue8m0, src.device)
        got_sc.view(torch.int32).fill_(POISON)
    stats = stats0.clone() if with_stats else None
    C.to_deep_ep(launch, src, counts, T, got_src, got_lay, scales, got_sc, ue8m0, stats)
    out = []
    if not (torch.equal(src, src_in) and torch.equal(counts, counts_in)):
        out.append(f"{name}: the inputs changed")
    if not torch.equal(got_lay, want_lay):
        out.append(f"{name}: layout_range {got_lay.tolist()} != {want_lay.tolist()} "
                   f"(counts {counts.tolist()})")
    if with_stats and not torch.equal(stats, want_stats):
        out.append(f"{name}: stats {stats.tolist()} != {want_stats.tolist()}")
    for e in range(L):
        n = int(counts[e])
        pairs = [("src_info", got_src[e], want_src[e])]
        if got_sc is not None:
            pairs.append(("scales", got_sc[e].contiguous().view(torch.int32),
                          want_sc[e].contiguous().view(torch.int32)))
        for what, got, want in pairs:
            if not torch.equal(got[:n], want[:n]):
                rows = (got[:n] != want[:n]).reshape(n, -1).any(1).nonzero().flatten()
                out.append(f"{name}: expert {e} {what}: filled rows {rows.tolist()[:8]} of "
                           f"{n} differ")
            if not (got[n:] == POISON).all():
                out.append(f"{name}: expert {e} {what}: rows past the count {n} written")
    return out


def test_kernel_matches_torch_conversions():
    seed = int.from_bytes(os.urandom(4), "little")
    bad, ran = run_in_interpreter("test_deep_ep_convert", "compare", seed)
    assert ran == EXPECTED_CASES and bad == [], f"seed {seed}:\n" + "\n".join(bad[:20])


@pytest.mark.gpu(gpus=1)
def test_kernel_matches_torch_conversions_gpu():
    """The same cases on a GPU: the compiled kernel through llcomm's launcher against the torch
    ops on the same device."""
    seed = int.from_bytes(os.urandom(4), "little")
    bad, ran = compare(seed, "cuda:0")
    assert ran == EXPECTED_CASES and bad == [], f"seed {seed}:\n" + "\n".join(bad[:20])


@pytest.mark.parametrize("W,G", [(1, 0), (8, 56), (64, 56), (3, 3)])
def test_block_rows(W, G):
    from llcomm.deep_ep import kernels as K
    b = K.block_rows(W, G)
    assert 16 <= b <= 256 and b & (b - 1) == 0
    assert b * max(K.pow2(W), K.pow2(G)) <= 8192 or b == 16


@pytest.mark.parametrize("W", [1, 8])
def test_compiles_for_sm90(W):
    """Each variant compiles for sm_90 as ``convert.to_deep_ep`` launches it (tools/ptx_ep.py),
    without spills where ptxas runs."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tools"))
    ptx_ep = pytest.importorskip("ptx_ep")
    from ptx import ptxas_usage
    found = ptx_ep.deep_ep_kernels(7168, 256 // W, W, 128)
    assert sorted(found) == ["deep_ep_convert_bf16", "deep_ep_convert_fp8",
                             "deep_ep_convert_ue8m0"]
    for name, (fn, sig, consts, warps, opts) in found.items():
        ptx = ptx_ep.compile_one(fn, sig, consts, warps, opts).asm["ptx"]
        assert ".entry to_deep_ep_kernel" in ptx, name
        usage = ptxas_usage(ptx)
        assert usage == "regs ?" or usage.endswith("spill stores 0 B"), (name, usage)

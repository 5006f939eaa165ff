"""NVFP4 (``llcomm/deep_ep/nvfp4.py``) and ``low_latency_dispatch(use_nvfp4=True)``.

The quantiser is checked bit for bit against ``oracle_block``, written here element by element
in Python floats: float32 rounding through ``struct``, the e4m3 scale picked from the list of
every finite e4m3 value (nearest, ties to the even code, saturated at 448), each e2m1 code from
the table of its 8 magnitudes (nearest, ties to the even code, saturated at 6). Then DeepEP's
layouts by their index formula, and the dispatch end to end on gloo (2 ranks, reference
backend): every received row's codes and scales against the oracle of its source row, its
dequantised values within the documented bound, with and without a receive hook, then the
refusals.
"""
from __future__ import annotations

import struct

import pytest
import torch

from _deep_ep_case import case, expected_rows
from _dist import run_distributed
from test_ep_reference import _expect

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def f32(v: float) -> float:
    """``v`` rounded to float32 (nearest even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _e4m3_values() -> list[tuple[float, int]]:
    """Every finite non-negative float8_e4m3fn value with its code, ascending."""
    out = []
    for exp in range(16):
        for man in range(8):
            if exp == 15 and man == 7:
                continue                                    # NaN
            v = man / 8 * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
            out.append((v, exp << 3 | man))
    return sorted(out)


E4M3 = _e4m3_values()


def oracle_e4m3(v: float) -> tuple[int, float]:
    """A non-negative float -> (code, value): nearest e4m3, ties to the even code, 448 above."""
    if v >= 448.0:
        return 0x7E, 448.0
    best = min(E4M3, key=lambda cv: (abs(cv[0] - v), cv[1] & 1))
    return best[1], best[0]


def oracle_e2m1(v: float) -> int:
    """A float -> e2m1 code: nearest magnitude, ties to the even code, 6 above; sign bit 3
    where v < 0."""
    a = min(abs(v), 6.0)
    code = min(range(8), key=lambda c: (abs(E2M1[c] - a), c & 1))
    return code | (8 if v < 0 else 0)


def oracle_block(xs: list[float], gs: float) -> tuple[list[int], int]:
    """16 values -> (their 16 e2m1 codes, the e4m3 scale code), every step in float32."""
    amax = max(abs(v) for v in xs)
    sf = f32(gs * f32(amax * f32(1 / 6)))
    sf_code, sf_val = oracle_e4m3(sf)
    out = 0.0 if sf_val == 0 else f32(1 / f32(sf_val * f32(1 / gs)))
    return [oracle_e2m1(f32(v * out)) for v in xs], sf_code


def oracle_row(row: torch.Tensor, gs: float) -> tuple[list[int], list[int]]:
    """One row -> (packed bytes: element 2j low nibble, 2j + 1 high; scale codes)."""
    vals = [float(v) for v in row.float().tolist()]
    codes, scales = [], []
    for i in range(0, len(vals), 16):
        c, s = oracle_block(vals[i:i + 16], gs)
        codes += c
        scales.append(s)
    return [codes[j] | codes[j + 1] << 4 for j in range(0, len(codes), 2)], scales


def _check_rows(x: torch.Tensor, gs: float, tag: str) -> list[str]:
    from llcomm.deep_ep import nvfp4
    packed, sf = nvfp4.quantize(x, torch.tensor(gs, dtype=torch.float32))
    fails = []
    for r in range(x.shape[0]):
        want_p, want_s = oracle_row(x[r], gs)
        if packed[r].tolist() != want_p:
            bad = [j for j, (a, b) in enumerate(zip(packed[r].tolist(), want_p)) if a != b]
            fails.append(f"{tag} row {r}: codes differ at bytes {bad[:8]}")
        if sf[r].view(torch.uint8).tolist() != want_s:
            fails.append(f"{tag} row {r}: scales {sf[r].view(torch.uint8).tolist()} != {want_s}")
    return fails


def test_quantize_matches_the_oracle_on_random_rows():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 256, generator=g) * torch.rand(6, 1, generator=g) * 4).bfloat16()
    x[1, 16:32] = 0                                         # a zero block
    x[2, :16] *= 1e-3                                       # a small block
    gs = 448 * 6 / float(x.float().abs().max())
    assert _check_rows(x, gs, "bf16") == []
    assert _check_rows(x.float() * 1.7, gs, "fp32") == []
    assert _check_rows(x, 1.0e-4, "tiny gs: subnormal and zero scales") == []
    assert _check_rows(x, 3.0e5, "huge gs: saturated scales") == []


def test_quantize_ties_zeros_saturation_negatives():
    from llcomm.deep_ep import nvfp4
    # gs = 1 and amax = 6: the scale is exactly 1 (f32(6 * f32(1/6)) == 1), so v == x
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0,
            -0.1, -0.0, 0.0, 0.3]
    # amax = 6.375: the scale 1.0625 is a tie in e4m3 and rounds to 1.0, so 6.375 saturates
    sat = [6.375, -6.375, 5.5, 0.0] + [1.0] * 12
    x = torch.tensor([ties, sat, [0.0] * 16, [-0.0] * 16], dtype=torch.float32)
    assert _check_rows(x, 1.0, "crafted") == []
    packed, sf = nvfp4.quantize(x, torch.tensor(1.0))
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(4, 16)
    assert codes[0].tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 12, 14, 8, 0, 0, 1]
    assert codes[1, :3].tolist() == [7, 15, 7] and sf[1].view(torch.uint8)[0] == 0x38
    assert codes[2:].tolist() == [[0] * 16] * 2 and sf[2:].view(torch.uint8).tolist() == [[0]] * 2
    # the packing order by hand: element 0 in the low nibble of byte 0
    assert packed[0, 0] == 7 | 0 << 4 and packed[0, 1] == 2 | 2 << 4


def test_dequantize_within_the_bound():
    from llcomm.deep_ep import nvfp4
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(8, 512, generator=g) * 3).bfloat16()
    gs = torch.tensor(448 * 6 / float(x.float().abs().max()), dtype=torch.float32)
    packed, sf = nvfp4.quantize(x, gs)
    d = nvfp4.dequantize(packed, sf, gs)
    blocks = x.float().view(8, 32, 16)
    amax = blocks.abs().amax(-1, keepdim=True)
    err = (d.view(8, 32, 16) - blocks).abs()
    assert bool((err <= amax * nvfp4.DEQUANT_BOUND * (1 + 1e-6)).all())


def test_scale_layout_by_its_index_formula():
    from llcomm.deep_ep import nvfp4
    L, R, H = 2, 200, 80                                    # 2 row tiles, 2 block tiles (5 blocks)
    g = torch.Generator().manual_seed(7)
    sf = torch.randint(0, 126, (L, R, H // 16), generator=g, dtype=torch.uint8)
    deep = nvfp4.swizzle_scales(sf.view(torch.float8_e4m3fn))
    assert tuple(deep.shape) == (32, 4, 2, 4, 2, L) and deep.dtype == torch.float8_e4m3fn
    storage = deep.permute(5, 2, 4, 0, 1, 3)
    assert storage.is_contiguous()
    s = storage.view(torch.uint8)
    for e in range(L):
        for r in range(R):
            for j in range(H // 16):
                assert int(s[e, r // 128, j // 4, r % 32, (r % 128) // 32, j % 4]) == \
                    int(sf[e, r, j]), (e, r, j)
    assert torch.equal(nvfp4.unswizzle_scales(deep, R, H).view(torch.uint8), sf)
    values, scales = nvfp4.outputs(L, R, H, torch.device("cpu"))
    assert tuple(values.shape) == (R, H // 2, L) and values.permute(2, 0, 1).is_contiguous()
    assert tuple(scales.shape) == tuple(deep.shape)
    assert scales.permute(5, 2, 4, 0, 1, 3).is_contiguous()


W, E, T, H, K = 2, 4, 5, 384, 2     # channels 128 .. 255 of a row are random (case)


def _dispatch_body(rank, world):
    import llcomm.deep_ep as deep_ep
    from llcomm.deep_ep import nvfp4
    fails, rows = [], 0
    buf = deep_ep.Buffer(None, backend="reference")
    for seed, hook_on in ((3, False), (4, True), (6, False)):
        inputs = case(W, E, T, H, K, seed)
        x, idx, w = inputs[rank]
        amax = max(float(xi.float().abs().max()) for xi, _, _ in inputs if xi.numel())
        gs = torch.tensor(448 * 6 / amax, dtype=torch.float32)
        # seed 6 passes a per-expert [E] tensor of that value, as vLLM's a1_gscale: element 0
        given = gs.expand(E).contiguous() if seed == 6 else gs
        (values, scales), count, handle, event, hook = buf.low_latency_dispatch(
            x, idx, T, E, use_fp8=False, use_nvfp4=True, x_global_scale=given,
            return_recv_hook=hook_on, async_finish=not hook_on)
        if hook_on:
            hook()
        tag = f"[rank {rank} seed {seed} hook {hook_on}]"
        Lx = E // W
        if tuple(values.shape) != (W * T, H // 2, Lx) or values.dtype != torch.uint8:
            fails.append(f"{tag} values {tuple(values.shape)} {values.dtype}")
        rm, rk = -(-W * T // 128), -(-H // 64)
        if tuple(scales.shape) != (32, 4, rm, 4, rk, Lx) or scales.dtype != torch.float8_e4m3fn:
            fails.append(f"{tag} scales {tuple(scales.shape)} {scales.dtype}")
        rows_sf = nvfp4.unswizzle_scales(scales, W * T, H).view(torch.uint8)
        src_info, layout = handle[0], handle[1]
        for e in range(Lx):
            want = expected_rows(inputs, rank * Lx + e)
            if int(count[e]) != sum(map(len, want)):
                fails.append(f"{tag} expert {e}: count {int(count[e])}")
                continue
            for s in range(W):
                begin, n = int(layout[e, s]) >> 32, int(layout[e, s]) & 0xFFFFFFFF
                for j in range(begin, begin + n):
                    src = inputs[s][0][int(src_info[e, j])]
                    rows += 1
                    want_p, want_s = oracle_row(src, float(gs))
                    if values[j, :, e].tolist() != want_p:
                        fails.append(f"{tag} expert {e} row {j}: codes differ")
                    if rows_sf[e, j].tolist() != want_s:
                        fails.append(f"{tag} expert {e} row {j}: scales differ")
                    d = nvfp4.dequantize(values[j, :, e], rows_sf[e, j].view(torch.float8_e4m3fn),
                                         gs).view(-1, 16)
                    blk = src.float().view(-1, 16)
                    bound = blk.abs().amax(-1, keepdim=True) * nvfp4.DEQUANT_BOUND * (1 + 1e-6)
                    if not bool(((d - blk).abs() <= bound).all()):
                        fails.append(f"{tag} expert {e} row {j}: beyond the bound")
        # the combine of an NVFP4 dispatch takes bf16 expert outputs, as DeepEP's
        out = torch.ones(Lx, W * T, H, dtype=torch.bfloat16)
        y, _, _ = buf.low_latency_combine(out, idx, w, handle)
        want_y = torch.where(idx >= 0, w, 0).sum(1, keepdim=True).expand(-1, H)
        if not torch.allclose(y.float(), want_y, rtol=1e-2, atol=1e-2):
            fails.append(f"{tag} combine after NVFP4 dispatch")
    return fails if rows else [f"rank {rank}: no row received: the test checked nothing"]


def test_nvfp4_dispatch_end_to_end():
    fails = [f for r in run_distributed(_dispatch_body, W) for f in r]
    assert fails == []


def _refusals_body(rank, world):
    import llcomm.deep_ep as deep_ep
    errors = []
    buf = deep_ep.Buffer(None, backend="reference")
    x, idx, _ = case(W, E, T, H, K, 6)[rank]
    gs = torch.tensor(1.0)

    def expect(what, exc, words, **kw):
        args = dict(use_fp8=False, use_nvfp4=True, x_global_scale=gs) | kw
        _expect(errors, what, exc, words,
                lambda: buf.low_latency_dispatch(args.pop("x", x), idx, T, E, **args))

    expect("with fp8", ValueError, ["use_nvfp4=True", "use_fp8=True"], use_fp8=True)
    expect("default use_fp8", ValueError, ["use_fp8"], use_fp8=True)
    expect("no global scale", ValueError, ["x_global_scale"], x_global_scale=None)
    expect("global scale dtype", TypeError, ["x_global_scale", "float32"],
           x_global_scale=torch.tensor(1.0, dtype=torch.float64))
    expect("global scale empty", ValueError, ["x_global_scale", "empty"],
           x_global_scale=torch.ones(0))
    expect("global scale type", TypeError, ["x_global_scale"], x_global_scale=1.0)
    expect("hidden", ValueError, ["hidden", "multiple of 16", "hidden=264"],
           x=torch.zeros(T, 264, dtype=torch.bfloat16))
    expect("bool", TypeError, ["use_nvfp4=1"], use_nvfp4=1)
    expect("ue8m0 sf", NotImplementedError, ["use_ue8m0_for_sf=True"], use_ue8m0_for_sf=True)
    if buf.ep_buffer is not None:
        errors.append("a refused NVFP4 dispatch made the EPBuffer (nothing may be launched)")
    return errors


def test_nvfp4_refusals_name_the_argument():
    errors = [e for r in run_distributed(_refusals_body, W) for e in r]
    assert errors == []


@pytest.mark.parametrize("v", [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
def test_e2m1_ties_go_to_the_even_code(v):
    from llcomm.deep_ep import nvfp4
    got = int(nvfp4.e2m1_codes(torch.tensor([v]))[0])
    assert got == oracle_e2m1(v) and got % 2 == 0

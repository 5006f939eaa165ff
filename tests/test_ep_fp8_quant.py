"""The LL dispatch's FP8 quantiser arithmetic (one GPU or the interpreter, no peers).

``llcomm/ep/kernels/fp8_rows.py _div_by`` replaces a division per element by one correctly rounded
reciprocal per scale and a correction by the exact remainder. It must give the very quotients
of IEEE division (torch's ``/`` on CUDA, and ``div_rn``) wherever the quantiser uses it:
``|x| <= 448 s`` (every element of a block is at most its amax = 448 s). Checked over every
finite bf16 value against scales spread log-uniformly from 2**-89 (RCP_MIN_SCALE) to 2**119,
plus scales made the way the quantiser makes them (amax / 448), powers of two (round_scale)
and a few below 2**-89 (which ``_div_by`` lifts by 2**64 first): on the GPU, and (fewer
scales) under ``TRITON_INTERPRET=1`` in CI, whose fma rounds once as well.

Then, on the GPU only (the interpreter cannot run the inline PTX convert), ``_pack_row_fp8`` as
the LL dispatch runs it (the convert and the reciprocal) against
``llcomm.runtime.fp8_format.quantize`` on rows of mixed magnitudes: the same words, byte for byte.

Run on a GPU host: ``python -m pytest tests/test_ep_fp8_quant.py -m gpu -q``.
"""
import pytest
import torch
import triton
import triton.language as tl

from _interp import run_in_interpreter
from llcomm.runtime import fp8_format as ep_fp8
from llcomm.runtime.fp8_format import FP8_BLOCK
from llcomm.ep.kernels.fp8_rows import RCP_MIN_SCALE, _div_by, _pack_row_fp8

ROWS = 64                   # 128-channel blocks per program of the division kernel
SCALES_GPU = 512            # random scales of each kind, against every finite bf16 value
SCALES_CPU = 32
#: bf16 values per scale with a quotient in [2**-11, 448]: 18 binades of 128 values, both signs
#: (about 4,600; fewer for the largest scales)
MIN_COMPARED_PER_SCALE = 4_000


@triton.jit
def _div_kernel(x, s, out, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    rs = p * ROWS + tl.arange(0, ROWS)
    cs = tl.arange(0, BLOCK)
    v = tl.load(x + rs[:, None] * BLOCK + cs[None, :])
    tl.store(out + rs[:, None] * BLOCK + cs[None, :], _div_by(v, tl.load(s + rs)))


@triton.jit
def _pack_kernel(x, words, scales, H: tl.constexpr, HP: tl.constexpr, RW: tl.constexpr,
                 HPW: tl.constexpr, NS: tl.constexpr, ROUND: tl.constexpr):
    t = tl.program_id(0)
    hs = tl.arange(0, HP)
    v = tl.load(x + t * H + hs, mask=hs < H, other=0.0).to(tl.float32)
    w, sw = _pack_row_fp8(v, HP, HPW, ROUND)
    ws = tl.arange(0, HPW)
    ns = tl.arange(0, HP // 128)
    tl.store(words + t * RW + ws, w, mask=ws < RW)
    tl.store(scales + t * NS + ns, sw, mask=ns < NS)


def _e4m3(q: torch.Tensor) -> torch.Tensor:
    return q.clamp(-ep_fp8.FP8_MAX, ep_fp8.FP8_MAX).to(ep_fp8.FP8_DTYPE).view(torch.uint8)


def _finite_bf16(device) -> torch.Tensor:
    """Every finite bf16 value, as fp32, padded to whole 128-value blocks with zeros."""
    v = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    v = v[torch.isfinite(v)].float()
    pad = -v.numel() % FP8_BLOCK
    return torch.cat([v, v.new_zeros(pad)]).to(device)


def _scales(gen, n: int, device) -> torch.Tensor:
    lo, hi = -89.0, 119.0            # amax is a bf16 value: s <= 2**119
    log_uniform = torch.exp2(torch.rand(n, generator=gen, dtype=torch.float64) * (hi - lo)
                             + lo).float()
    amax = torch.randn(n, generator=gen).abs().to(torch.bfloat16).float()
    made = amax / torch.full_like(amax, ep_fp8.FP8_MAX)
    pow2 = torch.exp2(torch.randint(-89, 120, (n,), generator=gen).float())
    # the bound itself, and scales below it (rows lifted by RCP_LIFT; 2**-140 is subnormal)
    edge = torch.tensor([RCP_MIN_SCALE.value, 1.0, 0.75 * RCP_MIN_SCALE.value, 2.0 ** -126,
                         2.0 ** -140])
    return torch.cat([log_uniform, made, pow2, edge]).to(device)


def division_mismatches(device: str, n_scales: int) -> dict:
    """``_div_by`` against IEEE division over every finite bf16 value and ``3 * n_scales + 5``
    scales: how many quotients differ (and a few of them), and how many were compared bit for
    bit."""
    gen = torch.Generator().manual_seed(12)
    xs = _finite_bf16(device)
    blocks = xs.numel() // FP8_BLOCK
    compared, wrong, examples = 0, 0, []
    for s in _scales(gen, n_scales, device).split(64):
        x = xs.view(1, blocks, FP8_BLOCK).expand(s.numel(), -1, -1).reshape(-1, FP8_BLOCK)
        sc = s.repeat_interleave(blocks)
        rows = x.shape[0] - x.shape[0] % ROWS
        x, sc = x[:rows].contiguous(), sc[:rows].contiguous()
        out = torch.full_like(x, float("nan"))
        _div_kernel[(rows // ROWS,)](x, sc, out, ROWS=ROWS, BLOCK=FP8_BLOCK)
        want = x / sc[:, None]
        used = x.abs() <= ep_fp8.FP8_MAX * sc[:, None]     # the quantiser's domain
        # bit for bit where e4m3 can tell quotients apart (from 2**-11 up: below, every
        # quotient rounds to a zero), and the same e4m3 byte (a zero's sign too) everywhere
        exact = used & (want.abs() >= 2.0 ** -11)
        bad = exact & (out.view(torch.int32) != want.view(torch.int32))
        bad |= used & (_e4m3(out) != _e4m3(want))
        compared += int(exact.sum())
        wrong += int(bad.sum())
        examples += list(zip(x[bad][:4].tolist(), sc[:, None].expand_as(x)[bad][:4].tolist()))
    return dict(compared=compared, wrong=wrong, examples=examples[:8])


@pytest.mark.gpu(gpus=1)
def test_div_by_is_ieee_division_gpu():
    got = division_mismatches("cuda", SCALES_GPU)
    assert got["wrong"] == 0, f"quotients that differ from IEEE division (x, s): {got}"
    assert got["compared"] > MIN_COMPARED_PER_SCALE * 3 * SCALES_GPU, got


def test_div_by_is_ieee_division_interpreter():
    got = run_in_interpreter("test_ep_fp8_quant", "division_mismatches", "cpu", SCALES_CPU)
    assert got["wrong"] == 0, f"quotients that differ from IEEE division (x, s): {got}"
    assert got["compared"] > MIN_COMPARED_PER_SCALE * 3 * SCALES_CPU, got


@pytest.mark.gpu(gpus=1)
@pytest.mark.parametrize("round_scale", [False, True])
def test_pack_row_fp8_matches_torch(round_scale):
    gen = torch.Generator().manual_seed(5 + round_scale)
    n, H = 256, 7168
    # blocks of very different magnitudes, exact zeros, and an all-zero block
    mag = torch.exp2(torch.randint(-60, 60, (n, H // FP8_BLOCK, 1), generator=gen).float())
    x = (torch.randn(n, H // FP8_BLOCK, FP8_BLOCK, generator=gen) * mag).reshape(n, H)
    x[torch.rand(n, H, generator=gen) < 0.05] = 0
    x[0, :FP8_BLOCK] = 0
    x = x.to(torch.bfloat16).cuda()
    rw, ns = H // 4, H // FP8_BLOCK
    words = torch.zeros(n, rw, dtype=torch.int32, device="cuda")
    scales = torch.zeros(n, ns, dtype=torch.int32, device="cuda")
    _pack_kernel[(n,)](x, words, scales, H=H, HP=triton.next_power_of_2(H), RW=rw,
                       HPW=triton.next_power_of_2(rw), NS=ns, ROUND=int(round_scale))
    q, s = ep_fp8.quantize(x, round_scale)
    b = q.view(torch.uint8).view(n, rw, 4).to(torch.int32)
    want = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    # the LL dispatch sends a word equal to its sentinel (-1) as 0x7FFFFFFF (kernels/common.py)
    want = torch.where(want == -1, 0x7FFFFFFF, want)
    assert torch.equal(words, want), f"{int((words != want).sum())} of {want.numel()} words differ"
    assert torch.equal(scales.view(torch.float32), s)

"""The oracle of ``llcomm check``'s fused joins (``llcomm/commands/check_fused.py``), without ranks:
its quantisers agree with the table-based oracle of the tests (``tests/_norm_oracle.py``), its
norm bound takes a once-rounded norm and refuses torch's twice-rounded one, its static scale
tells a multiplication by the reciprocal from a division, and its eps reaches the small rows."""
import torch

import _norm_oracle as O
from llcomm.commands import check_fused as C


def _rows(tokens=6, hidden=512, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(11)
    rows = torch.where(torch.arange(tokens) % 2 == 0, C.SMALL_ROW, 1.0).view(tokens, 1)
    h = (torch.randn(tokens, hidden, generator=g) * rows).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    return h, w


def _once(h, w):
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + C.EPS) * w.float()).to(h.dtype)


def test_norm_bound_takes_one_rounding_and_refuses_two():
    h, w = _rows()
    assert C.wrong_norm(_once(h, w), h, w) == 0
    hf = h.float()
    twice = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + C.EPS)).to(h.dtype) * w
    assert C.wrong_norm(twice, h, w) > 0
    no_eps = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True)) * w.float()).to(h.dtype)
    assert C.wrong_norm(no_eps, h, w) >= h.shape[1]     # every element of a small row


def test_quantisers_match_the_table_oracle():
    h, w = _rows()
    y = _once(h, w)
    for round_scale in (False, True):
        q, s = C.codes_group(y, round_scale)
        want_q, want_s = O.group_codes(y, round_scale)
        assert torch.equal(q.view(torch.uint8), want_q) and torch.equal(s, want_s), round_scale
    scale = C.telling_scale(y)
    q = C.codes_static(y, scale)
    assert torch.equal(q.view(torch.uint8), O.static_codes(y, scale))
    by_div = O.e4m3_codes(y.float() / scale)
    assert not torch.equal(q.view(torch.uint8), by_div)               # the scale tells them apart
    assert float(y.float().abs().max()) / float(scale) > C.FP8_MAX    # and saturates the largest

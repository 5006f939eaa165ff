"""The LL dispatch in the generated code (no GPU: Triton compiles PTX for sm_90 on any machine).

What the LL dispatch is for, checked where it lives: no system-scope atomic or fence (no flag,
no release; the data is its own flag), volatile polls of its words, and FP8 rows rounded by the
GPU's ``cvt.rn.satfinite.e4m3x2.f32`` (``kernels/fp8_rows.py`` E4M3X4_PTX). The flag dispatch,
which a buffer for more than ``LL_MAX_TOKENS`` tokens runs, keeps its release and its bit
rounding.
"""
from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))

import ptx_ep as ptx_ep_tool    # tools/ptx_ep.py

SYS_ATOMIC = re.compile(r"\b(atom|red)\.[\w.]*\bsys\b|\bfence\.[\w.]*sys|\bmembar\.sys")
E4M3_CVT = "cvt.rn.satfinite.e4m3x2.f32"


def _ptx(name: str, tokens: int) -> str:
    fn, sig, consts, warps, opts = ptx_ep_tool.kernels(7168, 256, 2, tokens, 8, "bf16",
                                                       128)[name]
    return ptx_ep_tool.compile_one(fn, sig, consts, warps, opts).asm["ptx"]


@pytest.mark.parametrize("name", ["dispatch_bf16", "dispatch_bf16_fp8"])
def test_ll_dispatch_has_no_fence_and_polls(name, monkeypatch):
    monkeypatch.delenv("LLCOMM_EP_LL", raising=False)
    ll = _ptx(name, 128)
    assert not SYS_ATOMIC.search(ll), f"{name}: a system-scope atomic or fence in the LL dispatch"
    assert "ld.volatile.global" in ll
    assert (E4M3_CVT in ll) == name.endswith("fp8")
    flag = _ptx(name, 512)          # a buffer above LL_MAX_TOKENS: the flag dispatch
    assert SYS_ATOMIC.search(flag), f"{name}: the flag dispatch lost its release"
    assert E4M3_CVT not in flag

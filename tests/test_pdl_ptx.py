"""Programmatic dependent launch, checked in the generated code (no GPU: Triton compiles PTX for
sm_90 on any machine).

Under PDL a kernel's blocks may run while the kernel ahead of it on the stream still does, so
every protocol argument of the kernels ("rank r starts op k after finishing op k-1",
docs/design.md) holds only if nothing of global memory is read or written before
``griddepcontrol.wait``: the operand, the op counter and the error word may all still be
written by that kernel. These tests compile each kernel as the launcher does with
``LLCOMM_PDL=1`` and require the wait before the first global load, store or atomic, and
``launch_dependents`` after it; compiled without PDL, no grid-dependency instruction at all.
"""
from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))

import ptx as ptx_tool          # tools/ptx.py
import ptx_ep as ptx_ep_tool    # tools/ptx_ep.py

#: Every kind of kernel: Lamport one chunk / pipelined / reduce_scatter, flag one-shot and
#: two-shot, flag movement, LL movement, the fused joins (both algorithms; no residual, the FP8
#: outputs, whose static scale is read from memory too).
TP_KERNELS = ("lamport_bf16_8k", "lamport_bf16_8m_pipe", "lamport_rs_bf16_8m",
              "one_shot_bf16", "two_shot_bf16", "broadcast_i32", "all_gather_i32",
              "reduce_scatter_bf16", "ll_all_gather_8k", "lamport_norm_bf16_h8192",
              "one_shot_norm_bf16_h8192", "lamport_rmsnorm_bf16_h8192",
              "lamport_norm_fp8_bf16_h7168", "one_shot_norm_fp8_bf16_h7168",
              "lamport_norm_fp8g_bf16_h7168", "one_shot_norm_fp8g_bf16_h7168")
EP_KERNELS = ("dispatch_bf16", "combine_bf16")
#: A global load, store, reduction or async copy (any qualifiers: .volatile, .acquire.sys, .v4,
#: ...) or any atomic, predicated or not.
MEMORY_OP = re.compile(r"^\s*(@!?%p\d+\s+)?((ld|st|red|cp)\.[\w.]*global|atom\.)", re.M)


def _first(pattern, text: str) -> int:
    m = re.search(pattern, text, re.M)
    return m.start() if m else -1


def _ptx(name: str, pdl: bool) -> str:
    if name in EP_KERNELS:
        fn, sig, consts, warps, opts = ptx_ep_tool.kernels(7168, 256, 2, 128, 8, "bf16",
                                                           128)[name]
        return ptx_ep_tool.compile_one(fn, sig, consts, warps, opts, pdl).asm["ptx"]
    fn, sig, consts, *warps = ptx_tool.KERNELS[name]
    return ptx_tool.compile_one(fn, sig, consts, *warps, pdl=pdl).asm["ptx"]


@pytest.mark.parametrize("name", TP_KERNELS + EP_KERNELS)
def test_pdl_wait_comes_before_any_global_memory_access(name):
    ptx = _ptx(name, pdl=True)
    wait = _first(r"griddepcontrol\.wait", ptx)
    launch = _first(r"griddepcontrol\.launch_dependents", ptx)
    first_mem = MEMORY_OP.search(ptx)
    assert wait >= 0, f"{name}: no griddepcontrol.wait under PDL"
    assert first_mem is not None and wait < first_mem.start(), \
        f"{name}: {first_mem.group(0).strip()!r} before griddepcontrol.wait"
    assert launch > wait, f"{name}: launch_dependents missing or before the wait"


@pytest.mark.parametrize("name", ("lamport_bf16_8k", "dispatch_bf16"))
def test_without_pdl_no_grid_dependency_instruction(name):
    assert "griddepcontrol" not in _ptx(name, pdl=False)

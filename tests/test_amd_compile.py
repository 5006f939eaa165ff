"""Every kernel variant compiled for AMD's gfx942 (MI300X) through Triton's HIP backend, and its
memory ordering read from the AMDGCN (no GPU: Triton compiles for gfx942 on any machine).

The variants are those of ``tools/ptx.py`` and ``tools/ptx_ep.py`` (the EP ones for buffers of
128 and 512 tokens: the LL and the flag dispatch). Each must compile without an error from
LLVM (a refused inline-assembly operand is printed, not raised), with no NVIDIA instruction
left (the timer, the e4m3 convert, PDL), and with the system-scope ordering its Triton code
asks for: each release atomic after an L2 write-back, each acquire atomic before a cache
invalidate (``tools/amdgcn.py``). What this proves and what it does not: docs/development.md,
"AMD: what compiles".
"""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch
import triton
import triton.language as tl

from _interp import run_in_interpreter
from llcomm.ep.kernels.fp8_rows import _e4m3x4

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))

import amdgcn
import ptx as ptx_tool
import ptx_ep as ptx_ep_tool

GFX942 = ptx_tool.TARGETS["gfx942"]
#: The EP buffers compiled: the LL dispatch (128 tokens) and the flag dispatch (512).
EP_TOKENS = (128, 512)
NVIDIA_ONLY = ("%globaltimer", "%clock64", "cvt.rn.satfinite", "griddepcontrol")
#: A system-scope atomic in LLVM IR (no syncscope: the system) and its ordering.
IR_SYS_ATOMIC = re.compile(r"= (?:atomicrmw \w+|cmpxchg) ptr addrspace\(1\) "
                           r"(?:(?!syncscope)[^\n])*?\b(monotonic|acquire|release|acq_rel|seq_cst)\b")


def _ep_kernels(tokens: int, dt: str) -> dict:
    """tools/ptx_ep.py's variants at its defaults (hidden 7168, 256 experts, 2 ranks, top-8, 128
    blocks) for a buffer of ``tokens`` tokens."""
    return ptx_ep_tool.kernels(7168, 256, 2, tokens, 8, dt, 128)


def _variants() -> dict:
    """Every variant by a key: the TP ones, the EP ones of the LL buffer in bf16 and fp32, and
    the unmasked flag dispatch's of the larger buffer in bf16 (the combine and the masked
    dispatch, the same code at another size, only at the smaller one: compile time)."""
    out = {f"tp/{n}": ("tp", n, 0) for n in ptx_tool.KERNELS}
    for tokens in EP_TOKENS:
        for dt in ("bf16", "fp32") if tokens == EP_TOKENS[0] else ("bf16",):
            for n in _ep_kernels(tokens, dt):
                if tokens == EP_TOKENS[0] or (n.startswith("dispatch") and "masks" not in n):
                    out[f"ep{tokens}/{n}"] = ("ep", n, tokens)
    return out


VARIANTS = _variants()


def _compile(key: str):
    family, name, tokens = VARIANTS[key]
    if family == "tp":
        fn, sig, consts, *warps = ptx_tool.KERNELS[name]
        return ptx_tool.compile_one(fn, sig, consts, *warps, target=GFX942)
    dt = "fp32" if "_fp32" in name else "bf16"
    fn, sig, consts, warps, opts = _ep_kernels(tokens, dt)[name]
    return ptx_ep_tool.compile_one(fn, sig, consts, warps, opts, target=GFX942)


def check_ordering(asm: str, llir: str) -> list[str]:
    """What is wrong with the system-scope ordering of a kernel's AMDGCN ``asm``, given the
    atomics its LLVM IR ``llir`` asks for: an atomic neither released nor acquired, or a release
    (acquire) the IR has that the code lacks."""
    wrong = []
    atoms = amdgcn.sys_atomics(asm)
    wrong += [f"unordered: {a['insn']}" for a in atoms if not (a["release"] or a["acquire"])]
    orders = IR_SYS_ATOMIC.findall(llir)
    if any(o in ("release", "acq_rel", "seq_cst") for o in orders) and \
            not any(a["release"] for a in atoms):
        wrong.append("a system-scope release in the IR, no buffer_wbl2 sc0 sc1 before an atomic")
    if any(o in ("acquire", "acq_rel", "seq_cst") for o in orders) and \
            not any(a["acquire"] for a in atoms):
        wrong.append("a system-scope acquire in the IR, no buffer_inv sc0 sc1 after an atomic")
    return wrong


@pytest.mark.parametrize("key", list(VARIANTS))
def test_compiles_for_gfx942_with_its_ordering(key, capfd):
    k = _compile(key)
    llvm_said = capfd.readouterr().err
    asm, llir = k.asm["amdgcn"], k.asm["llir"]
    assert k.asm.get("hsaco"), f"{key}: no code object"
    assert "error" not in llvm_said, f"{key}: LLVM reported\n{llvm_said}"
    left = [s for s in NVIDIA_ONLY if s in llir or s in asm]
    assert not left, f"{key}: NVIDIA instructions left for gfx942: {left}"
    # every bounded wait reads the real-time counter
    assert "s_memrealtime" in asm or key.endswith("_send"), f"{key}: no timer under its waits"
    assert ("s_memtime" in asm) == key.endswith("_prof"), f"{key}: profiling clock"
    wrong = check_ordering(asm, llir)
    assert not wrong, f"{key}: " + "; ".join(wrong)


#: The EP variants that wait (the dispatch's send halves poll nothing).
EP_WAITS = {k for k in VARIANTS
            if k.startswith("ep") and not re.search(r"/dispatch_\w+_send$", k)}


@pytest.mark.parametrize("key", list(VARIANTS))
def test_polls_stay_volatile_on_gfx942(key):
    """A poll must read memory, not a cache line a peer's store does not reach: the volatile
    loads of the Triton IR stay volatile in the LLVM IR (as many or more: LLVM may split a
    vector load) and on gfx942 (a load with ``sc0 sc1``). EP polls with acquire atomics at
    system scope on AMD instead (``sync.poll_read``: Triton's AMD backend drops ``volatile``
    from their loads), so its waits must have some, each followed by its invalidate
    (``check_ordering``)."""
    k = _compile(key)
    asked = k.asm["ttir"].count("isVolatile = true")
    kept = len(re.findall(r"= load volatile ", k.asm["llir"]))
    assert kept >= asked, f"{key}: {asked} volatile loads in Triton's IR, {kept} in LLVM's"
    if asked:
        assert re.search(r"_load\w* [^;\n]*\bsc0 sc1\b", k.asm["amdgcn"]), key
    if key in EP_WAITS:
        assert any(a["acquire"] for a in amdgcn.sys_atomics(k.asm["amdgcn"])), \
            f"{key}: no acquire atomic polls"


def test_ordering_check_fails_without_the_release():
    """The check itself: a signal without its write-back, an acquire without its invalidate."""
    k = _compile("tp/one_shot_bf16")
    asm, llir = k.asm["amdgcn"], k.asm["llir"]
    assert check_ordering(asm, llir) == []
    assert check_ordering(asm.replace(amdgcn.RELEASE, "s_nop 0"), llir)
    assert check_ordering(asm.replace(amdgcn.ACQUIRE, "s_nop 0"), llir)


def test_no_pdl_on_rocm(monkeypatch):
    """A ROCm torch names its GPUs ``cuda`` and reports gfx942 as capability 9.4: the launcher
    must still refuse PDL there."""
    from llcomm.runtime import launch
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert "AMD" in launch.pdl_unavailable(torch.device("cuda", 0))


# -- the FP8 pack on the bits, against the GPU's convert ---------------------------------------

def _convert_model(q: torch.Tensor) -> torch.Tensor:
    """``cvt.rn.satfinite.e4m3x2.f32`` per the PTX ISA, on the host: round to nearest even, a
    finite value past the largest code saturates to +-448; word w holds bytes of 4w .. 4w + 3
    in order (E4M3X4_PTX's register pairs)."""
    b = q.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    b = b.view(-1, 4)
    return b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)


def _quotients() -> torch.Tensor:
    """fp32 values where the rounding decides: every e4m3 value, the midpoints between
    neighbours and one fp32 ulp either side, subnormals, values past 448 (to 464, the midpoint
    to a code e4m3fn does not have, and beyond), zeros; both signs."""
    codes = torch.arange(0, 0x7F, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    mids = (vals[1:] + vals[:-1]) / 2
    ulp = torch.nextafter
    inf = torch.full_like(mids, float("inf"))
    near = torch.cat([mids, ulp(mids, inf), ulp(mids, -inf)])
    past = torch.tensor([448.5, 463.9, 464.0, 464.1, 480.0, 1e4, 3e38, 2.0 ** -10, 2.0 ** -9,
                         2.0 ** -10 * 1.5, 2.0 ** -12, 1e-30, 0.0])
    x = torch.cat([vals, near, past])
    x = torch.cat([x, -x])
    return torch.cat([x, x.new_zeros(-x.numel() % 4)])


@triton.jit
def _pack_kernel(q, out, N: tl.constexpr):
    w = tl.arange(0, N)
    e0, e1 = tl.load(q + 4 * w), tl.load(q + 4 * w + 1)
    e2, e3 = tl.load(q + 4 * w + 2), tl.load(q + 4 * w + 3)
    tl.store(out + w, _e4m3x4(e0, e1, e2, e3, 0))


def plain_pack_words(values: list) -> list:
    """``_e4m3x4`` on the bits (CONVERT=0), run in the interpreter over ``values``."""
    q = torch.tensor(values, dtype=torch.float32)
    n = q.numel() // 4
    size = triton.next_power_of_2(n)
    qp = torch.cat([q, q.new_zeros(4 * size - q.numel())])
    out = torch.zeros(size, dtype=torch.int32)
    _pack_kernel[(1,)](qp, out, N=size)
    return out[:n].tolist()


def test_fp8_pack_on_the_bits_is_the_convert():
    """The e4m3 words of the LL dispatch where the GPU's convert is not used (AMD, the
    interpreter) are the convert's, byte for byte and in byte order."""
    q = _quotients()
    got = torch.tensor(run_in_interpreter("test_amd_compile", "plain_pack_words", q.tolist()),
                       dtype=torch.int32)
    want = _convert_model(q)
    bad = (got != want).nonzero().flatten().tolist()
    first = [(q[4 * i:4 * i + 4].tolist(), hex(got[i]), hex(want[i])) for i in bad[:3]]
    assert not bad, f"{len(bad)} words differ, first (quotients, got, want): {first}"

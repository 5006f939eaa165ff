"""Read the memory ordering of llcomm's kernels in AMDGCN (gfx942): what ``tools/ptx.py
--target gfx942`` and ``tools/ptx_ep.py --target gfx942`` print, and what
tests/test_amd_compile.py asserts.

On gfx942 (LLVM's AMDGPU memory model) a system-scope release writes back the L2 before the
access, ``buffer_wbl2 sc0 sc1``, then waits for every earlier memory operation
(``s_waitcnt vmcnt(0)``); a system-scope acquire waits for its own load or atomic and then
invalidates the caches, ``buffer_inv sc0 sc1``. A system-scope atomic carries the ``sc1`` bit
(``sc0`` alone: a returning atomic at device scope). LLVM may turn an atomic that changes
nothing (``atomic_add`` of 0, acquire) into an acquire load, ``global_load ... sc0 sc1`` then
the invalidate (Triton 3.6 does): such a load counts as an acquire; one without the invalidate
is a volatile load (a poll), not an atomic, and is not reported.
"""
import os
import re

RELEASE = "buffer_wbl2 sc0 sc1"
ACQUIRE = "buffer_inv sc0 sc1"


def code_lines(asm: str) -> list[str]:
    """The instructions of ``asm``, one a line, stripped (no directives, labels, comments)."""
    out = []
    for line in asm.splitlines():
        s = line.split(";")[0].strip()
        if s and not s.startswith(".") and not s.endswith(":"):
            out.append(s)
    return out


def sys_atomics(asm: str) -> list[dict]:
    """Every system-scope global atomic of ``asm`` and every acquire load, in order: its
    instruction, whether a system-scope release fence comes right before it (only waits
    between), whether an acquire invalidate comes right after it (only waits between) and, if
    so, whether a wait for the access itself (``vmcnt(0)``) comes before the invalidate."""
    lines = code_lines(asm)
    found = []
    for i, s in enumerate(lines):
        atomic = s.startswith("global_atomic_") and re.search(r"\bsc1\b", s)
        load = s.startswith("global_load") and re.search(r"\bsc0 sc1\b", s)
        if not (atomic or load):
            continue
        j = i - 1
        while j >= 0 and lines[j].startswith(("s_waitcnt", "s_nop")):
            j -= 1
        k = i + 1
        while k < len(lines) and lines[k].startswith(("s_waitcnt", "s_nop")):
            k += 1
        acquire = k < len(lines) and lines[k] == ACQUIRE
        if load and not acquire:
            continue
        found.append({"insn": s, "release": j >= 0 and lines[j] == RELEASE, "acquire": acquire,
                      "waited": acquire and "vmcnt(0)" in " ".join(lines[i + 1:k])})
    return found


def summary(name: str, asm: str, dump: str | None) -> str:
    """Write ``asm`` to ``dump/name.amdgcn`` when asked; return the counts of system-scope
    atomics that release, that acquire (and of those, that invalidate without waiting for the
    atomic), and that do neither (none should)."""
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, name + ".amdgcn"), "w") as f:
            f.write(asm)
    atoms = sys_atomics(asm)
    rel = sum(a["release"] for a in atoms)
    acq = sum(a["acquire"] for a in atoms)
    unwaited = sum(a["acquire"] and not a["waited"] for a in atoms)
    bare = sum(not (a["release"] or a["acquire"]) for a in atoms)
    return (f"sys release {rel:2d}  sys acquire {acq:2d} (unwaited {unwaited})  "
            f"sys unordered {bare}  timer reads {asm.count('s_memrealtime'):2d}")

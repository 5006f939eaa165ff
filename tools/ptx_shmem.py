"""Compile the two-level EP kernels with their SHMEM calls for sm_90 or gfx942 (no GPU needed).

    python tools/ptx_shmem.py [--dump DIR] [--hosts 2] [--ranks-per-host 8] [--tokens 128]
                              [--hidden 7168] [--experts 256] [--topk 8] [--blocks 64]
                              [--target gfx942]

torch's SHMEM Triton layer defines its device functions only where torch sees a GPU
(``llcomm/runtime/shmem.py``), so this tool first tells torch it has one, then compiles
``hosts_dispatch_kernel`` (bf16 rows, FP8, FP8 with power-of-two scales) and
``hosts_combine_kernel`` with ``SHMEM`` = 1, linking NVSHMEM's device bitcode from the
``nvidia-nvshmem-cu13`` (or ``-cu12``) wheel, the bf16 dispatch and the combine with rank
masks and wait statistics (``MASKS`` = ``STATS`` = 1) too, and the kernels with ``SHMEM`` = 0
for comparison. Prints per kernel the NVSHMEM functions it calls (read from its TTGIR; in the
PTX they are inlined from the bitcode), the system-scope atomics (the signals inside a host and
the acquires after the waits), and the PTX size; exits 1 when the bitcode lacks the declared
non-blocking put-with-signal, when a SHMEM kernel misses the put-with-signal or the wait
(``MUST_CALL``), calls a thread-scope signal, quiet or fence (``MUST_NOT_CALL``), or leaves a
function undefined in its PTX, or when a SHMEM = 0 kernel calls any.

``--target gfx942`` compiles the same kernels for AMD's MI300X (Triton's HIP backend, warps of
64 lanes) with ``SHMEM`` = 2, rocSHMEM through torch's ``_rocshmem_triton`` layer, and with
``SHMEM`` = 0, without rocSHMEM's device library (``librocshmem_device_gfx942.bc`` comes with a
ROCm install; none is here). Triton's HIP backend links device bitcode in its LLIR stage, a
library only where a declared function's name contains the library's name; without one the
rocSHMEM functions stay declared, the AMDGCN calls them through the GOT, and ld.lld links a code
object that keeps them as undefined symbols (nothing checks them before a GPU would load it).
So every stage runs, and the code object's undefined symbols are what the library would have to
define. Prints per kernel the rocSHMEM functions its LLIR declares, the signal operation and
comparison it passes them, the code object's undefined symbols, the system-scope atomics of its
AMDGCN and its size; exits 1 when a kernel fails to compile (a static assertion, such as that
of the layer's ``signal_op``, or a function the layer does not define), when a SHMEM kernel
declares other than ``ROC_MUST_CALL`` (checked to be declared by the layer), calls a quiet,
fence, signal or atomic set (``ROC_MUST_NOT_CALL``), passes constants other than rocSHMEM's
(``rail.ROC_SIGNAL_SET``, ``rail.ROC_CMP_EQ``) or leaves another symbol undefined, or when a
SHMEM = 0 kernel declares or leaves undefined any function. No HIP build of torch is needed or
faked: ``llcomm/runtime/shmem.py`` takes the rocSHMEM layer's functions on any build, and the
layer defines them wherever torch finds Triton (``tell_torch_it_has_triton``).
tests/test_shmem_compile.py runs both targets.
"""
from __future__ import annotations

import argparse
import fnmatch
import glob
import inspect
import os
import re
import struct
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

#: NVSHMEM's device functions the SHMEM kernels must reach: the block-collective, non-blocking
#: put-with-signal, and the wait that runs the transport's consistency step.
MUST_CALL = ("nvshmemx_putmem_signal_nbi_block", "nvshmem_signal_wait_until")
#: Thread-scope calls no kernel may make (Triton would issue them once per thread).
MUST_NOT_CALL = ("nvshmemx_signal_op", "nvshmem_quiet", "nvshmem_fence",
                 "nvshmemx_putmem_block")
#: rocSHMEM's device functions (torch's ``_rocshmem_triton`` names) a SHMEM = 2 kernel must
#: declare, and the only ones it may: the work-group put-with-signal and the signal wait.
ROC_MUST_CALL = ("rocshmem_putmem_signal_wg", "rocshmem_uint64_wait_until")
#: Names (patterns) no kernel may call on AMD: quiet, fence, a signal of its own, an atomic set.
ROC_MUST_NOT_CALL = ("rocshmem_*quiet*", "rocshmem_*fence*", "*signal_op*", "*atomic_set*")


def tell_torch_it_has_triton() -> None:
    """Make torch define its SHMEM Triton device functions in this process (it defines them only
    when it finds Triton and a GPU). Must run before torch.distributed is imported."""
    import torch.utils._triton as tt
    tt.has_triton = lambda: True


def device_bitcode() -> str:
    """NVSHMEM's device bitcode for sm_90 from the nvidia-nvshmem wheel: ``libnvshmem_device.bc``
    (3.4) or ``libnvshmem_device_sm_90.bc`` (3.8 ships one per architecture)."""
    lib = os.path.join(sysconfig.get_path("purelib"), "nvidia", "nvshmem", "lib")
    for name in ("libnvshmem_device_sm_90.bc", "libnvshmem_device.bc"):
        if os.path.exists(os.path.join(lib, name)):
            return os.path.join(lib, name)
    raise SystemExit(f"ptx_shmem: no NVSHMEM device bitcode in {lib} (found "
                     f"{glob.glob(os.path.join(lib, '*.bc'))}); pip install nvidia-nvshmem-cu13")


def signatures(dtype: str) -> tuple[dict, dict]:
    """Argument types of the two kernels (``dtype`` the buffer's: bf16, fp16 or fp32)."""
    d = dict(x=f"*{dtype}", topk="*i64", n_tok="i32", recv_x=f"*{dtype}", recv_scales="*fp32",
             row_of="*i32", src_info="*i32", recv_count="*i32", ntok_out="*i32",
             fwd_ids="*i32", fwd_ntok="*i32", tab="*i64", ctrl="*i64", err="*i64", rank="i32",
             tag="i32", timeout_us="i32", ledger="*i64", stats="*i64")
    c = dict(eo=f"*{dtype}", topk="*i64", wts="*fp32", n_tok="i32", out=f"*{dtype}",
             row_of="*i32", ntok_in="*i32", fwd_ids="*i32", fwd_ntok="*i32", tab="*i64",
             ctrl="*i64", err="*i64", rank="i32", tag="i32", timeout_us="i32", ledger="*i64",
             stats="*i64")
    return d, c


def summary(kernel) -> dict:
    """The SHMEM functions the kernel calls (from its TTGIR: the PTX has them inlined), whether
    the PTX left any NVSHMEM function undefined (``.extern``: the bitcode not linked), its
    system-scope atomics and its size."""
    ptx = kernel.asm["ptx"]
    called = sorted(set(re.findall(r'symbol = "(nvshmem[a-z_0-9]*)"', kernel.asm["ttgir"])))
    return {"nvshmem": called,
            "unlinked": re.findall(r"\.extern \.func[^(]*\b(nvshmem[a-z_0-9]*)", ptx),
            "sys_atomics": len(re.findall(r"atom\.[a-z.]*sys", ptx)),
            "bytes": len(ptx)}


#: Which of the two SHMEM functions (``MUST_CALL`` / ``ROC_MUST_CALL``: the put, the wait) a
#: variant with SHMEM must call, and so which it must not: a whole op both; a send half only
#: the put (it waits for nobody); the dispatch's receive half only the wait.
BOTH, PUT, WAIT = (0, 1), (0,), (1,)


def _without(d: dict, *keys) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def variants(a, shmem: int):
    """Every variant compiled, in print order: (label, kernel, signature, constexprs with
    ``SHMEM``, num_warps, SHMEM on, the SHMEM functions it must call: ``BOTH``, ``PUT`` or
    ``WAIT``). Dispatch in bf16, FP8 and FP8 with power-of-two scales, and the combine, each
    with ``SHMEM`` = ``shmem`` and 0; the bf16 dispatch and the combine with rank masks and
    wait statistics, and each one's send and receive halves (``return_recv_hook``), with
    ``shmem`` only (the plain stores are the same code); the dispatch carrying the weights and
    the combine that reads them from the handle (``CARRY``, ``CARRIED``), ``shmem`` only; the
    stages that ``llcomm bench ep --calibrate`` launches alone, plain only."""
    from llcomm.ep.hosts.kernels import combine as HC
    from llcomm.ep.hosts.kernels import dispatch as HD
    from llcomm.ep.hosts.peer import hosts_consts, make_layout
    for fp8, name in ((0, "bf16"), (1, "fp8"), (2, "fp8_pow2")):
        lay = make_layout(a.tokens, a.hidden, a.hosts, a.ranks_per_host, 2, bool(fp8),
                          a.experts, a.blocks)
        dc, cc, warps = hosts_consts(lay, a.experts, a.topk, fp8)
        dsig, csig = signatures("bf16")
        cc = dict(cc, w_of=None)        # the weights not carried: the kernels' defaults
        cc.pop("enable_fp_fusion")
        dc = dict(dc, wts=None, w_of=None)
        D, C = HD.hosts_dispatch_kernel, HC.hosts_combine_kernel
        kernels = [(f"hosts_dispatch_{name}", D, dsig, dict(dc, STAGES=HD.HOSTS_DISPATCH_ALL),
                    (shmem, 0), BOTH)]
        if fp8 == 0:
            kernels += [
                ("hosts_combine", C, csig, dict(cc, STAGES=HC.HOSTS_COMBINE_ALL), (shmem, 0),
                 BOTH),
                ("hosts_dispatch_bf16_masks", D, dsig,
                 dict(dc, STAGES=HD.HOSTS_DISPATCH_ALL, MASKS=1, STATS=1), (shmem,), BOTH),
                ("hosts_combine_masks", C, csig,
                 dict(cc, STAGES=HC.HOSTS_COMBINE_ALL, MASKS=1, STATS=1), (shmem,), BOTH),
                ("hosts_dispatch_send_half", D, dsig,
                 dict(dc, STAGES=HD.HOSTS_DISPATCH_SEND_HALF), (shmem,), PUT),
                ("hosts_dispatch_recv_half", D, dsig,
                 dict(dc, STAGES=HD.HOSTS_DISPATCH_RECV_HALF), (shmem,), WAIT),
                ("hosts_combine_send_half", C, csig,
                 dict(cc, STAGES=HC.HOSTS_COMBINE_SEND_HALF), (shmem,), PUT),
                ("hosts_combine_recv_half", C, csig,
                 dict(cc, STAGES=HC.HOSTS_COMBINE_RECV_HALF), (shmem,), BOTH),
                ("hosts_dispatch_carry", D, dict(dsig, wts="*fp32", w_of="*fp32"),
                 {**_without(dc, "wts", "w_of"), "STAGES": HD.HOSTS_DISPATCH_ALL, "CARRY": 1},
                 (shmem,), BOTH),
                ("hosts_combine_carried", C, dict(csig, w_of="*fp32"),
                 {**_without(cc, "w_of"), "STAGES": HC.HOSTS_COMBINE_ALL, "CARRIED": 1},
                 (shmem,), BOTH),
                ("hosts_forward_stage", D, dsig,
                 dict(dc, STAGES=HD.HD_FORWARD_OWN | HD.HD_FORWARD), (0,), ()),
                ("hosts_partials_stage", C, csig, dict(cc, STAGES=HC.HC_PARTIALS), (0,), ()),
                ("hosts_host_sums_stage", C, csig,
                 dict(cc, STAGES=HC.HC_HOST_SUM_WAIT | HC.HC_HOST_SUM), (0,), ())]
        for kname, fn, sig, consts, values, need in kernels:
            for v in values:
                yield (f"{kname}{'' if v else '_plain'}", fn, sig, dict(consts, SHMEM=v), warps,
                       bool(v), need if v else ())


def undefined_symbols(elf: bytes) -> list[str]:
    """The undefined symbols of a 64-bit little-endian ELF file (a code object), sorted."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize)
                for i in range(shnum)]
    names = set()
    for _, kind, _, _, off, size, link, _, _, entsize in sections:
        if kind not in (2, 11):        # SHT_SYMTAB, SHT_DYNSYM
            continue
        stroff = sections[link][4]
        for at in range(off, off + size, entsize or 24):
            name, _, _, shndx = struct.unpack_from("<IBBH", elf, at)
            if shndx == 0 and name:    # SHN_UNDEF
                names.add(elf[stroff + name:elf.index(b"\0", stroff + name)].decode())
    return sorted(names)


def rocshmem_layer_functions(layer) -> set[str]:
    """The rocSHMEM device functions torch's ``_rocshmem_triton`` layer declares (the names of
    its externs; a stub that only asserts declares none)."""
    return set(re.findall(r'\(\s*"(rocshmem_\w+)"\s*,\s*core\.dtype', inspect.getsource(layer)))


def call_constants(llir: str, fn: str, index: int) -> set[str]:
    """The ``index``-th argument of every call of ``fn`` in ``llir``, as written (``i32 0``)."""
    return {[x.strip() for x in args.split(",")][index]
            for args in re.findall(rf"call \S+ @{fn}\(([^)]*)\)", llir)}


def compile_error(e: Exception) -> str:
    """What a failed compile says went wrong (a static assertion's message, a missing
    attribute), with the path of Triton functions down to it and the call that failed, from the
    chain of Triton's errors (each names its function and marks its line)."""
    from triton.compiler.errors import CompilationError, CompileTimeAssertionFailure
    frames, x, last = [], e, e
    while x is not None:
        text = str(x)
        fn = re.search(r"^def (\w+)", text, re.M)
        at = re.search(r"([^\n]*)\n[ \t]*\^[ \t]*(?:\n|$)", text)
        if fn and at:
            frames.append((fn.group(1), at.group(1).strip()))
        last, x = x, x.__cause__ or x.__context__
    if isinstance(last, CompileTimeAssertionFailure):
        what, call = f"static assertion: {last.error_message}", frames[-2:-1]
    elif isinstance(last, CompilationError) and last.error_message:
        what, call = last.error_message, frames[-1:]
    else:
        what, call = f"{type(last).__name__}: {last}", frames[-1:]
    where = " > ".join(f for f, _ in frames)
    return f"{what} (in {where}: {call[0][1]})" if call else what


def main_gfx942(a) -> int:
    """``--target gfx942`` (module doc)."""
    import types

    import amdgcn                   # tools/amdgcn.py, beside this file
    from ptx import TARGETS, compile_one

    from llcomm.ep.hosts.kernels.rail import PLAIN, ROC_CMP_EQ, ROC_SIGNAL_SET, ROCSHMEM
    from llcomm.runtime.shmem import layer_devices
    layer = layer_devices("rocshmem")
    if not isinstance(layer, types.ModuleType):
        print("ptx_shmem: torch's rocSHMEM Triton layer (_rocshmem_triton) defined no device "
              "functions")
        return 1
    defined = rocshmem_layer_functions(layer)
    missing = [f for f in ROC_MUST_CALL if f not in defined]
    if missing:
        print(f"ptx_shmem: torch's rocSHMEM layer declares no {', '.join(missing)}")
        return 1
    want = {ROC_MUST_CALL[0]: (5, f"i32 {ROC_SIGNAL_SET.value}"),   # put: the signal operation
            ROC_MUST_CALL[1]: (1, f"i32 {ROC_CMP_EQ.value}")}       # wait: the comparison
    bad = 0
    print(f"# {layer.__name__}, gfx942, no device library linked, {a.hosts} hosts x "
          f"{a.ranks_per_host} ranks, {a.tokens} tokens, hidden {a.hidden}, "
          f"top-{a.topk} of {a.experts}, {a.blocks} blocks")
    for label, fn, sig, consts, warps, on, must in variants(a, ROCSHMEM.value):
        assert consts["SHMEM"] in (ROCSHMEM.value, PLAIN.value)
        try:
            k = compile_one(fn, sig, consts, warps, target=TARGETS["gfx942"])
        except Exception as e:  # noqa: BLE001  (a failed compile is a BAD line)
            bad += 1
            print(f"{label:28s} BAD compile failed: {compile_error(e)}")
            continue
        llir, asm = k.asm["llir"], k.asm["amdgcn"]
        declared = sorted(set(re.findall(r"^declare [^@\n]*@([\w.$]+)\(", llir, re.M)))
        roc = [f for f in declared if f.startswith("rocshmem")]
        other = [f for f in declared if not f.startswith(("rocshmem", "llvm."))]
        undefined = undefined_symbols(k.asm["hsaco"])
        need = sorted(ROC_MUST_CALL[i] for i in must)
        problems = [f"missing {f}" for f in need if f not in roc]
        problems += [f"must not call {f}" for f in declared
                     if any(fnmatch.fnmatch(f, p) for p in ROC_MUST_NOT_CALL)]
        problems += [f"calls {f}" for f in roc + other if f not in need and
                     not any(fnmatch.fnmatch(f, p) for p in ROC_MUST_NOT_CALL)]
        if undefined != sorted(roc + other):
            problems.append(f"code object leaves {', '.join(undefined) or 'nothing'} undefined")
        for f, (index, c) in want.items():
            seen = call_constants(llir, f, index)
            if seen and seen != {c}:
                problems.append(f"{f} gets {', '.join(sorted(seen))} (rocSHMEM's: {c})")
        ok = not problems
        bad += not ok
        detail = "; ".join(problems) or (f"signal op {ROC_SIGNAL_SET.value}, cmp "
                                         f"{ROC_CMP_EQ.value}" if on else "no SHMEM call")
        print(f"{label:28s} {'ok ' if ok else 'BAD'} rocshmem: {', '.join(roc) or 'none'}; "
              f"{detail}; undefined in code object: {', '.join(undefined) or 'none'}; "
              f"sys atomics {len(amdgcn.sys_atomics(asm))}; AMDGCN {len(asm) // 1024} KiB")
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            for ext in ("llir", "amdgcn"):
                with open(os.path.join(a.dump, f"{label}.{ext}"), "w") as f:
                    f.write(k.asm[ext])
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dump", help="write each kernel's PTX (gfx942: LLIR and AMDGCN) into "
                                   "this folder")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--target", choices=("sm_90", "gfx942"), default="sm_90",
                    help="gfx942: rocSHMEM (SHMEM = 2) for AMD's MI300X, without "
                         "its device library (module doc)")
    a = ap.parse_args(argv)
    tell_torch_it_has_triton()
    if a.target == "gfx942":
        return main_gfx942(a)
    from ptx import compile_one     # tools/ptx.py, beside this file

    from llcomm.ep.hosts.kernels.rail import NV_PUT_SIGNAL_NBI
    from llcomm.runtime.shmem import device_functions_available, layer_name
    if not device_functions_available():
        print(f"ptx_shmem: torch's SHMEM Triton layer ({layer_name()}) defined no device "
              "functions")
        return 1
    libs = (("libnvshmem_device", device_bitcode()),)
    with open(libs[0][1], "rb") as f:
        if NV_PUT_SIGNAL_NBI.encode() not in f.read():
            print(f"ptx_shmem: {os.path.basename(libs[0][1])} defines no {NV_PUT_SIGNAL_NBI}")
            return 1
    bad = 0
    print(f"# {layer_name()}, bitcode {os.path.basename(libs[0][1])}, {a.hosts} hosts x "
          f"{a.ranks_per_host} ranks, {a.tokens} tokens, hidden {a.hidden}, "
          f"top-{a.topk} of {a.experts}, {a.blocks} blocks")
    for label, fn, sig, consts, warps, shmem, must in variants(a, 1):
        k = compile_one(fn, sig, consts, warps, extern_libs=libs if shmem else None)
        ptx = k.asm["ptx"]
        s = summary(k)
        calls = [f for f in MUST_CALL if f in s["nvshmem"]]
        banned = [f for f in MUST_NOT_CALL if f in s["nvshmem"]]
        ok = (calls == [MUST_CALL[i] for i in must] and not banned and not s["unlinked"]) \
            if shmem else not s["nvshmem"]
        bad += not ok
        print(f"{label:28s} {'ok ' if ok else 'BAD'} nvshmem: "
              f"{', '.join(calls + banned) or 'none'}; sys atomics {s['sys_atomics']}; "
              f"PTX {s['bytes'] // 1024} KiB")
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            with open(os.path.join(a.dump, label + ".ptx"), "w") as f:
                f.write(ptx)
    return 1 if bad else 0

if __name__ == "__main__":
    sys.exit(main())

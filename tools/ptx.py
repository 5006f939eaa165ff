"""Compile llcomm's kernels for sm_90 on any machine (no GPU needed) and report what matters.

    python tools/ptx.py [--dump DIR] [--pdl] [--same-as DIR] [--target gfx942]

``--same-as DIR`` compares each kernel's code with a ``--dump`` made before a change (debug
sections, ``.loc`` lines, comments and the kernel's own name left out, so a kernel renamed or
moved compares by its code): a refactor that should not change what runs must print ``same``
for every kernel.

Prints, per kernel, whether the peer loads/stores are 16 bytes wide (ld/st.global.v4), the
system-scope atomics, and register use when known. PTX reading costs no device time.
``--target gfx942`` compiles for AMD's MI300X instead and prints the system-scope ordering of
the AMDGCN (``tools/amdgcn.py``).
"""
import argparse
import contextlib
import inspect
import os
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime import driver

import amdgcn       # tools/amdgcn.py, beside this file
from llcomm.runtime import protocol as P
from llcomm.runtime.launch import FP_FUSION
from llcomm.runtime.kernels.lamport import ALL_STAGES
from llcomm.tp.kernels import (all_reduce, fused_norm, lamport_all_reduce, ll, movement,
                               reduce_scatter)

#: What ``--target`` compiles for: NVIDIA H100/H200 (PTX) or AMD MI300X (AMDGCN, ``--target
#: gfx942``: amdgcn.py reads it).
TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "gfx942": GPUTarget("hip", "gfx942", 64)}
TARGET = TARGETS["sm_90"]


class _TargetDriver:
    """Stands in for the driver of a GPU this machine need not have: ``tl.target_info``, which
    the kernels ask whether they compile for AMD, reads the active driver's target."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target


@contextlib.contextmanager
def compiling_for(target):
    """While compiling for ``target``, the kernels see it as the process's GPU, as they do
    when a launch compiles them on that GPU."""
    try:
        before = driver.active
    except RuntimeError:        # no GPU driver on this machine
        before = None
    driver.set_active(_TargetDriver(target))
    try:
        yield
    finally:
        driver.set_active(before)


def _sig(names, overrides):
    return {n: overrides.get(n, "i64") for n in names}


LL_SIG = {"x": "*i32", "out": "*i32", "n": "i32", "part": "i32", "src": "i32", "ll_tab": "*i64",
          "tag_tab": "*i64", "ctrl": "*i64", "err": "*i64", "rank": "i32", "tag": "i32",
          "timeout_us": "i32", "cap": "i64"}
#: (constexprs follow the kernel's parameter order: compile_one indexes them by position)
LL_8K = {"WORLD": 2, "WORLD_POW2": 2, "NUM_BLOCKS": 128, "BLOCK": 128, "STAGES": ALL_STAGES}

LAMPORT_SIG = {"x": "*i16", "out": "*i16", "n": "i32", "lam_tab": "*i64", "tag_tab": "*i64",
               "ctrl": "*i64", "err": "*i64", "rank": "i32", "tag": "i32", "timeout_us": "i32",
               "cap": "i64"}


def _lamport(nb, block, warps=4, fn=lamport_all_reduce.lamport_kernel, **later):
    """``lamport_all_reduce.lamport_kernel`` (or ``fn``, the Lamport reduce-scatter) on bf16
    (its int16 view) at 2 ranks; ``later``: the constexprs after STAGES, in the kernel's
    parameter order (compile_one needs that order)."""
    return (fn, LAMPORT_SIG,
            {"SENTINEL": -32768, "FLOAT": "bf16", "WORLD": 2, "WORLD_POW2": 2, "NUM_BLOCKS": nb,
             "BLOCK": block, "STAGES": ALL_STAGES, **later}, warps)


def _norm(algo, out_mode, residual=1, hidden=7168, block=8192, warps=16):
    """A fused-norm variant of ``fused_norm`` (``algo``: "lamport" / "one_shot") on bf16 at 2
    ranks: ``out_mode`` fused_norm.PLAIN / FP8_STATIC / FP8_GROUP, ``residual`` the RESIDUAL
    constexpr, the op code the host would give it (llcomm/tp/peer.py)."""
    lamport = algo == "lamport"
    sig = {"x": "*i16", "residual": "*bf16", "weight": "*bf16",
           "out": "*bf16" if out_mode == fused_norm.PLAIN else "*u8", "res_out": "*bf16",
           "tokens": "i32", "hidden": "i32", "eps": "fp32", "ctrl": "*i64", "err": "*i64",
           "rank": "i32", "tag": "i32" if lamport else "i64", "timeout_us": "i32", "cap": "i64"}
    sig.update({"lam_tab": "*i64", "tag_tab": "*i64"} if lamport else
               {"stage_tab": "*i64", "flag_tab": "*i64", "flags": "*i64"})
    consts = {"SENTINEL": -32768} if lamport else {}
    if out_mode == fused_norm.PLAIN:
        consts["qscale"] = None
    else:
        sig["qscale"] = "*fp32"
    op = {(fused_norm.PLAIN, 0): P.OP_NORM_LAMPORT, (fused_norm.FP8_STATIC, 1): P.OP_FP8_LAMPORT,
          (fused_norm.FP8_GROUP, 1): P.OP_FP8_GROUP_LAMPORT}[out_mode, residual]
    consts.update(FLOAT="bf16", WORLD=2, WORLD_POW2=2, NUM_BLOCKS=128, BLOCK=block,
                  STAGES=ALL_STAGES, OP=op + (0 if lamport else 1), RESIDUAL=residual,
                  OUT=out_mode, ROUND=0)
    fn = fused_norm.lamport_norm_kernel if lamport else fused_norm.one_shot_norm_kernel
    return fn, sig, consts, warps


#: The runtime arguments every flag kernel ends with (compile_one orders a signature by the
#: kernel's parameters).
FLAG_TAIL = {"stage_tab": "*i64", "flag_tab": "*i64", "flags": "*i64", "ctrl": "*i64",
             "err": "*i64", "rank": "i32", "tag": "i64", "timeout_us": "i32", "cap": "i64"}
#: The fused norms' arguments, and what the Lamport norm takes after them.
NORM_ARGS = {"tokens": "i32", "hidden": "i32", "eps": "fp32", "ctrl": "*i64", "err": "*i64",
             "rank": "i32", "timeout_us": "i32", "cap": "i64"}
LAMPORT_NORM_TAIL = {"lam_tab": "*i64", "tag_tab": "*i64", "tag": "i32"}


def _norm_sig(dt, xt):
    """The plain fused norm's rows: ``xt`` the int view of ``x`` (Lamport), ``dt`` the rest."""
    rows = {"residual": dt, "weight": dt, "out": dt, "res_out": dt}
    return {"x": xt, **rows, **NORM_ARGS}


KERNELS = {
    "one_shot_bf16": (all_reduce.one_shot_kernel,
                      {"x": "*bf16", "out": "*bf16", "n": "i32", **FLAG_TAIL},
                      {"WORLD": 2, "WORLD_POW2": 2, "NUM_BLOCKS": 32, "BLOCK": 1024}),
    "two_shot_bf16": (all_reduce.two_shot_kernel,
                      {"x": "*bf16", "out": "*bf16", "n": "i32", "shard": "i32",
                       "gather_tab": "*i64", **FLAG_TAIL},
                      {"WORLD": 2, "WORLD_POW2": 2, "NUM_BLOCKS": 32, "BLOCK": 1024}),
    "lamport_bf16": _lamport(32, 1024),
    # the launch of an 8 KiB bf16 all_reduce: 4096 elements over 128 blocks, 1 warp each
    "lamport_bf16_8k": _lamport(128, 256, 1),
    # an 8 MiB bf16 all_reduce: 16 chunks of 2048 elements per block, each received right
    # after the next one is pushed (LAG)
    "lamport_bf16_8m_pipe": _lamport(128, 2048, 8, LAG=1),
    # reduce_scatter of 8 MiB (4 MiB out), the Lamport rounds with SCATTER
    "lamport_rs_bf16_8m": _lamport(128, 2048, 8, fn=reduce_scatter.lamport_reduce_scatter_kernel,
                                   LAG=1),
    "broadcast_i32": (movement.broadcast_kernel,
                      {"x": "*i32", "n": "i32", "src": "i32", **FLAG_TAIL},
                      {"WORLD": 2, "WORLD_POW2": 2, "NUM_BLOCKS": 64, "BLOCK": 512}),
    "all_gather_i32": (movement.all_gather_kernel,
                       {"x": "*i32", "out": "*i32", "n": "i32", "part": "i32", **FLAG_TAIL},
                       {"WORLD": 2, "WORLD_POW2": 2, "NUM_BLOCKS": 64, "BLOCK": 512}),
    # LL movement (up to LL_MAX_BYTES): an 8 KiB all_gather / broadcast, 2048 words over 128
    # blocks
    "ll_all_gather_8k": (ll.ll_gather_kernel, LL_SIG,
                         dict(op=P.OP_ALL_GATHER, BCAST=0, **LL_8K), 1),
    "ll_broadcast_8k": (ll.ll_gather_kernel, LL_SIG, dict(op=P.OP_BROADCAST, BCAST=1, **LL_8K), 1),
    "reduce_scatter_bf16": (reduce_scatter.reduce_scatter_kernel,
                            {"x": "*bf16", "out": "*bf16", "m_out": "i32", **FLAG_TAIL},
                            {"WORLD": 2, "WORLD_POW2": 2, "NUM_BLOCKS": 64, "BLOCK": 1024}),
    "lamport_norm_bf16_h8192": (fused_norm.lamport_norm_kernel,
                                {**_norm_sig("*bf16", "*i16"), **LAMPORT_NORM_TAIL},
                                {"qscale": None, "SENTINEL": -32768, "FLOAT": "bf16", "WORLD": 2,
                                 "WORLD_POW2": 2, "NUM_BLOCKS": 128, "BLOCK": 8192,
                                 "STAGES": ALL_STAGES}, 16),
    "one_shot_norm_bf16_h8192": (fused_norm.one_shot_norm_kernel,
                                 {**_norm_sig("*bf16", "*i16"), **FLAG_TAIL},
                                 {"qscale": None, "FLOAT": "bf16", "WORLD": 2, "WORLD_POW2": 2,
                                  "NUM_BLOCKS": 128, "BLOCK": 8192, "STAGES": ALL_STAGES}, 16),
    "lamport_norm_fp32_w4": (fused_norm.lamport_norm_kernel,
                             {**_norm_sig("*fp32", "*i32"), **LAMPORT_NORM_TAIL},
                             {"qscale": None, "SENTINEL": -2147450880, "FLOAT": "fp32",
                              "WORLD": 4, "WORLD_POW2": 4, "NUM_BLOCKS": 128, "BLOCK": 8192,
                              "STAGES": ALL_STAGES}, 16),
    # the other fused norms: no residual (the first layer), FP8 static and per-group outputs
    "lamport_rmsnorm_bf16_h8192": _norm("lamport", fused_norm.PLAIN, residual=0, hidden=8192),
    "lamport_norm_fp8_bf16_h7168": _norm("lamport", fused_norm.FP8_STATIC),
    "lamport_norm_fp8g_bf16_h7168": _norm("lamport", fused_norm.FP8_GROUP),
    "one_shot_norm_fp8_bf16_h7168": _norm("one_shot", fused_norm.FP8_STATIC),
    "one_shot_norm_fp8g_bf16_h7168": _norm("one_shot", fused_norm.FP8_GROUP),
    "lamport_norm_fp8g_bf16_h16384": _norm("lamport", fused_norm.FP8_GROUP, hidden=16384,
                                           block=16384),
}


def compile_one(fn, sig, consts, num_warps=4, pdl=False, target=TARGET, extern_libs=None):
    """Compile ``fn`` for ``target`` (sm_90): ``sig`` the argument types, ``consts`` the
    constexprs (those left out keep their defaults); ``pdl``: as launched with LLCOMM_PDL=1;
    ``extern_libs``: device bitcode to link, ``((name, path),)`` (SHMEM's)."""
    import triton.language as tl
    cs = {k: (getattr(tl, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[v])
              if isinstance(v, str) else v) for k, v in consts.items()}
    if pdl and "PDL" in fn.arg_names:
        cs["PDL"] = 1
    full = {}
    for prm in fn.params:       # in the kernel's parameter order
        if prm.name in sig:
            full[prm.name] = sig[prm.name]
        elif prm.name in cs or (prm.is_constexpr and prm.default is not inspect.Parameter.empty):
            cs.setdefault(prm.name, prm.default)
            full[prm.name] = "constexpr"
    # pointer args and ints are assumed 16-divisible as Triton specialises them at run time
    attrs = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(full.items())
             if v.startswith("*") or k in ("n", "cap", "shard", "m_out", "part", "hidden")}
    constexprs = {(list(full).index(k),): v for k, v in cs.items()}
    src = ASTSource(fn, signature=full, constexprs=constexprs, attrs=attrs)
    with compiling_for(target):
        options = {"num_warps": num_warps, "launch_pdl": pdl, "enable_fp_fusion": FP_FUSION}
        if extern_libs:
            options["extern_libs"] = tuple(extern_libs)
        return triton.compile(src, target=target, options=options)


def ptxas_usage(ptx: str) -> str:
    """Registers and spills as ptxas reports them (Triton's bundled ptxas; 'regs ?' if none
    runs)."""
    import glob
    import subprocess
    import tempfile
    here = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for exe in sorted(glob.glob(os.path.join(here, "ptxas*")), reverse=True):
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(ptx)
            f.flush()
            p = subprocess.run([exe, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                               capture_output=True, text=True)
        if p.returncode == 0:
            regs = re.search(r"Used (\d+) registers", p.stderr)
            spill = re.search(r"(\d+) bytes spill stores", p.stderr)
            spilled = spill.group(1) if spill else "?"
            return f"regs {regs.group(1) if regs else '?'}  spill stores {spilled} B"
    return "regs ?"


def ptx_summary(name: str, ptx: str, dump: str | None) -> str:
    """Write ``ptx`` to ``dump/name.ptx`` when asked; return the counts every report prints:
    16-byte global loads/stores, 16-bit ones, system-scope atomics."""
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, name + ".ptx"), "w") as f:
            f.write(ptx)
    v4 = len(re.findall(r"(ld|st)\.global[^\n]*\.v4", ptx))
    narrow = len(re.findall(r"(ld|st)\.global(\.volatile)?\.(b16|u16)", ptx))
    sys_atom = len(re.findall(r"atom\.[^\n]*sys", ptx))
    gdc = len(re.findall(r"griddepcontrol", ptx))
    return f"v4 ld/st {v4:3d}  16-bit ld/st {narrow:3d}  sys atomics {sys_atom:2d}  gdc {gdc}"


def code_only(ptx: str) -> list[str]:
    """The PTX lines that are code: no DWARF sections, ``.loc``/``.file`` lines, comments or
    debug labels (their numbering moves when an inlined helper moves), and the entry's name
    (in its parameters' names too) written as ``KERNEL``."""
    ptx = re.split(r"^\s*\.section\s+\.debug", ptx, maxsplit=1, flags=re.M)[0]
    entry = re.search(r"\.entry\s+(\w+)", ptx)
    if entry:
        ptx = re.sub(rf"\b{entry.group(1)}(?=\b|_param_)", "KERNEL", ptx)
    keep = []
    for line in ptx.splitlines():
        s = line.strip()
        if not s or s.startswith(("//", ".loc", ".file", "$L__tmp")):
            continue
        keep.append(re.sub(r"\$L__tmp\d+", "", line))
    return keep


def same_as(folder: str | None, name: str, ptx: str) -> str:
    """``--same-as``: "  same" / "  DIFFERENT" against ``folder/name.ptx``, "  new" where the
    folder has no such kernel; "" without it."""
    if not folder:
        return ""
    path = os.path.join(folder, name + ".ptx")
    if not os.path.exists(path):
        return "  new"
    with open(path) as f:
        return "  same" if code_only(f.read()) == code_only(ptx) else "  DIFFERENT"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", default=None)
    ap.add_argument("--pdl", action="store_true", help="compile as LLCOMM_PDL=1 launches them")
    ap.add_argument("--same-as", default=None, help="a --dump folder to compare the code with")
    ap.add_argument("--target", choices=TARGETS, default="sm_90",
                    help="gfx942: AMDGCN, summarised by tools/amdgcn.py")
    args = ap.parse_args()
    for name, (fn, sig, consts, *warps) in KERNELS.items():
        if args.target != "sm_90":
            code = compile_one(fn, sig, consts, *warps, target=TARGETS[args.target]).asm["amdgcn"]
            print(f"{name:16s} {amdgcn.summary(name, code, args.dump)}")
            continue
        ptx = compile_one(fn, sig, consts, *warps, pdl=args.pdl).asm["ptx"]
        print(f"{name:16s} {ptx_summary(name, ptx, args.dump)}  {ptxas_usage(ptx)}"
              f"{same_as(args.same_as, name, ptx)}")


if __name__ == "__main__":
    main()

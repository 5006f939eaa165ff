"""Compile the two-level EP kernels with their SHMEM puts for sm_90 on any machine (no GPU).

    python tools/ptx_shmem.py [--dump DIR] [--hosts 2] [--ranks-per-host 8] [--tokens 128]
                              [--hidden 7168] [--experts 256] [--topk 8]

torch's SHMEM Triton layer defines its device functions only where torch sees a GPU
(``llcomm/runtime/shmem.py``), so this tool first tells torch it has one, then compiles
``hosts_dispatch_kernel`` (bf16 rows, FP8, FP8 with power-of-two scales) and
``hosts_combine_kernel`` with ``SHMEM`` = 1, linking NVSHMEM's device bitcode from the
``nvidia-nvshmem-cu13`` (or ``-cu12``) wheel, the bf16 dispatch and the combine with rank
masks and wait statistics (``MASKS`` = ``STATS`` = 1) too, and the kernels with ``SHMEM`` = 0
for comparison. Prints per kernel the NVSHMEM functions it calls (read from its TTGIR; in the
PTX they are inlined from the bitcode), the system-scope atomics (the signals inside a host and
the acquires after the waits), and the PTX size; exits 1 when a SHMEM kernel misses a put,
signal or quiet, or leaves one undefined in its PTX, or a SHMEM = 0 kernel calls any.
tests/test_shmem_compile.py runs it.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

#: NVSHMEM's device functions the SHMEM kernels must reach (put, signal, quiet).
MUST_CALL = ("nvshmemx_putmem_block", "nvshmemx_signal_op", "nvshmem_quiet")


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
             tag="i32", timeout_us="i32", nbytes="*i64", stats="*i64")
    c = dict(eo=f"*{dtype}", topk="*i64", wts="*fp32", n_tok="i32", out=f"*{dtype}",
             row_of="*i32", ntok_in="*i32", fwd_ids="*i32", fwd_ntok="*i32", tab="*i64",
             ctrl="*i64", err="*i64", rank="i32", tag="i32", timeout_us="i32", nbytes="*i64",
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dump", help="write each kernel's PTX into this folder")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=64)
    a = ap.parse_args(argv)
    tell_torch_it_has_triton()
    from ptx import compile_one     # tools/ptx.py, beside this file

    from llcomm.ep.hosts.peer import hosts_consts, make_layout
    from llcomm.ep.hosts.kernels import combine as HC
    from llcomm.ep.hosts.kernels import dispatch as HD
    from llcomm.runtime.shmem import device_functions_available, layer_name
    if not device_functions_available():
        print(f"ptx_shmem: torch's SHMEM Triton layer ({layer_name()}) defined no device "
              "functions")
        return 1
    libs = (("libnvshmem_device", device_bitcode()),)
    bad = 0
    print(f"# {layer_name()}, bitcode {os.path.basename(libs[0][1])}, {a.hosts} hosts x "
          f"{a.ranks_per_host} ranks, {a.tokens} tokens, hidden {a.hidden}, "
          f"top-{a.topk} of {a.experts}, {a.blocks} blocks")
    for fp8, name in ((0, "bf16"), (1, "fp8"), (2, "fp8_pow2")):
        lay = make_layout(a.tokens, a.hidden, a.hosts, a.ranks_per_host, 2, bool(fp8), a.blocks)
        dc, cc, warps = hosts_consts(lay, a.experts, a.topk, fp8)
        dsig, csig = signatures("bf16")
        cc = dict(cc)
        cc.pop("enable_fp_fusion")
        kernels = [(f"hosts_dispatch_{name}", HD.hosts_dispatch_kernel, dsig,
                    dict(dc, STAGES=HD.HOSTS_DISPATCH_ALL), (1, 0))]
        if fp8 == 0:
            kernels += [("hosts_combine", HC.hosts_combine_kernel, csig,
                         dict(cc, STAGES=HC.HOSTS_COMBINE_ALL), (1, 0)),
                        # rank masks and wait statistics: SHMEM only (the plain stores
                        # are the same code)
                        ("hosts_dispatch_bf16_masks", HD.hosts_dispatch_kernel, dsig,
                         dict(dc, STAGES=HD.HOSTS_DISPATCH_ALL, MASKS=1, STATS=1), (1,)),
                        ("hosts_combine_masks", HC.hosts_combine_kernel, csig,
                         dict(cc, STAGES=HC.HOSTS_COMBINE_ALL, MASKS=1, STATS=1), (1,))]
        for kname, fn, sig, consts, variants in kernels:
            for shmem in variants:
                k = compile_one(fn, sig, dict(consts, SHMEM=shmem), warps,
                                extern_libs=libs if shmem else None)
                ptx = k.asm["ptx"]
                s = summary(k)
                calls = [f for f in MUST_CALL if f in s["nvshmem"]]
                ok = (len(calls) == len(MUST_CALL) and not s["unlinked"]) if shmem \
                    else not s["nvshmem"]
                bad += not ok
                label = f"{kname}{'' if shmem else '_plain'}"
                print(f"{label:28s} {'ok ' if ok else 'BAD'} nvshmem: "
                      f"{', '.join(calls) or 'none'}; sys atomics {s['sys_atomics']}; "
                      f"PTX {s['bytes'] // 1024} KiB")
                if a.dump:
                    os.makedirs(a.dump, exist_ok=True)
                    with open(os.path.join(a.dump, label + ".ptx"), "w") as f:
                        f.write(ptx)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

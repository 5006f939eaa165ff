"""Compile the EP kernels for sm_90 on any machine (no GPU needed) and report what matters.

    python tools/ptx_ep.py [--dump DIR] [--same-as DIR] [--pdl] [--hidden 7168] [--experts 256]
                           [--ranks 2] [--tokens 128] [--target gfx942]

Compiles the dispatch (bf16 / fp32 rows, and FP8: ``ll_dispatch_kernel`` or
``flag_dispatch_kernel``, whichever ``EPBuffer`` runs for ``--tokens``, and the flag one for rank
masks) and ``combine_kernel`` exactly as ``EPBuffer`` launches them (same constexprs, all
stages, fp fusion off for combine; and the send and receive halves of
``return_recv_hook=True``, also with two sends in flight, ``*_x2_*``; ``*_stats``: the
wait-statistics variants, STATS=1; ``*_deep_ep``: the
dispatch writing DeepEP's layouts too, DEEP_EP=1 or 2, as ``llcomm.deep_ep`` launches it: bf16,
FP8 and UE8M0 scales, its receive half, and the flag dispatch's), and prints per kernel:
16-byte vector loads/stores
(ld/st.global.v4), narrow 16-bit ones (should be none on token rows), system-scope atomics
(signals and acquire polls), fused multiply-adds (should be none in combine: the documented
order rounds the product and the sum separately), registers and spills.
"""
import argparse
import os
import re
import sys

import triton
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llcomm.ep import kernels as K
from llcomm.ep.layout import DEFAULT_NUM_BLOCKS, ep_layout
from llcomm.ep.peer import dispatch_kernel, kernel_consts, ll_dispatch, ll_row_consts
from llcomm.runtime.launch import FP_FUSION
from llcomm.runtime.settings import EPSettings
from ptx import (TARGETS, code_only, compiling_for, ptx_summary,
                 ptxas_usage)                                      # beside this file)
import amdgcn

TARGET = TARGETS["sm_90"]
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


def compile_one(fn, sig, consts, num_warps, options=None, pdl=False, target=TARGET):
    """``pdl``: as launched with LLCOMM_PDL=1 (llcomm/runtime/launch.py sets PDL, not the caller);
    ``target``: tools/ptx.py's TARGETS."""
    if "PDL" in fn.arg_names:
        consts = {**consts, "PDL": int(pdl)}
    names = list(fn.arg_names)          # the kernel's parameter order
    full = {k: sig.get(k, "constexpr") for k in names}
    missing = [k for k in names if k not in sig and k not in consts]
    if missing:
        raise SystemExit(f"{fn.__name__}: no value for {missing}")
    # pointers are 16-byte aligned at run time (Triton specialises on it); so is every int
    # argument that is a multiple of 16, but none of ours is assumed to be
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(names)
             if full[k].startswith("*")}
    src = ASTSource(fn, signature=full, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    opts = {"num_warps": num_warps, "launch_pdl": pdl, "enable_fp_fusion": FP_FUSION}
    opts.update(options or {})      # as the launcher: a kernel's own option wins
    with compiling_for(target):
        return triton.compile(src, target=target, options=opts)


def kernels(hidden, experts, ranks, tokens, topk, dt, nb):
    """Every variant, by name. ``dispatch_*`` is the dispatch ``EPBuffer`` runs for a buffer of
    ``tokens`` tokens (``ll_dispatch_kernel`` up to LL_MAX_TOKENS, else ``flag_dispatch_kernel``;
    LLCOMM_EP_LL overrides); ``dispatch_*_masks`` is always the flag dispatch."""
    lay = ep_layout(tokens, hidden, ranks, experts, ITEMSIZE[dt], num_blocks=nb)
    ll = ll_dispatch(EPSettings.read(), tokens)
    d_consts, c_consts, warps = kernel_consts(lay, topk, ll=ll)
    m_consts = kernel_consts(lay, topk, ll=0)[0]
    # without wait statistics the stats argument is None, which Triton makes a constexpr; so
    # are DeepEP's outputs of the dispatch without DEEP_EP
    c_consts = dict(c_consts, stats=None)
    d_consts, m_consts = (dict(c, stats=None, **NO_DEEP_EP) for c in (d_consts, m_consts))
    ds_sig = {"stats": "*i64"}       # with them (STATS=1): a pointer
    DK = dispatch_kernel(ll)
    p = "*" + dt
    d_sig = {"x": p, "topk": "*i64", "n_tok": "i32", "recv_x": p, "recv_scales": "*fp32",
             "row_of": "*i32",
             "src_info": "*i32", "recv_count": "*i32", "ntok_out": "*i32", "tab": "*i64",
             "ctrl": "*i64", "err": "*i64", "rank": "i32", "tag": "i64", "timeout_us": "i32",
             "wts": "*fp32", "w_off": "i64"}
    c_sig = {"eo": p, "topk": "*i64", "wts": "*fp32", "n_tok": "i32", "out": p,
             "row_of": "*i32", "ntok_in": "*i32", "tab": "*i64", "ctrl": "*i64", "err": "*i64",
             "rank": "i32", "tag": "i64", "timeout_us": "i32", "w_off": "i64"}
    d8_sig = dict(d_sig, recv_x="*u8")
    fp8 = {} if hidden % 128 else {
        f"dispatch_{dt}_fp8": (DK, d8_sig,
                               dict(d_consts, STAGES=K.DISPATCH_ALL, FP8=1,
                                    **(ll_row_consts(lay, 1) if ll else {})), warps, None)}
    no_fusion = {"enable_fp_fusion": False}
    return {
        f"dispatch_{dt}": (DK, d_sig, dict(d_consts, STAGES=K.DISPATCH_ALL, FP8=0), warps, None),
        **fp8,
        f"combine_{dt}": (K.combine_kernel, c_sig, dict(c_consts, STAGES=K.COMBINE_ALL),
                          warps, no_fusion),
        # the two launches of return_recv_hook=True
        f"dispatch_{dt}_send": (DK, d_sig, dict(d_consts, STAGES=K.DISPATCH_SEND_HALF, FP8=0),
                                warps, None),
        f"dispatch_{dt}_recv": (DK, d_sig, dict(d_consts, STAGES=K.DISPATCH_RECV_HALF, FP8=0),
                                warps, None),
        f"combine_{dt}_send": (K.combine_kernel, c_sig,
                               dict(c_consts, STAGES=K.COMBINE_SEND_HALF), warps, no_fusion),
        f"combine_{dt}_recv": (K.combine_kernel, c_sig,
                               dict(c_consts, STAGES=K.COMBINE_RECV_HALF), warps, no_fusion),
        # dispatch(topk_weights=...): the weights travel with the dispatch
        f"dispatch_{dt}_carry": (DK, d_sig,
                                 dict(d_consts, STAGES=K.DISPATCH_ALL, FP8=0, CARRY=1), warps,
                                 None),
        f"combine_{dt}_carried": (K.combine_kernel, c_sig,
                                  dict(c_consts, STAGES=K.COMBINE_ALL, CARRIED=1), warps,
                                  no_fusion),
        # EPBuffer(enable_masks=True): the flag dispatch
        f"dispatch_{dt}_masks": (K.flag_dispatch_kernel, d_sig,
                                 dict(m_consts, STAGES=K.DISPATCH_ALL, FP8=0, MASKS=1), warps,
                                 None),
        f"combine_{dt}_masks": (K.combine_kernel, c_sig,
                                dict(c_consts, STAGES=K.COMBINE_ALL, MASKS=1), warps, no_fusion),
        # wait statistics (dispatch / combine(wait_stats=...)): the STATS variants
        f"dispatch_{dt}_stats": (DK, dict(d_sig, **ds_sig),
                                 dict(_no_stats(d_consts), STAGES=K.DISPATCH_ALL, FP8=0, STATS=1),
                                 warps, None),
        f"dispatch_{dt}_masks_stats": (K.flag_dispatch_kernel, dict(d_sig, **ds_sig),
                                       dict(_no_stats(m_consts), STAGES=K.DISPATCH_ALL, FP8=0,
                                            MASKS=1, STATS=1), warps, None),
        f"combine_{dt}_stats": (K.combine_kernel, dict(c_sig, **ds_sig),
                                dict(_no_stats(c_consts), STAGES=K.COMBINE_ALL, STATS=1), warps,
                                no_fusion),
        # LLCOMM_EP_PROFILE=1 (tools/ep_timeline.py)
        f"dispatch_{dt}_prof": (DK, d_sig, dict(d_consts, STAGES=K.DISPATCH_ALL, FP8=0,
                                                PROFILE=1), warps, None),
        f"combine_{dt}_prof": (K.combine_kernel, c_sig,
                               dict(c_consts, STAGES=K.COMBINE_ALL, PROFILE=1), warps, no_fusion),
        **deep_ep_kernels(DK, d_sig, d_consts, m_consts, lay, ll, dt, warps),
        **in_flight_kernels(DK, d_sig, c_sig, ll, dt, warps, tokens, hidden, ranks, experts,
                            topk, nb),
    }


def in_flight_kernels(DK, d_sig, c_sig, ll, dt, warps, tokens, hidden, ranks, experts, topk,
                      nb):
    """``EPBuffer(sends_in_flight=2)``: the halves of ``return_recv_hook=True`` over four sets,
    counting sends and receives apart (IN_FLIGHT = 2; ``*_x2_send`` / ``*_x2_recv``)."""
    lay = ep_layout(tokens, hidden, ranks, experts, ITEMSIZE[dt], num_blocks=nb, sets=4)
    d, c, _ = kernel_consts(lay, topk, ll=ll)
    d, c = dict(d, stats=None, FP8=0, **NO_DEEP_EP), dict(c, stats=None)
    no_fusion = {"enable_fp_fusion": False}
    return {
        f"dispatch_{dt}_x2_send": (DK, d_sig, dict(d, STAGES=K.DISPATCH_SEND_HALF), warps, None),
        f"dispatch_{dt}_x2_recv": (DK, d_sig, dict(d, STAGES=K.DISPATCH_RECV_HALF), warps, None),
        f"combine_{dt}_x2_send": (K.combine_kernel, c_sig, dict(c, STAGES=K.COMBINE_SEND_HALF),
                                warps, no_fusion),
        f"combine_{dt}_x2_recv": (K.combine_kernel, c_sig, dict(c, STAGES=K.COMBINE_RECV_HALF),
                                warps, no_fusion),
    }


#: The dispatch's DeepEP outputs when it writes none (DEEP_EP = 0).
NO_DEEP_EP = dict(deep_src=None, deep_layout=None, deep_stats=None, DEEP_EP=K.DEEP_EP_OFF)
#: Their types when it writes them; the scales go through recv_scales.
DEEP_EP_SIG = {"deep_src": "*i32", "deep_layout": "*i64", "deep_stats": "*i32"}


def deep_ep_kernels(DK, d_sig, d_consts, m_consts, lay, ll, dt, warps):
    """``dispatch(deep_ep=...)`` (``llcomm.deep_ep``): the dispatch writing DeepEP's layouts,
    with the statistics: bf16 rows, FP8 scales, UE8M0 scale words, the receive half of
    ``return_recv_hook=True``; and the flag dispatch (rank masks) with bf16 and UE8M0."""
    sig = dict(d_sig, **DEEP_EP_SIG)
    d_consts, m_consts = ({k: v for k, v in c.items() if k not in NO_DEEP_EP}
                          for c in (d_consts, m_consts))
    rows = {fp8: ll_row_consts(lay, fp8) if ll else {} for fp8 in range(3)}
    out = {}
    for name, fp8, mode in (("", 0, K.DEEP_EP_FP32), ("_fp8", 1, K.DEEP_EP_FP32),
                            ("_ue8m0", 2, K.DEEP_EP_UE8M0)):
        if fp8 and lay.hidden % (128 * (4 if mode == K.DEEP_EP_UE8M0 else 1)):
            continue
        s = dict(sig, recv_x="*u8", recv_scales="*i32" if mode == K.DEEP_EP_UE8M0 else "*fp32") \
            if fp8 else sig
        c = dict(d_consts, STAGES=K.DISPATCH_ALL, FP8=fp8, DEEP_EP=mode, **rows[fp8])
        out[f"dispatch_{dt}{name}_deep_ep"] = (DK, s, c, warps, None)
        if not fp8:
            out[f"dispatch_{dt}_deep_ep_recv"] = (DK, s, dict(c, STAGES=K.DISPATCH_RECV_HALF),
                                                  warps, None)
        if fp8 != 1:
            out[f"dispatch_{dt}_masks{name}_deep_ep"] = (
                K.flag_dispatch_kernel, s, dict(m_consts, STAGES=K.DISPATCH_ALL, FP8=fp8,
                                                MASKS=1, DEEP_EP=mode), warps, None)
    return out


def _no_stats(consts):
    return {k: v for k, v in consts.items() if k != "stats"}


def same_as(folder, name, ptx):
    """``--same-as``: "  same" / "  DIFFERENT" against ``folder/name.ptx`` ("  new" where the
    folder has no such kernel, "" without a folder), the code compared as tools/ptx.py compares
    it, with either dispatch kernel's name read as ``dispatch_kernel`` (the one kernel both came
    from: dumps made before the split compare)."""
    if not folder:
        return ""

    def code(text):
        return [re.sub(r"\b(ll_|flag_)dispatch_kernel", "dispatch_kernel", line)
                for line in code_only(text)]

    path = os.path.join(folder, name + ".ptx")
    if not os.path.exists(path):
        return "  new"          # a variant the folder's dump did not have
    with open(path) as f:
        return "  same" if code(f.read()) == code(ptx) else "  DIFFERENT"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", default=None)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=DEFAULT_NUM_BLOCKS)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--warps", type=int, default=None, help="override EPBuffer's num_warps")
    ap.add_argument("--pdl", action="store_true", help="compile as LLCOMM_PDL=1 launches them")
    ap.add_argument("--same-as", default=None, help="a --dump folder to compare the code with "
                    "(tools/ptx.py --same-as)")
    ap.add_argument("--target", choices=TARGETS, default="sm_90",
                    help="gfx942: AMDGCN, summarised by tools/amdgcn.py")
    args = ap.parse_args()
    every = {}
    for dt in args.dtypes.split(","):
        every.update(kernels(args.hidden, args.experts, args.ranks, args.tokens, args.topk, dt,
                             args.blocks))
    for name, (fn, sig, consts, warps, opts) in every.items():
        warps = args.warps or warps
        if args.target != "sm_90":
            code = compile_one(fn, sig, consts, warps, opts,
                               target=TARGETS[args.target]).asm["amdgcn"]
            print(f"{name:18s} warps {warps:2d}  {amdgcn.summary(name, code, args.dump)}")
            continue
        ptx = compile_one(fn, sig, consts, warps, opts, args.pdl).asm["ptx"]
        fma = len(re.findall(r"\bfma\.rn\.f32", ptx))
        print(f"{name:18s} warps {warps:2d}  {ptx_summary(name, ptx, args.dump)}  "
              f"fma.f32 {fma:3d}  {ptxas_usage(ptx)}{same_as(args.same_as, name, ptx)}")


if __name__ == "__main__":
    main()

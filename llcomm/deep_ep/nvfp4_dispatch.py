"""``Buffer.low_latency_dispatch(..., use_nvfp4=True, x_global_scale=...)``: DeepEP's NVFP4
dispatch (docs/deep_ep.md, "NVFP4 dispatch").

The rows travel as they are (x's dtype, bf16 for engines) through the same ``EPBuffer``
dispatch as a bf16 call, and the receiver quantises them after the receive (``nvfp4.py``):
one quantiser applied to each row, so the codes and scales are exactly those a sender-side
quantiser of the same recipe would produce. The wire carries 4x NVFP4's bytes (bf16's 2 bytes
an element against NVFP4's 0.5 plus one e4m3 scale per 16); a packed wire format is a later
step. The quantisation runs as torch ops on the current stream after the receive (in ``hook()``
with ``return_recv_hook``), on every backend.
"""
from __future__ import annotations

import torch

from ..runtime import validate as V
from . import nvfp4
from .checks import check_bools, refuse
from .event import after, on_call_stream


def check_global_scale(pr: V.Problems, x_global_scale, device) -> None:
    """``x_global_scale``: a float32 tensor on ``device`` (not checked while None) with at
    least one element, of which the first is the global scale: DeepEP documents ``dim() ==
    0`` and its kernel reads the first element, and vLLM passes its per-expert ``a1_gscale``
    (equal values) there."""
    name = "x_global_scale"
    if x_global_scale is None:
        pr.add(f"use_nvfp4=True needs {name}: a float32 tensor of one element, the global "
               "scale of the NVFP4 block scales (448 * 6 / amax of a calibration, as engines "
               "pass it)")
    elif not isinstance(x_global_scale, torch.Tensor):
        pr.add(f"{name} must be a torch.Tensor, got {type(x_global_scale).__name__}",
               type_error=True)
    elif x_global_scale.dtype != torch.float32:
        pr.add(f"{name} has dtype {x_global_scale.dtype}; expected torch.float32",
               type_error=True)
    elif x_global_scale.numel() == 0:
        pr.add(f"{name} is empty; expected one element (dim() == 0, as DeepEP's)")
    elif device is not None and x_global_scale.device != device:
        pr.add(f"{name} is on {x_global_scale.device}; expected {device}")


def dispatch(buf, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, stats, cost,
             x_global_scale, use_fp8, round_scale, use_ue8m0, use_nvfp4, use_ue8m0_for_sf,
             async_finish, return_recv_hook) -> tuple:
    """``buf.low_latency_dispatch`` with ``use_nvfp4`` or ``use_ue8m0_for_sf`` set (not False):
    checks the NVFP4 arguments, runs the bf16 dispatch, quantises after its receive. Returns
    DeepEP's 5-tuple with ``recv_x = (values, scales)`` (``nvfp4.py``, "Layouts")."""
    fn = "low_latency_dispatch"
    buf._check_open(fn)
    refuse(fn, {"use_ue8m0_for_sf=True": "NVFP4 block scales are float8_e4m3fn here; the UE8M0 "
                "variant of DeepEP's hybrid-ep branch is not implemented"}
           if use_ue8m0_for_sf is True else {})
    pr = V.Problems(f"deep_ep.Buffer.{fn}")
    check_bools(pr, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                use_nvfp4=use_nvfp4, use_ue8m0_for_sf=use_ue8m0_for_sf,
                async_finish=async_finish, return_recv_hook=return_recv_hook)
    if use_nvfp4 is not True:       # use_ue8m0_for_sf=False given with use_nvfp4=False
        pr.raise_if_any()
        return buf.low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, stats, cost,
            use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
    if use_fp8 is True:
        pr.add("use_nvfp4=True and use_fp8=True: one format per dispatch, as in DeepEP; pass "
               "use_fp8=False (its default is True)")
    if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] % nvfp4.BLOCK:
        pr.add(f"use_nvfp4=True needs hidden to be a multiple of {nvfp4.BLOCK} (one e4m3 "
               f"scale per {nvfp4.BLOCK} elements); x has hidden={x.shape[1]}")
    ep = buf.ep_buffer
    device = ep.device if ep is not None else (x.device if isinstance(x, torch.Tensor) else None)
    check_global_scale(pr, x_global_scale, device)
    pr.raise_if_any()
    # The bf16 dispatch checks the rest before it launches anything (and may create the
    # EPBuffer, a collective, as any first call does).
    recv_x, recv_count, handle, _, inner_hook = buf.low_latency_dispatch(
        x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, stats, cost,
        use_fp8=False, async_finish=False, return_recv_hook=return_recv_hook)
    L, R, H = recv_x.shape
    values, scales = nvfp4.outputs(L, R, H, recv_x.device)
    gs = x_global_scale.reshape(-1)[0]      # its first element, as DeepEP's kernel reads it

    def quantise():
        nvfp4.fill_outputs(recv_x, gs, values, scales)

    hook = None
    if return_recv_hook:
        # as DeepEP's, the returned tensors are unspecified until hook() has run
        def hook():
            inner_hook()
            quantise()
        hook.__doc__ = inner_hook.__doc__
        hook = on_call_stream(recv_x.device, hook)      # the quantiser too, as the receive
    else:
        quantise()
    event = after(recv_x.device, async_finish, (x, topk_idx, x_global_scale, recv_x, values,
                                                scales, recv_count, stats, cost))
    return (values, scales), recv_count, handle, event, hook

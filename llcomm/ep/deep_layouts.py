"""``DeepEPOutputs``: where ``EPBuffer.dispatch(deep_ep=...)`` writes DeepEP's layouts of its
outputs, on the peer backend, from the dispatch's own receive stage (``llcomm.deep_ep`` passes
them; ``llcomm/deep_ep/convert.py`` defines the layouts, ``kernels/deep_ep_layout.py`` says
which block writes what)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..runtime import validate as V
from ..runtime.fp8_format import FP8_BLOCK

#: Scales per UE8M0 word (DeepEP's ``use_ue8m0``).
UE8M0_PER_WORD = 4


class DeepEPOutputs(NamedTuple):
    """DeepEP's tensors of one dispatch, contiguous, on the buffer's device.

    Attributes:
        src_info: ``[L, W * T]`` int32: the source token of each filled row.
        layout_range: ``[L, W]`` int64: ``(begin << 32) | count`` of the rows from each rank.
        scales: FP8 dispatches: the storage of DeepEP's scales, ``[L, H / 128, W * T]``
            float32, or ``[L, H / 512, W * T]`` int32 UE8M0 words (``round_scale=True``
            needed), written in place of the contiguous scales (the dispatch returns this
            tensor as its second); None without FP8.
        stats: None, or ``[L]`` int32 to which ``recv_count`` is added.

    Rows past ``recv_count[e]`` of ``src_info`` and the scales are not written."""
    src_info: torch.Tensor
    layout_range: torch.Tensor
    scales: torch.Tensor | None = None
    stats: torch.Tensor | None = None

    @property
    def ue8m0(self) -> bool:
        return self.scales is not None and self.scales.dtype == torch.int32


def check_deep_ep(buf, pr: V.Problems, d, fp8: bool, round_scale, out) -> None:
    """``dispatch(deep_ep=d)``: a ``DeepEPOutputs`` of the buffer's shapes (scales exactly with
    FP8), without ``out``'s scales; peer backend only (NotImplementedError on the reference
    one, whose callers convert with torch ops)."""
    if d is None:
        return
    if not isinstance(d, DeepEPOutputs):
        pr.add(f"deep_ep must be a DeepEPOutputs, got {type(d).__name__}", type_error=True)
        return
    L, R, W = buf.num_local_experts, buf.num_ranks * buf.max_tokens, buf.num_ranks
    want = [("deep_ep.src_info", d.src_info, (L, R), torch.int32),
            ("deep_ep.layout_range", d.layout_range, (L, W), torch.int64)]
    if d.stats is not None:
        want.append(("deep_ep.stats", d.stats, (L,), torch.int32))
    if fp8 and d.scales is not None:
        ue8m0 = d.scales.dtype == torch.int32
        groups = buf.hidden // (FP8_BLOCK * (UE8M0_PER_WORD if ue8m0 else 1))
        if ue8m0 and (round_scale is not True or buf.hidden % (FP8_BLOCK * UE8M0_PER_WORD)):
            pr.add("deep_ep.scales as int32 UE8M0 words needs round_scale=True and hidden a "
                   f"multiple of {FP8_BLOCK * UE8M0_PER_WORD}")
        want.append(("deep_ep.scales", d.scales, (L, groups, R),
                     torch.int32 if ue8m0 else torch.float32))
    elif fp8 or d.scales is not None:
        pr.add("deep_ep.scales must be given exactly for an FP8 dispatch (use_fp8=True)")
    if fp8 and out is not None:
        pr.add("out and deep_ep together with use_fp8=True: the scales go to deep_ep.scales; "
               "pass one of them")
    for name, t, shape, dt in want:
        if V.check_tensor(pr, name, t, buf.device, dtypes=(dt,), written=True) \
                and tuple(t.shape) != shape:
            pr.add(f"{name} has shape {tuple(t.shape)}; expected {shape}")
    if buf.backend != "peer" and not pr.items:
        raise NotImplementedError(
            "llcomm.EPBuffer.dispatch: deep_ep is peer-backend only (the dispatch's receive "
            "kernel writes DeepEP's layouts); on the reference backend convert the outputs with "
            "llcomm.deep_ep.convert's torch ops; pass deep_ep=None")

"""What a failed EP call leaves in its outputs, under ``TRITON_INTERPRET=1``.

One virtual rank of two launches its dispatch (``flag_dispatch_kernel`` or
``ll_dispatch_kernel``, all stages, plain or FP8) or its combine (all stages); its peer never
launches, so its waits run out (``_interp.run_ranks`` gives the interpreter the GPU clock) with
a short bound. Its outputs held PREFILL (a valid-looking value) and a valid-looking count
before; afterwards the error word is a timeout and every output is poisoned: ``recv_count``
-1 for every local expert (protocol.POISON_COUNT), ``recv_x`` / ``recv_scales`` / the
combine's ``out`` every bit set (protocol.POISON_BITS: NaN in every float dtype, e4m3 0xFF).
"""
from __future__ import annotations

import pytest

from _interp import run_in_interpreter

#: Bound of the waits that run out here (us): short, the interpreter polls slowly.
SHORT_US = 20_000
#: What the outputs hold before the failing call: valid-looking, never the poison.
PREFILL = 1.5
PREFILL_COUNT = 3
W, E, T, H, TOPK, NB = 2, 4, 4, 128, 2, 4
#: Hidden size of the DeepEP-layout cases (UE8M0 packs four 128-channel scales per word).
DEEP_H = 512
#: Words past DeepEP's scales storage that a failed dispatch must not touch.
GUARD_WORDS = 64


def _all_bits_set(t) -> bool:
    import torch
    from llcomm.runtime import protocol as P
    view = {1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return bool((t.contiguous().view(view) == P.POISON_BITS).all())


def simulate_failed(op, ll, fp8, deep=0):
    """Rank 0 runs ``op`` ("dispatch" / "combine") alone, with the LL dispatch (``ll``) and
    FP8 mode ``fp8``; ``deep``: the dispatch writes DeepEP's layouts too (its DEEP_EP mode:
    1 fp32 scales, 2 UE8M0 words, at hidden 512), into storage followed by a guard that must
    keep PREFILL. Returns [error type name or None, {output: poisoned?}]."""
    import torch
    from _interp import run_ranks
    from llcomm.ep import kernels as K
    from llcomm.ep.layout import ARM_BYTE, ep_layout
    from llcomm.ep.peer import dispatch_kernel, kernel_consts, ll_row_consts
    from llcomm.runtime import protocol as P

    H = DEEP_H if deep else globals()["H"]
    dtype, L, n_tok = torch.bfloat16, E // W, T
    lay = ep_layout(T, H, W, E, 2, num_blocks=NB)
    regions = [torch.zeros(lay.total_bytes, dtype=torch.uint8) for _ in range(W)]
    for region in regions:
        for a, b in lay.armed_ranges():
            region[a:b] = ARM_BYTE
    tab = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64)
    host = torch.zeros(2, dtype=torch.int64)
    err = torch.tensor([0, host.data_ptr(), host.data_ptr() + 8], dtype=torch.int64)
    ctrl = torch.zeros(2, NB, dtype=torch.int64)
    dc, cc, _ = kernel_consts(lay, TOPK, ll=ll, tile_tokens=4, small_tile_tokens=2)
    if ll:
        dc = dict(dc, **ll_row_consts(lay, fp8))
    x = torch.randn(n_tok, H).to(dtype)
    topk = torch.tensor([[t % E, (t + 1) % E] for t in range(n_tok)], dtype=torch.int64)
    wts = torch.full((n_tok, TOPK), 0.5)
    if op == "dispatch":
        if fp8:     # e4m3 1.5 is 0x3C
            recv = torch.full((L, W * T, H), 0x3C, dtype=torch.uint8)
        else:
            recv = torch.full((L, W * T, H), PREFILL, dtype=dtype)
        scales = torch.full((L, W * T, max(H // 128, 1)), PREFILL)
        row_of = torch.full((W, T, TOPK), -1, dtype=torch.int32)
        src = torch.zeros((L, W * T), dtype=torch.int32)
        cnt = torch.full((L,), PREFILL_COUNT, dtype=torch.int32)
        ntok = torch.full((W,), n_tok, dtype=torch.int32)

        deep_out, guard = (None, None, None), None
        if deep:        # DeepEP's scales storage ([L, G, R] fp32 or [L, G / 4, R] int32), a guard
            words = L * (H // 128 // (4 if deep == 2 else 1)) * W * T
            whole = torch.full((words + GUARD_WORDS,), PREFILL)
            scales, guard = whole[:words], whole[words:]
            layout = torch.full((L, W), PREFILL_COUNT, dtype=torch.int64)
            deep_out = (torch.zeros((L, W * T), dtype=torch.int32), layout, None)

        def launch():
            dispatch_kernel(ll)[(NB,)](
                x, topk, n_tok, recv, scales, row_of, src, cnt, ntok, tab, ctrl[0], err, 0,
                0, SHORT_US, wts, 0, None, *deep_out,
                **dict(dc, STAGES=K.DISPATCH_ALL, FP8=fp8, DEEP_EP=deep))
        outputs = {"recv_count": cnt, "recv_x": recv}
        if fp8:
            outputs["recv_scales"] = scales
        if deep:
            outputs["layout_range"] = deep_out[1]
    else:
        eo = torch.randn(L, W * T, H).to(dtype)
        out = torch.full((n_tok, H), PREFILL, dtype=dtype)
        row_of = torch.full((W, T, TOPK), -1, dtype=torch.int32)
        ntok = torch.full((W,), n_tok, dtype=torch.int32)

        def launch():
            K.combine_kernel[(NB,)](
                eo, topk, wts, n_tok, out, row_of, ntok, tab, ctrl[1], err, 0, 0, SHORT_US, 0,
                None, **dict(cc, STAGES=K.COMBINE_ALL))
        outputs = {"out": out}
    run_ranks([launch])
    e = P.decode_error(int(host[0]), 0)
    poisoned = {k: (bool((v == P.POISON_COUNT).all()) if k in ("recv_count", "layout_range")
                    else _all_bits_set(v)) for k, v in outputs.items()}
    if op == "dispatch" and guard is not None:
        poisoned["guard kept"] = bool((guard == PREFILL).all())
    return [None if e is None else type(e).__name__, poisoned]


@pytest.mark.parametrize("ll,fp8", [(0, 0), (1, 0), (0, 1), (1, 1)],
                         ids=["flag", "ll", "flag-fp8", "ll-fp8"])
def test_failed_dispatch_poisons_its_outputs(ll, fp8):
    err, poisoned = run_in_interpreter("test_ep_failed_outputs_cpu", "simulate_failed",
                                       "dispatch", ll, fp8)
    assert err == "CommTimeoutError", err
    assert poisoned and all(poisoned.values()), poisoned


@pytest.mark.parametrize("ll,fp8,deep", [(1, 1, 1), (1, 2, 2), (0, 2, 2)],
                         ids=["ll-fp32-scales", "ll-ue8m0", "flag-ue8m0"])
def test_failed_dispatch_poisons_deep_ep_layouts(ll, fp8, deep):
    """With DeepEP's layouts (``deep_ep.Buffer``): ``layout_range`` -1 as ``recv_count``, the
    scales in DeepEP's storage poisoned, and nothing past that storage written (UE8M0 words are
    a quarter of EPBuffer's scales)."""
    err, poisoned = run_in_interpreter("test_ep_failed_outputs_cpu", "simulate_failed",
                                       "dispatch", ll, fp8, deep)
    assert err == "CommTimeoutError", err
    assert set(poisoned) == {"recv_count", "recv_x", "recv_scales", "layout_range",
                             "guard kept"}, poisoned
    assert all(poisoned.values()), poisoned


def test_failed_combine_poisons_its_output():
    err, poisoned = run_in_interpreter("test_ep_failed_outputs_cpu", "simulate_failed",
                                       "combine", 0, 0)
    assert err == "CommTimeoutError", err
    assert poisoned == {"out": True}, poisoned

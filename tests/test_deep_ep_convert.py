"""The dispatch kernels' DeepEP layouts (``DEEP_EP``, ``EPBuffer.dispatch(deep_ep=...)``) under
``TRITON_INTERPRET=1`` against the torch conversions of llcomm/deep_ep/convert.py applied to the
same kernels' ``EPBuffer`` outputs, bitwise.

Virtual ranks as in tests/test_ep_kernels_cpu.py: a CPU region per rank, each stage run for
every rank in turn. Each case dispatches the same inputs twice: once as ``EPBuffer`` does
(DEEP_EP = 0), whose outputs go through convert.py's ops (the oracle), then with DeepEP's
outputs poisoned and DEEP_EP set, which must give the oracle's ``layout_range`` and stats
everywhere, its ``src_info`` and scales on the filled rows, the poison past them (only filled
rows are written), and ``EPBuffer``'s own outputs unchanged. Both dispatch kernels, bf16, FP8,
FP8 with power-of-two scales, UE8M0 words; with stats or not; sent as one launch's stages do
or as the send half of ``return_recv_hook``, after which DeepEP's outputs must still be
untouched (the receive half writes them). One more case: an LL receive that misses its
counts (a failed wait) writes -1 over ``layout_range`` and leaves the stats alone.
"""
from __future__ import annotations

import os

from _interp import run_in_interpreter

POISON = -0x5A5A5A5B
#: (name, FP8 mode, UE8M0 words)
MODES = (("bf16", 0, False), ("fp8", 1, False), ("fp8_round", 2, False), ("ue8m0", 2, True))
#: (W, E, T, H, topk, NB, modes, splits): every mode at H = 512 (one UE8M0 word per row); three
#: ranks and two UE8M0 words per row in one mode (the interpreter is slow).
SHAPES = ((2, 8, 6, 512, 3, 3, MODES, (False, True)),
          (3, 6, 5, 1024, 2, 2, MODES[3:], (True,)))


def _world(W, E, T, H, topk, NB, ll):
    import torch

    from llcomm.ep.layout import ARM_BYTE, ep_layout
    from llcomm.ep.peer import kernel_consts
    lay = ep_layout(T, H, W, E, 2, num_blocks=NB)
    regions = [torch.zeros(lay.total_bytes, dtype=torch.uint8) for _ in range(W)]
    for region in regions:
        for a, b in lay.armed_ranges():
            region[a:b] = ARM_BYTE
    host = [torch.zeros(2, dtype=torch.int64) for _ in range(W)]
    return dict(
        lay=lay, regions=regions, host=host, ll=ll,
        tab=torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64),
        err=[torch.tensor([0, h.data_ptr(), h.data_ptr() + 8], dtype=torch.int64)
             for h in host],
        ctrl=[torch.zeros(NB, dtype=torch.int64) for _ in range(W)],
        consts=kernel_consts(lay, topk, ll=ll, tile_tokens=4, small_tile_tokens=2)[0])


def _dispatch(w, xs, topks, fp8, stages, deep=None, ue8m0=False, skip_send=()):
    """One dispatch on every rank, stage by stage; returns each rank's (recv_x, scales,
    src_info, recv_count). ``deep``: per rank (src, layout, scales storage, stats), DEEP_EP on;
    after the first stage it is checked untouched by the caller (``stages[0]`` is a send).
    ``skip_send``: ranks whose send is left out (their words never arrive)."""
    import torch

    from llcomm.ep import kernels as K
    from llcomm.ep.peer import dispatch_kernel, ll_row_consts
    lay = w["lay"]
    W, L, R, H = lay.num_ranks, lay.num_experts // lay.num_ranks, lay.num_ranks * lay.max_tokens, \
        lay.hidden
    ll = w["ll"]
    consts = dict(w["consts"], FP8=fp8, **(ll_row_consts(lay, fp8) if ll else {}))
    outs = []
    for r in range(W):
        recv = torch.full((L, R, H), 0x7F, dtype=torch.uint8) if fp8 else \
            torch.full((L, R, H), float("nan"), dtype=torch.bfloat16)
        scales = torch.full((L, R, max(H // 128, 1)), float("nan"))
        outs.append((recv, scales, torch.full((L, R), -7, dtype=torch.int32),
                     torch.full((L,), -7, dtype=torch.int32),
                     torch.full((W, lay.max_tokens, topks[r].shape[1]), -7, dtype=torch.int32),
                     torch.full((W,), -7, dtype=torch.int32)))
    snapshots = []
    for stage in stages:
        for r in range(W):
            if stage & K.D_SEND and r in skip_send:
                continue
            recv, scales, src, cnt, row_of, ntok = outs[r]
            extra = {}
            tail = (None, None, None)
            if deep is not None:
                d_src, d_lay, d_sc, d_st = deep[r]
                if fp8:
                    scales = d_sc
                tail = (d_src, d_lay, d_st)
                extra = dict(DEEP_EP=K.DEEP_EP_UE8M0 if ue8m0 else K.DEEP_EP_FP32)
            dispatch_kernel(ll)[(lay.num_blocks,)](
                xs[r], topks[r], xs[r].shape[0], recv, scales, row_of, src, cnt, ntok,
                w["tab"], w["ctrl"][r], w["err"][r], r, 0, 0, topks[r], 0, None, *tail,
                **dict(consts, STAGES=stage, **extra))
        if deep is not None:
            snapshots.append([[t.clone() if t is not None else None for t in d] for d in deep])
    return [o[:4] for o in outs], snapshots


def _oracle(ep_out, T, W, ue8m0, fp8, stats0):
    """convert.py's torch ops on one rank's EPBuffer outputs."""
    import torch

    from llcomm.deep_ep import convert as C
    recv, scales, src, cnt = ep_out
    L, R = src.shape
    want_src = torch.empty(L, R, dtype=torch.int32)
    C.source_token(src, T, want_src)
    want_lay = torch.empty(L, W, dtype=torch.int64)
    C.layout_range(src, cnt, C.layout_aux(L, R, T, W, src.device), want_lay)
    want_sc = None
    if fp8:
        want_sc = C.scales_storage(L, R, scales.shape[2] * C.FP8_BLOCK, ue8m0, src.device)
        C.fill_scales(want_sc, scales, ue8m0)
        want_sc = want_sc.transpose(1, 2)           # its storage, [L, groups, R]
    return want_src, want_lay, want_sc, stats0 + cnt


def _poisoned(L, R, W, H, fp8, ue8m0, with_stats, gen):
    import torch
    groups = H // (512 if ue8m0 else 128)
    sc = None
    if fp8:
        sc = torch.full((L, groups, R), POISON, dtype=torch.int32)
        if not ue8m0:
            sc = sc.view(torch.float32)
    stats = torch.randint(0, 1000, (L,), generator=gen, dtype=torch.int32) if with_stats else None
    return (torch.full((L, R), POISON, dtype=torch.int32),
            torch.full((L, W), POISON, dtype=torch.int64), sc, stats)


def compare(seed: int) -> tuple[list[str], int]:
    """Every shape, kernel, mode, stats or not, whole or split: the mismatches, described, and
    the number of cases run."""
    import torch
    import triton  # noqa: F401  (TRITON_INTERPRET is set by the caller)

    from llcomm.ep import kernels as K
    from test_ep_oracle import make_case
    gen = torch.Generator().manual_seed(seed)
    bad, ran = [], 0
    for W, E, T, H, topk, NB, modes, splits in SHAPES:
        L, R = E // W, W * T
        for ll in (0, 1):
            w = _world(W, E, T, H, topk, NB, ll)
            for i, (mode, fp8, ue8m0) in enumerate(modes):
                for split in splits:
                    with_stats = (i + split) % 2 == 0
                    tag = f"[W={W} H={H} {'ll' if ll else 'flag'} {mode} split={split} " \
                          f"stats={with_stats}]"
                    xs, topks, _ = make_case(W, E, T, H, topk, seed + ran, "random")
                    send = K.DISPATCH_SEND_HALF if split else K.D_SEND
                    ep_out, _ = _dispatch(w, xs, topks, fp8, (send, K.D_RECV))
                    deep = [_poisoned(L, R, W, H, fp8, ue8m0, with_stats, gen) for _ in range(W)]
                    start = [[t.clone() if t is not None else None for t in d] for d in deep]
                    got, snaps = _dispatch(w, xs, topks, fp8, (send, K.D_RECV), deep, ue8m0)
                    ran += 1
                    for r in range(W):
                        bad += _rank_fails(f"{tag} rank {r}", ep_out[r], got[r], deep[r],
                                           start[r], snaps[0][r], T, W, ue8m0, fp8, with_stats)
    bad += _failed_receive(seed)
    return bad, ran


def _rank_fails(tag, ep_out, got, deep, start, after_send, T, W, ue8m0, fp8, with_stats):
    import torch
    out = []
    for name, a, b in zip(("recv_x", "scales", "src_info", "recv_count"), ep_out, got):
        if name == "scales" and fp8:
            continue                # DeepEP's storage takes them
        if name == "recv_x":
            n = ep_out[3]
            same = all(torch.equal(a[e, :int(n[e])].view(torch.uint8),
                                   b[e, :int(n[e])].view(torch.uint8)) for e in range(len(n)))
        elif name == "src_info":
            n = ep_out[3]
            same = all(torch.equal(a[e, :int(n[e])], b[e, :int(n[e])]) for e in range(len(n)))
        else:
            same = torch.equal(a, b) or name == "scales"
        if not same:
            out.append(f"{tag}: EPBuffer's {name} changed with DEEP_EP")
    for a, b in zip(start, after_send):
        if a is not None and not torch.equal(a.view(torch.int32) if a.dtype == torch.float32
                                             else a,
                                             b.view(torch.int32) if b.dtype == torch.float32
                                             else b):
            out.append(f"{tag}: the send stage wrote DeepEP's outputs")
            break
    want_src, want_lay, want_sc, want_stats = _oracle(ep_out, T, W, ue8m0, fp8,
                                                      start[3] if with_stats else 0)
    d_src, d_lay, d_sc, d_st = deep
    if not torch.equal(d_lay, want_lay):
        out.append(f"{tag}: layout_range {d_lay.tolist()} != {want_lay.tolist()}")
    if with_stats and not torch.equal(d_st, want_stats):
        out.append(f"{tag}: stats {d_st.tolist()} != {want_stats.tolist()}")
    cnt = ep_out[3]
    for e in range(len(cnt)):
        n = int(cnt[e])
        pairs = [("src_info", d_src[e], want_src[e])]
        if fp8:         # [groups, R] storage: row j is column j
            pairs.append(("scales", d_sc[e].view(torch.int32).t(),
                          want_sc[e].contiguous().view(torch.int32).t()))
        for what, g, wnt in pairs:
            if not torch.equal(g[:n], wnt[:n]):
                out.append(f"{tag}: expert {e} {what}: filled rows differ")
            if not (g[n:] == POISON).all():
                out.append(f"{tag}: expert {e} {what}: rows past the count {n} written")
    return out


def _failed_receive(seed: int) -> list[str]:
    """The LL dispatch with rank 1's send left out: rank 0's receive misses its counts (read
    once here, so a failed wait) and must write -1 over layout_range, and no stats."""
    import torch

    from llcomm.ep import kernels as K
    from test_ep_oracle import make_case
    W, E, T, H, topk, NB = SHAPES[0][:6]
    w = _world(W, E, T, H, topk, NB, 1)
    xs, topks, _ = make_case(W, E, T, H, topk, seed, "random")
    deep = [_poisoned(E // W, W * T, W, H, 0, False, True, torch.Generator().manual_seed(seed))
            for _ in range(W)]
    stats0 = deep[0][3].clone()
    _dispatch(w, xs, topks, 0, (K.D_SEND, K.D_RECV), deep, skip_send=(1,))
    out = []
    if not int(w["err"][0][0]):
        out.append("failed receive: no error reported")
    if not (deep[0][1] == -1).all():
        out.append(f"failed receive: layout_range {deep[0][1].tolist()}, expected all -1")
    if not torch.equal(deep[0][3], stats0):
        out.append("failed receive: stats changed")
    return out


def test_dispatch_deep_ep_layouts_match_torch_conversions():
    seed = int.from_bytes(os.urandom(4), "little")
    bad, ran = run_in_interpreter("test_deep_ep_convert", "compare", seed)
    want = sum(2 * len(modes) * len(splits) for *_, modes, splits in SHAPES)
    assert ran == want and bad == [], f"seed {seed}:\n" + "\n".join(bad[:20])

"""``all_reduce_residual_rmsnorm`` on the CPU: the reference backend on 2 and 3 gloo processes
against a float64 oracle, and the peer kernels' arithmetic and Lamport bookkeeping under
``TRITON_INTERPRET=1`` on virtual ranks.

The oracle, per row: ``h = sum of every rank's x + residual`` and ``y = h / sqrt(mean(h^2) + eps)
* weight`` in float64. ``residual_out`` must be within the rounding bound of a sum (each partial
sum and the final result may round once); ``out`` must be the float64 norm of the returned
``residual_out`` within one rounding of the dtype (plus fp32 noise), because the norm is
documented to read the rounded ``h``. Outputs are poisoned with NaN first, inputs must stay
unchanged, every rank must hold the same bytes, and the in-place form (``out=x``,
``residual_out=residual``) must give the same bytes as the out-of-place one.
"""
from __future__ import annotations

import pytest
import torch

import llcomm
from _dist import run_distributed
from _interp import run_in_interpreter
from test_reference_tp import (assert_close_to_sum, assert_same_on_all_ranks, assert_written,
                               dname, numbers)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: (tokens, hidden): one token at hidden 8192, odd hiddens, more tokens than a block count.
SHAPES = ((1, 8192), (7, 129), (64, 1000), (3, 1), (130, 64))
EPS = 1e-6
MAX_BYTES = 4 << 20


def shared(key: str, shape, dtype) -> torch.Tensor:
    """A tensor every rank builds identically (residual, weight): seeded without the rank."""
    return numbers(key, -1, shape, dtype)


def norm64(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = h.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def assert_norm_of(y: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                   case: str) -> None:
    """``y`` is the norm of ``h`` rounded once to y's dtype (fp32 arithmetic allowed)."""
    assert_written(y, case)
    fi = torch.finfo(y.dtype)
    want = norm64(h, weight, eps)
    tol = fi.eps * want.abs() + 1e-5 * want.abs() + fi.tiny
    err = (y.double() - want).abs()
    if (err <= tol).all():
        return
    i = int((err - tol).reshape(-1).argmax())
    raise AssertionError(f"{case}: {int((err > tol).sum())} of {y.numel()} elements of out are not "
                         f"the norm of residual_out; worst at flat index {i}: got "
                         f"{y.reshape(-1)[i].item()!r}, expected {want.reshape(-1)[i].item()!r}")


# -- the reference backend, spawned ranks ----------------------------------------------------
def _reference_body(rank, ws):
    comm = llcomm.Communicator(backend="reference", max_bytes=MAX_BYTES)
    for dtype in DTYPES:
        for tokens, hidden in SHAPES:
            key = f"fused/w{ws}/{dname(dtype)}/{tokens}x{hidden}"
            case = f"[rank {rank} of {ws}, {dname(dtype)}, {tokens}x{hidden}]"
            xs = [numbers(key, r, (tokens, hidden), dtype) for r in range(ws)]
            x = xs[rank].clone()
            res = shared(key + "/residual", (tokens, hidden), dtype)
            w = shared(key + "/weight", (hidden,), dtype).abs() + 0.5
            x0, res0 = x.clone(), res.clone()
            y = torch.full_like(x, float("nan"))
            h = torch.full_like(x, float("nan"))
            got = comm.all_reduce_residual_rmsnorm(x, res, w, EPS, out=y, residual_out=h)
            assert got[0] is y and got[1] is h, case
            assert torch.equal(x, x0) and torch.equal(res, res0), f"{case}: an input changed"
            assert_close_to_sum(h, xs + [res], case + " residual_out")
            assert_norm_of(y, h, w, EPS, case + " out")
            assert_same_on_all_ranks(y, case + " out")
            assert_same_on_all_ranks(h, case + " residual_out")
            # In place: the residual stream updated where it lies, the norm written over x.
            y2, h2 = comm.all_reduce_residual_rmsnorm(x, res, w, EPS, out=x, residual_out=res)
            assert y2 is x and h2 is res, case
            assert torch.equal(x, y) and torch.equal(res, h), f"{case}: in place differs"
            # Allocated outputs.
            y3, h3 = comm.all_reduce_residual_rmsnorm(xs[rank], res0, w, EPS)
            assert torch.equal(y3, y) and torch.equal(h3, h), f"{case}: allocated outputs differ"
    comm.close()


@pytest.mark.parametrize("ws", [2, 3])
def test_reference_matches_float64_oracle(ws):
    run_distributed(_reference_body, ws, timeout=300)


# -- the peer kernels in the interpreter, virtual ranks ----------------------------------------
def simulate(W, NB, calls, dtype_name, algo):
    """Run ``calls`` ([tokens, hidden] per call, in order) through one fused kernel on W virtual
    ranks, stage by stage, and return the failures (strings)."""
    import triton.language as tl
    from llcomm.tp import peer
    from llcomm.runtime import protocol as P
    from llcomm.runtime.kernels.lamport import PUSH, REDUCE
    from llcomm.tp.kernels import fused_norm as K

    dtype = getattr(torch, dtype_name)
    isz = torch.empty(0, dtype=dtype).element_size()
    ityp, sent = (torch.int16, peer.SENTINEL16) if isz == 2 else (torch.int32, peer.SENTINEL32)
    ft = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]
    cap = max(t * h for t, h in calls)
    region = [torch.full((peer.HALVES * W * cap * isz // 2,), peer.SENTINEL16, dtype=torch.int16)
              for _ in range(W)]
    tab = torch.tensor([r.data_ptr() for r in region], dtype=torch.int64)
    tags = [torch.zeros(peer.HALVES * NB * W, dtype=torch.int32) for _ in range(W)]
    tag_tab = torch.tensor([t.data_ptr() for t in tags], dtype=torch.int64)
    host = [torch.zeros(1, dtype=torch.int64) for _ in range(W)]
    err = [torch.tensor([0, h.data_ptr()], dtype=torch.int64) for h in host]
    ctrl = [torch.zeros(NB, dtype=torch.int64) for _ in range(W)]
    dummy = torch.zeros(NB * W * 2, dtype=torch.int64)  # flags: unused when staged
    wp = 1 << (W - 1).bit_length()
    fails = []
    for i, (tokens, hidden) in enumerate(calls):
        tag = f"[W={W} NB={NB} {dtype_name} {algo} call {i} {tokens}x{hidden}]"
        g = torch.Generator().manual_seed(1000 * i + W)
        xs = [torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(W)]
        xs[0].view(-1)[0] = -0.0  # the idle pattern of 16-bit Lamport words must still arrive
        res = torch.randn(tokens, hidden, generator=g).to(dtype)
        w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
        ys = [torch.full_like(res, float("nan")) for _ in range(W)]
        hs = [torch.full_like(res, float("nan")) for _ in range(W)]
        block, _ = peer._row_shape(hidden)
        for stage in (PUSH, REDUCE):
            for r in range(W):
                xi = xs[r].view(ityp)
                if algo == "lamport":
                    lam_tag = peer.PeerBackend._lamport_tag(
                        P.OP_FUSED_LAMPORT, peer.PeerBackend._rows_numel(tokens, hidden), dtype)
                    K.lamport_norm_kernel[(NB,)](
                        xi, res, w, ys[r], hs[r], None, tokens, hidden, EPS, tab, tag_tab,
                        ctrl[r], err[r], r, lam_tag, 0, cap, SENTINEL=sent, FLOAT=ft, WORLD=W,
                        WORLD_POW2=wp, NUM_BLOCKS=NB, BLOCK=block, STAGES=stage)
                else:
                    K.one_shot_norm_kernel[(NB,)](
                        xi, res, w, ys[r], hs[r], None, tokens, hidden, EPS, tab, dummy, dummy,
                        ctrl[r], err[r], r, 0, 0, cap, FLOAT=ft, WORLD=W, WORLD_POW2=W,
                        NUM_BLOCKS=NB, BLOCK=block, STAGES=stage)
        # Expected h: rank-order fp32 sum, rounded, plus residual in fp32, rounded.
        acc = torch.zeros(tokens, hidden)
        for x in xs:
            acc += x.float()
        want_h = (acc.to(dtype).float() + res.float()).to(dtype)
        for r in range(W):
            if torch.isnan(hs[r].float()).any() or torch.isnan(ys[r].float()).any():
                fails.append(f"{tag} rank {r}: outputs left unwritten")
                continue
            if dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16 (GPU rounds)
                ok = torch.allclose(hs[r].float(), want_h.float(), rtol=2 ** -6, atol=2 ** -6)
            else:
                ok = torch.equal(hs[r].view(ityp), want_h.view(ityp))
            if not ok:
                fails.append(f"{tag} rank {r}: residual_out is not the rounded sum + residual")
            want_y = norm64(hs[r], w, EPS)
            tol = (2 ** -6 if dtype == torch.bfloat16 else 1e-5 if dtype == torch.float32
                   else 2 ** -9) * (want_y.abs() + 1e-3)
            if not ((ys[r].double() - want_y).abs() <= tol).all():
                fails.append(f"{tag} rank {r}: out is not the norm of residual_out")
            if not (torch.equal(ys[r].view(ityp), ys[0].view(ityp))
                    and torch.equal(hs[r].view(ityp), hs[0].view(ityp))):
                fails.append(f"{tag} rank {r}: differs from rank 0")
        if algo == "lamport" and not all(bool((reg == peer.SENTINEL16).all()) for reg in region):
            fails.append(f"{tag}: Lamport slots not re-armed with the sentinel")
        if algo == "lamport" and any(int(t.abs().sum()) for t in tags):
            fails.append(f"{tag}: Lamport tags not reset to 0")
    for r in range(W):
        if ctrl[r].tolist() != [len(calls)] * NB:
            fails.append(f"rank {r}: op counters {ctrl[r].tolist()}, expected {len(calls)} each")
        if int(host[r][0]):
            fails.append(f"rank {r}: an error word was written without cause")
    return fails


def _run_in_interpreter(*args):
    return run_in_interpreter("test_fused_norm_cpu", "simulate", *args)


#: Consecutive calls on one set of buffers: halves alternate, rows loop past the block count,
#: odd and one-element rows, a shrinking size after a larger one.
CALLS = [[5, 37], [1, 64], [9, 16], [2, 1], [5, 37]]
SIM_CASES = [  # W, NB, dtype, algo
    (2, 3, "bfloat16", "lamport"),
    (3, 2, "float16", "lamport"),
    (2, 4, "float32", "lamport"),
    (2, 3, "bfloat16", "one_shot"),
    (3, 2, "float32", "one_shot"),
]


@pytest.mark.parametrize("case", SIM_CASES,
                         ids=[f"w{c[0]}-nb{c[1]}-{c[2]}-{c[3]}" for c in SIM_CASES])
def test_kernels_in_interpreter(case):
    W, NB, dtype, algo = case
    fails = _run_in_interpreter(W, NB, CALLS, dtype, algo)
    assert not fails, "\n".join(fails[:20])

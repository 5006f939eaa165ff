"""The fused norms beside ``all_reduce_residual_rmsnorm`` on the CPU: ``all_reduce_rmsnorm`` (no
residual), ``all_reduce_residual_rmsnorm_fp8`` (static scale) and ``..._fp8_per_group``, against
the fp32 oracle of ``tests/_norm_oracle.py`` (its own e4m3 table; no llcomm code).

- The reference backend on 2 gloo processes: ``residual_out`` bit for bit the oracle's (a sum of
  two terms has one order, so gloo's sum is the rank-order one); ``out`` of the plain norms
  within one rounding of the oracle's fp32 norm of the returned ``residual_out``; FP8 codes and
  scales byte for byte the oracle's quantisation of the ``y`` that ``all_reduce_residual_rmsnorm``
  returns for the same inputs ("given the same fp32 values"), and within one e4m3 step of the
  oracle's quantisation of its own ``y`` (whose last bit may round differently: the mean square
  is summed in another order).
- The peer kernels under ``TRITON_INTERPRET=1`` on virtual ranks: each variant's kernel, and the
  plain kernel on the same inputs before it (the comparator), both algorithms, several calls in
  a row on one set of buffers. ``residual_out`` bit for bit the oracle's (fp16 / fp32; the
  interpreter truncates fp32 -> bf16 where the GPU rounds, so bf16 gets a bound) and the plain
  kernel's; codes and scales byte for byte the oracle's quantisation of the plain kernel's
  ``y``; every rank the same bytes; nothing written past the outputs (a block without rows
  stores no scales); Lamport slots and tags idle again after every call. Ranks that call two
  different variants in one round report a mismatch.

The static scale of each case saturates the largest values and is one at which multiplying by
its reciprocal and dividing by it give different codes for some element (``telling_scale``), so
the tests tell the documented arithmetic from a division. Outputs are poisoned first (NaN, and the
e4m3 NaN code 0x7F); inputs are fresh per case.
"""
from __future__ import annotations

import pytest
import torch

import _norm_oracle as O
import llcomm
from _dist import run_distributed
from _interp import run_in_interpreter
from test_reference_tp import assert_same_on_all_ranks, dname, numbers

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
EPS = 1e-6
MAX_BYTES = 4 << 20
NAN8 = 0x7F                     # float8_e4m3fn NaN: the poison of FP8 outputs
#: (tokens, hidden): a DeepSeek row, two groups, more tokens; hiddens multiples of 128 (FP8 groups)
SHAPES = ((1, 7168), (5, 256), (64, 1024))
#: no-residual only: rows of any length
ODD_SHAPES = ((3, 129), (7, 1))


def shared(key: str, shape, dtype) -> torch.Tensor:
    return numbers(key, -1, shape, dtype)


def poison8(shape) -> torch.Tensor:
    return torch.full(shape, NAN8, dtype=torch.uint8).view(torch.float8_e4m3fn)


def codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def assert_bits(got: torch.Tensor, want: torch.Tensor, case: str) -> None:
    assert got.shape == want.shape and got.dtype.itemsize == want.dtype.itemsize, \
        f"{case}: {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
    size = got.dtype.itemsize
    g = got.contiguous().view(torch.uint8).reshape(*got.shape, size)
    w = want.contiguous().view(torch.uint8).reshape(*want.shape, size)
    bad = (g != w).any(-1).nonzero()
    assert not bad.numel(), f"{case}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}"


def assert_one_rounding(y: torch.Tensor, want: torch.Tensor, case: str) -> None:
    """``y`` (rounded to its dtype) is fp32 ``want`` rounded, give or take one rounding."""
    assert not torch.isnan(y.float()).any(), f"{case}: out left unwritten"
    fi = torch.finfo(y.dtype)
    tol = fi.eps * want.abs() + 2.0 ** -20 * want.abs() + fi.tiny
    err = (y.float() - want).abs()
    assert (err <= tol).all(), \
        f"{case}: out off the fp32 norm by {float((err - tol).max())} past one rounding"


def assert_one_step(got_codes, want_codes, case: str) -> None:
    d = O.step_distance(got_codes, want_codes)
    assert int(d.max()) <= 1, f"{case}: e4m3 codes {int(d.max())} steps from the oracle's"


def check_fp8_static(q, y, y_oracle, scale, case):
    assert_bits(codes(q), O.static_codes(y, scale), case + " codes")
    assert_one_step(codes(q), O.static_codes(y_oracle, scale), case + " vs the oracle's y")


def check_fp8_group(q, s, y, y_oracle, round_scale, case):
    want_q, want_s = O.group_codes(y, round_scale)
    assert_bits(s, want_s, case + " scales")
    assert_bits(codes(q), want_q, case + " codes")
    if not round_scale:     # a power of two up may jump where the last bit of amax differs
        oq, os_ = O.group_codes(y_oracle)
        assert ((s - os_).abs() <= 2.0 ** -6 * os_).all(), case + " scales vs the oracle's y"
        assert_one_step(codes(q), oq, case + " vs the oracle's y")


# -- the reference backend, spawned ranks ----------------------------------------------------
def _reference_body(rank, ws):
    comm = llcomm.Communicator(backend="reference", max_bytes=MAX_BYTES)
    for dtype in DTYPES:
        for tokens, hidden in SHAPES + ODD_SHAPES:
            key = f"fused-variants/w{ws}/{dname(dtype)}/{tokens}x{hidden}"
            case = f"[rank {rank}, {dname(dtype)}, {tokens}x{hidden}]"
            shape = (tokens, hidden)
            xs = [numbers(key, r, shape, dtype) for r in range(ws)]
            x = xs[rank]
            res = shared(key + "/residual", shape, dtype)
            w = shared(key + "/weight", (hidden,), dtype).abs() + 0.5
            x0, res0 = x.clone(), res.clone()

            # no residual: h is the rounded sum, y its norm; = a zero residual, bit for bit
            y = torch.full_like(x, float("nan"))
            h = torch.full_like(x, float("nan"))
            got = comm.all_reduce_rmsnorm(x, w, EPS, out=y, residual_out=h)
            assert got[0] is y and got[1] is h
            assert_bits(h, O.residual_out(xs, None, dtype), case + " rmsnorm residual_out")
            assert_one_rounding(y, O.rmsnorm(h, w, EPS), case + " rmsnorm out")
            y0, h0 = comm.all_reduce_residual_rmsnorm(x, torch.zeros_like(x), w, EPS)
            assert_bits(y, y0, case + " rmsnorm vs a zero residual")
            assert_bits(h, h0, case + " rmsnorm residual_out vs a zero residual")
            for t in (y, h):
                assert_same_on_all_ranks(t, case + " rmsnorm")
            if hidden % O.GROUP:
                continue

            # the plain join: the y the FP8 joins quantise
            yp, hp = comm.all_reduce_residual_rmsnorm(x, res, w, EPS)
            h_oracle = O.residual_out(xs, res, dtype)
            assert_bits(hp, h_oracle, case + " residual_out")
            y_oracle = O.rmsnorm(h_oracle, w, EPS).to(dtype)
            scale = O.telling_scale(yp)         # saturates some; tells 1 / scale from / scale

            q, h8 = poison8(shape), torch.full_like(x, float("nan"))
            got = comm.all_reduce_residual_rmsnorm_fp8(x, res, w, EPS, scale=scale, out=q,
                                                       residual_out=h8)
            assert got[0] is q and got[1] is h8
            assert_bits(h8, hp, case + " fp8 residual_out")
            check_fp8_static(q, yp, y_oracle, scale, case + " fp8")
            for round_scale in (False, True):
                c = f"{case} fp8 per group round_scale={round_scale}"
                qg, sg = poison8(shape), torch.full((tokens, hidden // 128), float("nan"))
                hg = torch.full_like(x, float("nan"))
                got = comm.all_reduce_residual_rmsnorm_fp8_per_group(
                    x, res, w, EPS, round_scale=round_scale, out=qg, scales_out=sg,
                    residual_out=hg)
                assert got[0] is qg and got[1] is sg and got[2] is hg
                assert_bits(hg, hp, c + " residual_out")
                check_fp8_group(qg, sg, yp, y_oracle, round_scale, c)
                for t in (qg, sg, hg):
                    assert_same_on_all_ranks(t, c)
            assert torch.equal(x, x0) and torch.equal(res, res0), f"{case}: an input changed"
            # in place (the residual stream updated where it lies) and allocated outputs
            r2 = res.clone()
            q2, h2 = comm.all_reduce_residual_rmsnorm_fp8(x, r2, w, EPS, scale=scale.view(1),
                                                          residual_out=r2)
            assert h2 is r2 and q2.dtype == torch.float8_e4m3fn
            assert_bits(r2, hp, case + " fp8 in place")
            assert_bits(q2, q, case + " fp8 allocated")
            for t in (q, h8):
                assert_same_on_all_ranks(t, case + " fp8")
    comm.close()


def test_reference_matches_fp32_oracle():
    run_distributed(_reference_body, 2, timeout=300)


# -- the peer kernels in the interpreter, virtual ranks ----------------------------------------
#: variant -> (RESIDUAL, OUT name in fused_norm, Lamport op code name, one-shot op code name)
VARIANTS = {
    "rmsnorm": (0, "PLAIN", "OP_NORM_LAMPORT", "OP_NORM_ONE_SHOT"),
    "fp8": (1, "FP8_STATIC", "OP_FP8_LAMPORT", "OP_FP8_ONE_SHOT"),
    "fp8_group": (1, "FP8_GROUP", "OP_FP8_GROUP_LAMPORT", "OP_FP8_GROUP_ONE_SHOT"),
}
TAIL = 64       # poisoned elements past each FP8 output and scales tensor


class _Ranks:
    """W virtual ranks' Lamport regions, tags, counters and error words (one set of buffers for
    every call of a simulation)."""

    def __init__(self, W, NB, cap, dtype):
        from llcomm.tp import peer
        self.W, self.NB, self.cap, self.dtype = W, NB, cap, dtype
        isz = dtype.itemsize
        self.ityp, self.sent = ((torch.int16, peer.SENTINEL16) if isz == 2
                                else (torch.int32, peer.SENTINEL32))
        self.region = [torch.full((peer.HALVES * W * cap * isz // 2,), peer.SENTINEL16,
                                  dtype=torch.int16) for _ in range(W)]
        self.tab = torch.tensor([r.data_ptr() for r in self.region], dtype=torch.int64)
        self.tags = [torch.zeros(peer.HALVES * NB * W, dtype=torch.int32) for _ in range(W)]
        self.tag_tab = torch.tensor([t.data_ptr() for t in self.tags], dtype=torch.int64)
        self.host = [torch.zeros(1, dtype=torch.int64) for _ in range(W)]
        self.err = [torch.tensor([0, h.data_ptr()], dtype=torch.int64) for h in self.host]
        self.ctrl = [torch.zeros(NB, dtype=torch.int64) for _ in range(W)]
        self.dummy = torch.zeros(NB * W * 2, dtype=torch.int64)  # flags: unused when staged
        self.ops = 0

    def run(self, algo, residual_on, out_mode, op, xs, res, w, outs, hs, qs, round_scale):
        """One fused op on every rank, push stage then reduce stage: rank r writes outs[r],
        hs[r] and (FP8) uses / writes qs[r]."""
        from llcomm.runtime.kernels.lamport import PUSH, REDUCE
        for stage in (PUSH, REDUCE):
            for r in range(self.W):
                self.launch(r, stage, algo, residual_on, out_mode, op, xs[r], res, w, outs[r],
                            hs[r], qs[r], round_scale)
        self.ops += 1

    def launch(self, r, stage, algo, residual_on, out_mode, op, x, res, w, out, h, q,
               round_scale):
        """Rank r's launch of one stage of a fused kernel."""
        import triton.language as tl
        from llcomm.runtime import protocol as P
        from llcomm.tp import peer
        from llcomm.tp.kernels import fused_norm as K
        tokens, hidden = x.shape
        ft = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
              torch.float32: tl.float32}[self.dtype]
        block, _ = peer._row_shape(hidden)
        rows = peer.PeerBackend._rows_numel(tokens, hidden)
        consts = dict(FLOAT=ft, WORLD=self.W, NUM_BLOCKS=self.NB, BLOCK=block, OP=op,
                      RESIDUAL=residual_on, OUT=out_mode, ROUND=int(round_scale), STAGES=stage)
        lead = (x.view(self.ityp), res if residual_on else x, w, out, h, q)
        if algo == "lamport":
            tag = P.lamport_tag(op, rows, dname(self.dtype))
            K.lamport_norm_kernel[(self.NB,)](
                *lead, tokens, hidden, EPS, self.tab, self.tag_tab, self.ctrl[r], self.err[r],
                r, tag, 0, self.cap, SENTINEL=self.sent, WORLD_POW2=1 << (self.W - 1).bit_length(),
                **consts)
        else:
            K.one_shot_norm_kernel[(self.NB,)](
                *lead, tokens, hidden, EPS, self.tab, self.dummy, self.dummy, self.ctrl[r],
                self.err[r], r, 0, 0, self.cap, WORLD_POW2=self.W, **consts)

    def idle_failures(self, tag, lamport: bool) -> list[str]:
        """Lamport: slots and tags idle again; either: counters at the ops run, no error."""
        from llcomm.tp import peer
        fails = []
        if lamport and not all(bool((reg == peer.SENTINEL16).all()) for reg in self.region):
            fails.append(f"{tag}: Lamport slots not re-armed with the sentinel")
        if lamport and any(int(t.abs().sum()) for t in self.tags):
            fails.append(f"{tag}: Lamport tags not reset to 0")
        for r in range(self.W):
            if self.ctrl[r].tolist() != [self.ops] * self.NB:
                fails.append(f"{tag} rank {r}: op counters {self.ctrl[r].tolist()}, "
                             f"expected {self.ops} each")
            if int(self.host[r][0]):
                fails.append(f"{tag} rank {r}: an error word was written without cause")
        return fails


def _failures(check, *args) -> list[str]:
    try:
        check(*args)
    except AssertionError as e:
        return [str(e)]
    return []


def simulate(W, NB, calls, dtype_name, algo):
    """``calls`` ([variant, tokens, hidden, round_scale] each, in order) through the fused
    kernels on W virtual ranks: per call the plain kernel (the comparator) and the variant's.
    Returns the failures (strings)."""
    from llcomm.runtime import protocol as P
    from llcomm.tp.kernels import fused_norm as K
    dtype = getattr(torch, dtype_name)
    R = _Ranks(W, NB, max(t * h for _, t, h, _ in calls), dtype)
    plain_op = P.OP_FUSED_LAMPORT if algo == "lamport" else P.OP_FUSED_ONE_SHOT
    fails = []
    for i, (variant, tokens, hidden, round_scale) in enumerate(calls):
        tag = f"[W={W} NB={NB} {dtype_name} {algo} call {i} {variant} {tokens}x{hidden}]"
        residual_on, out_name, op_l, op_o = VARIANTS[variant]
        out_mode = getattr(K, out_name)
        op = getattr(P, op_l if algo == "lamport" else op_o)
        shape, groups = (tokens, hidden), hidden // O.GROUP
        g = torch.Generator().manual_seed(1000 * i + 17 * W + len(dtype_name))
        xs = [torch.randn(shape, generator=g).to(dtype) for _ in range(W)]
        res = torch.randn(shape, generator=g).to(dtype)
        w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
        xs[0].view(-1)[0] = -0.0        # the idle pattern of 16-bit Lamport words must arrive
        if out_mode == K.FP8_GROUP:     # an all-zero group: scale 1, codes 0
            for x in xs + [res]:
                x[0, :O.GROUP] = 0
        # the comparator: the plain kernel (a zero residual for the no-residual variant)
        cmp_res = res if residual_on else torch.zeros_like(res)
        yp = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(W)]
        hp = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(W)]
        R.run(algo, 1, K.PLAIN, plain_op, xs, cmp_res, w, yp, hp, [None] * W, False)
        # the variant, outputs poisoned, each with a poisoned tail past its end
        if out_mode == K.PLAIN:
            outs = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(W)]
            flat = outs
        else:
            flat = [torch.full((tokens * hidden + TAIL,), NAN8, dtype=torch.uint8)
                    for _ in range(W)]
            outs = [f[:tokens * hidden].view(shape) for f in flat]
        hs = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(W)]
        scale = O.telling_scale(yp[0]).reshape(1)   # saturates some; tells * (1 / s) from / s
        scales_flat = [torch.full((tokens * groups + TAIL,), float("nan")) for _ in range(W)]
        qs = ([scale] * W if out_mode == K.FP8_STATIC else
              [s[:tokens * groups].view(tokens, groups) for s in scales_flat]
              if out_mode == K.FP8_GROUP else [None] * W)
        R.run(algo, residual_on, out_mode, op, xs, res, w, outs, hs, qs, round_scale)

        h_oracle = O.residual_out(xs, res if residual_on else None, dtype)
        for r in range(W):
            c = f"{tag} rank {r}"
            # the oracle's y of the h returned (for fp16 / fp32 that is the oracle's h, checked
            # below; a bf16 h the interpreter truncated can be far off in a row where the sum
            # and the residual cancel)
            y_oracle = O.rmsnorm(hs[r], w, EPS).to(dtype)
            fails += _failures(assert_bits, hs[r], hp[r], c + " residual_out vs the plain kernel")
            if dtype == torch.bfloat16:     # the interpreter truncates fp32 -> bf16
                if not torch.allclose(hs[r].float(), h_oracle.float(), rtol=2 ** -6, atol=2 ** -6):
                    fails.append(f"{c}: residual_out is not the rounded sum (+ residual)")
            else:
                fails += _failures(assert_bits, hs[r], h_oracle, c + " residual_out vs the oracle")
            if out_mode == K.PLAIN:
                fails += _failures(assert_bits, outs[r], yp[r], c + " out vs a zero residual")
                tol = 2 ** -6 if dtype == torch.bfloat16 else 2 ** -9
                if not ((outs[r].float() - O.rmsnorm(hs[r], w, EPS)).abs()
                        <= tol * (O.rmsnorm(hs[r], w, EPS).abs() + 1e-3)).all():
                    fails.append(f"{c}: out is not the norm of residual_out")
            elif out_mode == K.FP8_STATIC:
                fails += _failures(check_fp8_static, outs[r].view(torch.float8_e4m3fn), yp[r],
                                   y_oracle, scale, c)
            else:
                fails += _failures(check_fp8_group, outs[r].view(torch.float8_e4m3fn), qs[r],
                                   yp[r], y_oracle, round_scale, c)
                if not torch.isnan(scales_flat[r][tokens * groups:]).all():
                    fails.append(f"{c}: scales written past the last token")
            if out_mode != K.PLAIN and not (flat[r][tokens * hidden:] == NAN8).all():
                fails.append(f"{c}: codes written past the last token")
            for mine, first in ((outs[r], outs[0]), (hs[r], hs[0])) + (
                    ((qs[r], qs[0]),) if out_mode == K.FP8_GROUP else ()):
                if not torch.equal(mine.contiguous().view(torch.uint8),
                                   first.contiguous().view(torch.uint8)):
                    fails.append(f"{c}: differs from rank 0")
        fails += R.idle_failures(tag, algo == "lamport")
    return fails


def _run_in_interpreter(*args):
    return run_in_interpreter("test_fused_variants_cpu", "simulate", *args)


#: Consecutive calls on one set of buffers: the variants interleaved with the plain kernel,
#: halves alternating, rows looping past the block count, a single token with blocks that have
#: no row (their scales must not be stored), odd rows for the no-residual norm.
CALLS = [["fp8_group", 3, 256, False], ["rmsnorm", 5, 37, False], ["fp8", 2, 384, False],
         ["fp8_group", 9, 128, True], ["fp8", 1, 100, False], ["rmsnorm", 2, 1, False],
         ["fp8_group", 1, 384, False]]
SIM_CASES = [  # W, NB, dtype, algo
    (2, 3, "bfloat16", "lamport"),
    (3, 2, "float16", "lamport"),
    (2, 4, "float32", "lamport"),
    (2, 3, "float16", "one_shot"),
    (3, 2, "bfloat16", "one_shot"),
]


@pytest.mark.parametrize("case", SIM_CASES,
                         ids=[f"w{c[0]}-nb{c[1]}-{c[2]}-{c[3]}" for c in SIM_CASES])
def test_kernels_in_interpreter(case):
    W, NB, dtype, algo = case
    fails = _run_in_interpreter(W, NB, CALLS, dtype, algo)
    assert not fails, "\n".join(fails[:20])


def simulate_mismatch(variants, dtype_name):
    """A Lamport round in which rank r calls ``variants[r]`` (a VARIANTS name, or "plain" for
    all_reduce_residual_rmsnorm) on the same [4, 256] rows: per rank, what its error word
    decodes to (exception type name, op, phase, ranks), or None."""
    from llcomm.runtime import protocol as P
    from llcomm.runtime.kernels.lamport import PUSH, REDUCE
    from llcomm.tp.kernels import fused_norm as K
    dtype = getattr(torch, dtype_name)
    W, shape = len(variants), (4, 256)
    R = _Ranks(W, 3, shape[0] * shape[1], dtype)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(shape, generator=g).to(dtype) for _ in range(W)]
    res, w = torch.randn(shape, generator=g).to(dtype), torch.ones(shape[1], dtype=dtype)
    for stage in (PUSH, REDUCE):
        for r, variant in enumerate(variants):
            residual_on, out_name, op, _ = VARIANTS.get(variant, (1, "PLAIN", "OP_FUSED_LAMPORT",
                                                                  None))
            out_mode = getattr(K, out_name)
            out = (torch.empty(shape, dtype=dtype) if out_mode == K.PLAIN
                   else torch.empty(shape, dtype=torch.uint8))
            q = (torch.ones(1) if out_mode == K.FP8_STATIC else
                 torch.empty(shape[0], shape[1] // O.GROUP) if out_mode == K.FP8_GROUP else None)
            R.launch(r, stage, "lamport", residual_on, out_mode, getattr(P, op), xs[r], res, w,
                     out, torch.empty(shape, dtype=dtype), q, False)
    seen = []
    for r in range(W):
        e = P.decode_error(int(R.host[r][0]), r)
        seen.append(None if e is None else [type(e).__name__, e.op, e.phase, list(e.ranks)])
    return seen


@pytest.mark.parametrize("other", ["rmsnorm", "fp8", "fp8_group"])
def test_variants_mismatch_in_one_round(other):
    """Rank 0 calls all_reduce_residual_rmsnorm, rank 1 another variant of the same shape and
    dtype: both report a mismatch naming their own op and the other rank, as they would for
    another size (the variants' tags differ by op code)."""
    from llcomm.runtime import protocol as P
    seen = run_in_interpreter("test_fused_variants_cpu", "simulate_mismatch", ["plain", other],
                              "bfloat16")
    ops = [P.OPS[P.OP_FUSED_LAMPORT], P.OPS[getattr(P, VARIANTS[other][2])]]
    for r in range(2):
        assert seen[r] == ["CommMismatchError", ops[r], P.PHASES[P.PHASE_DATA], [1 - r]], (r, seen)

"""The Lamport kernels' tags on the CPU: ``lamport_all_reduce.lamport_kernel``,
``reduce_scatter.lamport_reduce_scatter_kernel`` and ``fused_norm.lamport_norm_kernel`` under
``TRITON_INTERPRET=1`` on virtual ranks, on Lamport regions laid out as ``peer.PeerBackend``
lays them out (data slots idle at SENTINEL, tag words idle at 0).

Each round runs the push half of every rank, then the reduce half of every rank (the reduce half
alone reads each source once instead of polling the GPU clock). Checked:

- matched rounds (sizes and dtypes that change from round to round, plain and fused calls
  mixed, blocks with and without data, several chunks per block): every rank returns the
  rank-order sum, every data word is SENTINEL again and every tag 0 again, no error word;
- mismatched rounds (another size, dtype, row shape, or the plain against the fused kernel):
  every rank's error word is a mismatch of its own op in the data phase, naming the first
  source whose tag differs, and no rank waits for that source's data;
- a rank that never pushed: the others report a timeout naming it.
"""
from __future__ import annotations

import pytest

from _interp import run_in_interpreter


class Regions:
    """W virtual ranks' Lamport regions, op counters and error words (CPU tensors)."""

    def __init__(self, W: int, NB: int, slot_bytes: int, lag=1):
        import torch
        from llcomm.tp import peer

        self.W, self.NB, self.slot_bytes = W, NB, slot_bytes
        self.lag = lag                                  # LAG of multi-chunk calls
        self.data = [torch.full((peer.HALVES * W * slot_bytes // 2,), peer.SENTINEL16,
                                dtype=torch.int16) for _ in range(W)]
        self.tags = [torch.zeros(peer.HALVES * NB * W, dtype=torch.int32) for _ in range(W)]
        self.data_tab = torch.tensor([t.data_ptr() for t in self.data], dtype=torch.int64)
        self.tag_tab = torch.tensor([t.data_ptr() for t in self.tags], dtype=torch.int64)
        self.host = [torch.zeros(1, dtype=torch.int64) for _ in range(W)]
        self.err = [torch.tensor([0, h.data_ptr()], dtype=torch.int64) for h in self.host]
        self.ctrl = [torch.zeros(NB, dtype=torch.int64) for _ in range(W)]

    def idle(self) -> bool:
        from llcomm.tp import peer
        return all(bool((d == peer.SENTINEL16).all()) for d in self.data) and \
            all(int(t.abs().sum()) == 0 for t in self.tags)


def _int_view(dtype):
    import torch
    from llcomm.tp import peer
    return (torch.int16, peer.SENTINEL16) if dtype.itemsize == 2 else (torch.int32, peer.SENTINEL32)


def _tl_float(dtype):
    import torch
    import triton.language as tl
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
            torch.float32: tl.float32}[dtype]


class Call:
    """One rank's call of a round: ``("all_reduce", n, dtype)``, ``("reduce_scatter", n,
    dtype)`` (n elements out, W * n in) or ``("fused", tokens, hidden, dtype)``, with its
    operand and outputs."""

    def __init__(self, spec, seed: int, rank: int, W: int = 2):
        import torch
        self.kind, *shape, dname = spec
        self.rank = rank
        self.dtype = getattr(torch, dname)
        self.dname = dname
        g = torch.Generator().manual_seed(seed * 101 + rank)
        if self.kind != "fused":
            (self.n,) = shape
            parts = W if self.kind == "reduce_scatter" else 1
            self.x = torch.randn(parts * self.n, generator=g).to(self.dtype)
        else:
            self.tokens, self.hidden = shape
            self.x = torch.randn(self.tokens, self.hidden, generator=g).to(self.dtype)
            gs = torch.Generator().manual_seed(seed)  # residual and weight: the same on every rank
            self.res = torch.randn(self.tokens, self.hidden, generator=gs).to(self.dtype)
            self.w = (torch.rand(self.hidden, generator=gs) + 0.5).to(self.dtype)
            self.h = torch.full_like(self.x, float("nan"))
        self.x.view(-1)[0] = -0.0  # the 16-bit idle pattern must still arrive
        self.out = torch.full_like(self.x[:self.n] if self.kind == "reduce_scatter" else self.x,
                                   float("nan"))

    def outputs(self):
        """What the call writes: out (fused: and residual_out)."""
        return [self.out, self.h] if self.kind == "fused" else [self.out]

    def poisoned(self) -> bool:
        """Every output element is protocol.POISON_BITS (all bits set: a NaN)."""
        from llcomm.runtime import protocol as P
        return all(bool((o.view(_int_view(self.dtype)[0]) == P.POISON_BITS).all())
                   for o in self.outputs())

    def op(self) -> int:
        from llcomm.runtime import protocol as P
        return {"all_reduce": P.OP_LAMPORT, "reduce_scatter": P.OP_LAMPORT_REDUCE_SCATTER,
                "fused": P.OP_FUSED_LAMPORT}[self.kind]

    def launch(self, R: Regions, rank: int, stage: int) -> None:
        from llcomm.tp import peer
        from llcomm.tp.kernels import fused_norm, lamport_all_reduce, reduce_scatter
        ityp, sent = _int_view(self.dtype)
        cap = R.slot_bytes // self.dtype.itemsize
        wp = 1 << (R.W - 1).bit_length()
        common = dict(SENTINEL=sent, FLOAT=_tl_float(self.dtype), WORLD=R.W, WORLD_POW2=wp,
                      NUM_BLOCKS=R.NB, STAGES=stage)
        if self.kind != "fused":
            tag = peer.PeerBackend._lamport_tag(self.op(), self.n, self.dtype)
            block, _ = peer._launch_shape(self.n, self.dtype.itemsize, R.NB)
            kernel = (reduce_scatter.lamport_reduce_scatter_kernel
                      if self.kind == "reduce_scatter" else lamport_all_reduce.lamport_kernel)
            kernel[(R.NB,)](
                self.x.view(ityp), self.out.view(ityp), self.n, R.data_tab, R.tag_tab,
                R.ctrl[rank], R.err[rank], rank, tag, 0, cap, BLOCK=block,
                LAG=R.lag if peer.lamport_lag(self.n, block, R.NB) else 0, **common)
        else:
            numel = peer.PeerBackend._rows_numel(self.tokens, self.hidden)
            tag = peer.PeerBackend._lamport_tag(self.op(), numel, self.dtype)
            block, _ = peer._row_shape(self.hidden)
            fused_norm.lamport_norm_kernel[(R.NB,)](
                self.x.view(ityp), self.res, self.w, self.out, self.h, None, self.tokens,
                self.hidden,
                1e-6, R.data_tab, R.tag_tab, R.ctrl[rank], R.err[rank], rank, tag, 0, cap,
                BLOCK=block, **common)

    def check_sum(self, calls) -> str | None:
        """None if this call's result is the rank-order sum (plain) or its residual_out is the
        rounded sum + residual (fused); else what is wrong."""
        import torch
        acc = torch.zeros(self.x.shape)
        for c in calls:
            acc += c.x.float()
        got = self.h if self.kind == "fused" else self.out
        want = acc.to(self.dtype)
        if self.kind == "reduce_scatter":       # this rank's part of the sum
            want = want[self.rank * self.n:(self.rank + 1) * self.n]
        if self.kind == "fused":
            want = (want.float() + self.res.float()).to(self.dtype)
        if self.dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16 (GPU rounds)
            ok = torch.allclose(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6)
        else:
            bits = _int_view(self.dtype)[0]
            ok = torch.equal(got.view(bits), want.view(bits))
        return None if ok else f"{self.kind} {tuple(self.x.shape)} {self.dname}: not the sum"


#: What every output holds before a round that fails (``simulate_failed_outputs``): a
#: valid-looking value, never the poison.
PREFILL = 1.5


def _round(R: Regions, specs, seed: int, pushers=None, prefill=None):
    """One round: rank r calls specs[r]; ranks in ``pushers`` (default all) push, then every
    rank reduces. ``prefill``: the value every output holds before (default NaN). Returns the
    calls."""
    from llcomm.runtime.kernels.lamport import PUSH, REDUCE
    calls = [Call(s, seed, r, R.W) for r, s in enumerate(specs)]
    for c in calls:
        if prefill is not None:
            for o in c.outputs():
                o.fill_(prefill)
    for r, c in enumerate(calls):
        if pushers is None or r in pushers:
            c.launch(R, r, PUSH)
    for r, c in enumerate(calls):
        c.launch(R, r, REDUCE)
    return calls


def simulate_matched(W, NB, rounds, lag=1):
    """Matched rounds (every rank calls ``rounds[i]``) on one set of regions; returns failures.
    ``lag``: LAG of multi-chunk calls."""
    R = Regions(W, NB, slot_bytes=max(_nbytes(s) for s in rounds), lag=lag)
    fails = []
    for i, spec in enumerate(rounds):
        calls = _round(R, [spec] * W, seed=i)
        for r, c in enumerate(calls):
            bad = c.check_sum(calls)
            if bad:
                fails.append(f"round {i} rank {r}: {bad}")
        if not R.idle():
            fails.append(f"round {i} {spec}: Lamport words or tags not idle afterwards")
        for r in range(W):
            if int(R.host[r][0]):
                fails.append(f"round {i} rank {r}: error word {int(R.host[r][0]):#x} without cause")
    for r in range(W):
        if R.ctrl[r].tolist() != [len(rounds)] * NB:
            fails.append(f"rank {r}: op counters {R.ctrl[r].tolist()}")
    return fails


def simulate_mismatch(W, NB, warmup, specs, pushers=None, lag=1):
    """A matched warm-up round, then one round where rank r calls specs[r]. Returns per rank
    (exception type name, op, phase, ranks) decoded from its error word, or None."""
    from llcomm.runtime import protocol as P
    R = Regions(W, NB, slot_bytes=max(_nbytes(s) for s in [warmup, *specs]), lag=lag)
    _round(R, [warmup] * W, seed=0)
    assert not any(int(h[0]) for h in R.host), "the warm-up round failed"
    _round(R, specs, seed=1, pushers=None if pushers is None else set(pushers))
    seen = []
    for r in range(W):
        e = P.decode_error(int(R.host[r][0]), r)
        seen.append(None if e is None else [type(e).__name__, e.op, e.phase, list(e.ranks)])
    return seen


def simulate_failed_outputs(W, NB, warmup, specs, pushers=None):
    """``simulate_mismatch``'s rounds, the failing one with every output pre-filled with
    PREFILL. Returns per rank [its error's type name or None, whether its outputs are
    poisoned]."""
    from llcomm.runtime import protocol as P
    R = Regions(W, NB, slot_bytes=max(_nbytes(s) for s in [warmup, *specs]))
    _round(R, [warmup] * W, seed=0)
    calls = _round(R, specs, seed=1, pushers=None if pushers is None else set(pushers),
                   prefill=PREFILL)
    seen = []
    for r, c in enumerate(calls):
        e = P.decode_error(int(R.host[r][0]), r)
        seen.append([None if e is None else type(e).__name__, c.poisoned()])
    return seen


def _nbytes(spec) -> int:
    import torch
    size = getattr(torch, spec[-1]).itemsize
    n = spec[1] * spec[2] if spec[0] == "fused" else spec[1]
    return -(-n * size // 256) * 256


def _run_in_interpreter(fn_name, *args):
    return run_in_interpreter("test_lamport_cpu", fn_name, *args)


BF, F16, F32 = "bfloat16", "float16", "float32"
#: Matched rounds on one set of regions: sizes and dtypes change every round (so a tag left over
#: from an earlier round would be caught as a mismatch), plain and fused interleave, a block
#: count above and below the data, 20000 bf16 elements give block 0 two chunks at NB=2, 70000
#: three chunks to some blocks and two to others at NB=2 and 4 (the pipelined kernel, LAG);
#: the Lamport reduce_scatter with one chunk and with several.
MATCHED = [
    ("all_reduce", 5, BF), ("all_reduce", 4096, BF), ("fused", 3, 40, F16),
    ("all_reduce", 5, BF), ("all_reduce", 20000, BF), ("all_reduce", 300, F32),
    ("all_reduce", 70000, BF), ("reduce_scatter", 999, F16), ("all_reduce", 40000, F32),
    ("reduce_scatter", 40000, BF), ("reduce_scatter", 7, F32),
    ("fused", 5, 16, BF), ("all_reduce", 4096, F16), ("all_reduce", 4096, F16),
]


@pytest.mark.parametrize("W,NB,lag", [(2, 2, 1), (3, 4, 2)])
def test_matched_rounds_sum_and_leave_everything_idle(W, NB, lag):
    """The same sums on every rank, everything idle afterwards (a rank's own slot is never
    written: its own term comes from its operand). The multi-chunk sizes run the pipelined
    kernel with a lag of 1 chunk (the peer backend's) or 2."""
    fails = _run_in_interpreter("simulate_matched", W, NB, MATCHED, lag)
    assert not fails, "\n".join(fails[:20])


A = ("all_reduce", 4096, BF)
MISMATCHES = {  # name: the other rank's call (rank 0 calls A)
    "sizes": ("all_reduce", 8192, BF),
    "fewer-blocks": ("all_reduce", 300, BF),
    "dtypes": ("all_reduce", 4096, F16),
    "dtype-widths": ("all_reduce", 4096, F32),
    "same-bytes": ("all_reduce", 2048, F32),
    "fused-vs-plain": ("fused", 64, 64, BF),
    "pipelined": ("all_reduce", 70000, BF),     # several chunks per block (LAG)
    "reduce-scatter": ("reduce_scatter", 4096, BF),     # the same count, another op
}


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_mismatch_is_reported_on_every_rank(name):
    from llcomm.runtime import protocol as P
    other = MISMATCHES[name]
    seen = _run_in_interpreter("simulate_mismatch", 2, 4, A, [A, other])
    other_op = {"all_reduce": P.OP_LAMPORT, "reduce_scatter": P.OP_LAMPORT_REDUCE_SCATTER,
                "fused": P.OP_FUSED_LAMPORT}[other[0]]
    ops = [P.OPS[P.OP_LAMPORT], P.OPS[other_op]]
    for r in range(2):
        assert seen[r] == ["CommMismatchError", ops[r], P.PHASES[P.PHASE_DATA], [1 - r]], (r, seen)


def test_fused_row_shapes_mismatch():
    """Same element count, other row length: the fused tag mixes in ``hidden``."""
    from llcomm.runtime import protocol as P
    warm = ("fused", 2, 8, BF)
    seen = _run_in_interpreter("simulate_mismatch", 2, 3, warm, [("fused", 2, 8, BF),
                                                                  ("fused", 4, 4, BF)])
    for r in range(2):
        assert seen[r] == ["CommMismatchError", P.OPS[P.OP_FUSED_LAMPORT],
                           P.PHASES[P.PHASE_DATA], [1 - r]], (r, seen)


def test_mismatch_names_the_first_disagreeing_source():
    """W = 3, rank 2 disagrees: ranks 0 and 1 name rank 2; rank 2 names rank 0 (its first
    source) and waits for nobody after it."""
    from llcomm.runtime import protocol as P
    seen = _run_in_interpreter("simulate_mismatch", 3, 2, A, [A, A, ("all_reduce", 4104, BF)])
    want = [[2], [2], [0]]
    for r in range(3):
        assert seen[r] == ["CommMismatchError", P.OPS[P.OP_LAMPORT], P.PHASES[P.PHASE_DATA],
                           want[r]], (r, seen)


@pytest.mark.parametrize("spec", [A, ("all_reduce", 70000, BF), ("reduce_scatter", 70000, BF)],
                         ids=["one-chunk", "pipelined", "reduce-scatter"])
def test_rank_that_never_pushed_is_a_timeout(spec):
    from llcomm.runtime import protocol as P
    seen = _run_in_interpreter("simulate_mismatch", 2, 4, A, [spec, spec], [0])
    op = P.OP_LAMPORT_REDUCE_SCATTER if spec[0] == "reduce_scatter" else P.OP_LAMPORT
    assert seen[0] == ["CommTimeoutError", P.OPS[op], P.PHASES[P.PHASE_DATA], [1]]


@pytest.mark.parametrize("spec", [A, ("all_reduce", 70000, BF), ("reduce_scatter", 4096, F32),
                                  ("fused", 16, 64, BF)],
                         ids=["one-chunk", "pipelined", "reduce-scatter", "fused"])
def test_failed_wait_poisons_the_outputs(spec):
    """Rank 1 never pushed: rank 0 times out and every element of its outputs (fused: out and
    residual_out) is POISON_BITS, a NaN, where it held PREFILL; rank 1, which got rank 0's
    data, has its result."""
    seen = _run_in_interpreter("simulate_failed_outputs", 2, 4, spec, [spec, spec], [0])
    assert seen == [["CommTimeoutError", True], [None, False]], seen


def test_mismatch_poisons_the_outputs_on_every_rank():
    seen = _run_in_interpreter("simulate_failed_outputs", 2, 4, A, [A, ("fused", 64, 64, BF)])
    assert seen == [["CommMismatchError", True]] * 2, seen


def test_lamport_slot_setting(monkeypatch):
    """LLCOMM_LAMPORT_BYTES: 16 MiB at 2 ranks and 1 MiB elsewhere by default; anything but a
    positive integer refused by name."""
    from llcomm.runtime.settings import TPSettings
    monkeypatch.delenv("LLCOMM_LAMPORT_BYTES", raising=False)
    assert (TPSettings.read(2).lamport_bytes, TPSettings.read(4).lamport_bytes) == \
        (16 << 20, 1 << 20)
    monkeypatch.setenv("LLCOMM_LAMPORT_BYTES", "4096")
    assert TPSettings.read(2).lamport_bytes == TPSettings.read(8).lamport_bytes == 4096
    for bad in ("0", "-1", "1M", ""):
        monkeypatch.setenv("LLCOMM_LAMPORT_BYTES", bad)
        with pytest.raises(ValueError, match="LLCOMM_LAMPORT_BYTES"):
            TPSettings.read(2)


def test_lamport_lag_only_with_several_chunks():
    """LAG is LAMPORT_LAG where some block has two chunks or more, else 0 (the single-chunk
    kernel)."""
    from llcomm.tp.peer import LAMPORT_LAG, lamport_lag
    assert LAMPORT_LAG == 1
    assert lamport_lag(n=128 * 2048, block=2048, nb=128) == 0      # one chunk each
    assert lamport_lag(n=128 * 2048 + 1, block=2048, nb=128) == 1  # block 0 has two
    assert lamport_lag(n=4 << 20, block=2048, nb=128) == 1

"""Random EP call sequences (``llcomm.bench.ep_sequences``) on the CPU.

- The generator: deterministic per seed, legal (``check_legal``) over many seeds, and covering
  every feature (both hook kinds, deferred hooks, each format, carried weights, zero copy, a
  handle combined twice, two outstanding handles, delays); ``check_legal`` itself refuses
  illegal sequences.
- The runner's checks can fail: a buffer that hands back one wrong element of a combine, or of
  a dispatch, is reported (reference backend, two gloo processes).
- The sequences on the real EP kernels: two virtual ranks under ``TRITON_INTERPRET=1``, each an
  ``EPBuffer`` (and a ``deep_ep.Buffer`` over it) whose peer backend is a ``PeerEP`` bound to
  plain CPU regions laid out by ``ep_layout`` (their addresses the peer table), launching
  through the interpreter; the ranks run their whole sequences at once, one thread each
  (``_interp.run_ranks``: bounded waits read the host clock), with random sleeps on one rank
  between steps and between send halves and hooks (far below the wait bound). Every dispatch
  and combine is checked by ``ep_seqrun`` against its oracle, bit for bit (fp32 and fp16, where
  the interpreter rounds as the GPU does; docs in ``test_ep_kernels_cpu``).
"""
from __future__ import annotations

import collections
import time

import pytest
import torch

from _interp import run_in_interpreter
from llcomm.bench import ep_sequences as S

#: Wait bound of the virtual ranks (ms): the interpreter is slow, a CI machine loaded.
VIRTUAL_TIMEOUT_MS = 120_000
#: Sleeps on the slow rank, at most (s): far below the bound, long next to a kernel's run.
VIRTUAL_MAX_DELAY_S = 0.2


# -- the generator ------------------------------------------------------------------------------
def _features(seq) -> collections.Counter:
    c = collections.Counter()
    live = 0
    for s in seq.steps:
        if isinstance(s, S.Dispatch):
            c[s.fmt] += 1
            c["dispatch hook"] += s.hook
            c["deferred hook"] += s.defer_hook
            c["carry"] += s.carry
            c["delay"] += s.delay_s > 0 or s.hook_delay_s > 0
            c["full"] += max(s.tokens) == seq.max_tokens
            c["empty"] += min(s.tokens) == 0
            live += 1
            c["two outstanding"] += live == 2
        else:
            c["combine hook"] += s.hook
            c["zero copy"] += s.zero_copy
            live = 0
    return c


@pytest.mark.parametrize("api", S.APIS)
def test_generator_is_legal_deterministic_and_covers_every_feature(api):
    kw = dict(api=api, world=2, max_tokens=6, hidden=512, num_experts=8)
    total = collections.Counter()
    twice = 0
    for seed in range(300):
        seq = S.generate(seed, **kw)
        assert not S.check_legal(seq), (seed, S.check_legal(seq), seq.describe())
        assert S.generate(seed, **kw) == seq
        assert len(seq.steps) >= S.DEFAULT_STEPS
        total += _features(seq)
        handles = [s.handle for s in seq.steps if isinstance(s, S.Combine)]
        twice += len(handles) > len(set(handles))
    want = {"bf16", "fp8", "round_scale", "dispatch hook", "deferred hook", "combine hook",
            "delay", "full", "empty", "two outstanding"}
    want |= {"ue8m0", "zero copy"} if api == "deep_ep" else {"carry"}
    assert all(total[k] > 0 for k in want), total
    assert not any(total[k] for k in ({"ue8m0", "zero copy", "carry"} - want)), total
    assert twice > 0
    assert S.generate(1, **kw) != S.generate(2, **kw)
    # no FP8 where hidden is not a multiple of 128, no UE8M0 below 512
    for seed in range(50):
        for hidden, banned in ((96, {"fp8", "round_scale", "ue8m0"}), (256, {"ue8m0"})):
            seq = S.generate(seed, **dict(kw, hidden=hidden))
            assert not {d.fmt for d in seq.dispatches()} & banned


def test_check_legal_refuses_illegal_sequences():
    def D(h, **k):
        return S.Dispatch(**dict(dict(handle=h, seed=h, tokens=(1, 1), topk=2, fmt="bf16",
                                      carry=False, hook=False, defer_hook=False), **k))

    def C(h, **k):
        return S.Combine(**dict(dict(handle=h, seed=h, zero_copy=False, hook=False), **k))

    def seq(api, *steps):
        return S.Sequence(0, api, 2, 4, 512, 0, list(steps))

    assert not S.check_legal(seq("deep_ep", D(0), D(1), C(1), C(0, zero_copy=True), C(0)))
    cases = {
        "retired": seq("ep", D(0), D(1), D(2), C(2), C(1), C(0)),
        "uncombined": seq("ep", D(0), D(1), C(1)),
        "three times": seq("ep", D(0), C(0), C(0), C(0)),
        "zero copy via ep": seq("ep", D(0), C(0, zero_copy=True)),
        "ue8m0 via ep": seq("ep", D(0, fmt="ue8m0"), C(0)),
        "carry via deep_ep": seq("deep_ep", D(0, carry=True), C(0)),
        "too many tokens": seq("ep", D(0, tokens=(5, 1)), C(0)),
        "deferred onto own combine": seq("ep", D(0, hook=True, defer_hook=True), C(0)),
    }
    for name, s in cases.items():
        assert S.check_legal(s), name


# -- the runner's checks fail on a wrong result (reference backend) ---------------------------
class _Corrupting:
    """An EPBuffer whose ``what`` ("dispatch" or "combine") results get one element wrong."""

    def __init__(self, buf, what):
        self._buf, self._what = buf, what

    def __getattr__(self, name):
        return getattr(self._buf, name)

    def dispatch(self, *a, **k):
        got = self._buf.dispatch(*a, **k)
        if self._what == "dispatch" and not k.get("return_recv_hook") and int(got[1].sum()):
            e = int(got[1].nonzero()[0])        # the first row of an expert that got one
            rows = got[0][0] if isinstance(got[0], tuple) else got[0]
            rows[e, 0].view(torch.uint8)[0] ^= 1
        return got

    def combine(self, *a, **k):
        got = self._buf.combine(*a, **k)
        out = got[0] if k.get("return_recv_hook") else got
        if self._what == "combine" and out.numel() and not k.get("return_recv_hook"):
            out.view(-1)[out.numel() // 2] += 1
        return got


def _corrupted_runs(rank, world):
    from llcomm.bench.ep_seqrun import SequenceRunner
    from llcomm.ep import EPBuffer
    got = {}
    for what in ("dispatch", "combine", None):
        buf = EPBuffer(num_experts=8, hidden=128, num_max_dispatch_tokens_per_rank=4,
                       backend="reference")
        r = SequenceRunner(_Corrupting(buf, what), rank, world, num_experts=8,
                           dtype=torch.bfloat16, device="cpu")
        fails = []
        for seed in range(3):
            fails += r.run(S.generate(seed, api="ep", world=world, max_tokens=4, hidden=128,
                                      num_experts=8, max_delay_s=0.0))
        got[what] = fails
    return got


def test_runner_reports_a_wrong_dispatch_and_a_wrong_combine():
    from _dist import run_distributed
    for got in run_distributed(_corrupted_runs, 2, backend="gloo", timeout=300):
        assert not got[None], got[None]
        assert any(" dispatch " in f for f in got["dispatch"]), got["dispatch"]
        assert any(" combine " in f for f in got["combine"]), got["combine"]
        assert not any(" combine " in f for f in got["dispatch"]), got["dispatch"]


# -- the real kernels on two virtual ranks (in the interpreter process) -------------------------
def _virtual_buffers(W, E, T, H, dtype, NB, ll, masks, sends_in_flight=1):
    """W ``EPBuffer``s on the peer backend over plain CPU regions, launching through the
    interpreter (``PeerEP.__init__``'s state, without GPUs or a group)."""
    from llcomm.ep import kernels
    from llcomm.ep.api import EPBuffer
    from llcomm.ep.inflight import SendsInFlight
    from llcomm.ep.layout import ARM_BYTE, ERR_PROF, MAX_TOPK, PROF_WORDS, ep_layout, num_sets
    from llcomm.ep.peer import PeerEP, dispatch_kernel, kernel_consts, ll_row_consts
    from llcomm.runtime import protocol as P
    from llcomm.runtime.settings import EPSettings
    from test_flag_kernels_cpu import InterpreterLauncher

    cpu = torch.device("cpu")
    lay = ep_layout(T, H, W, E, torch.tensor([], dtype=dtype).element_size(), num_blocks=NB,
                    sets=num_sets(sends_in_flight))
    regions = [torch.zeros(lay.total_bytes, dtype=torch.uint8) for _ in range(W)]
    for region in regions:                          # as EPBuffer arms them
        for a, b in lay.armed_ranges():
            region[a:b] = ARM_BYTE
    tab = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64)
    L = E // W
    bufs = []
    for r in range(W):
        b = EPBuffer.__new__(EPBuffer)
        b.group, b.rank, b.num_ranks, b.settings = None, r, W, EPSettings.read()
        b.timeout_ms, b.num_experts, b.num_local_experts = VIRTUAL_TIMEOUT_MS, E, L
        b.hidden, b.max_tokens, b.dtype, b.fp8, b.enable_masks = H, T, dtype, False, masks
        b._dispatches = b._combines = 0
        b.sends_in_flight, b._inflight = sends_in_flight, SendsInFlight(sends_in_flight)
        b.handle_slots = b._inflight.slots
        b._closed, b._combine_inputs = False, [None] * b.handle_slots
        b.backend, b.device, b.check_calls = "peer", cpu, True
        p = PeerEP.__new__(PeerEP)
        p.k, p.rank, p.W, p.device, p.settings, p.nb, p.layout, p.buf = (
            kernels, r, W, cpu, b.settings, NB, lay, b)
        p.timeout_us, p.ws, p.tab = VIRTUAL_TIMEOUT_MS * 1000, None, tab
        p.regions = regions                         # alive while the table points at them
        p.ll = 0 if masks else ll
        p.dispatch_kernel, p.combine_kernel = dispatch_kernel(p.ll), kernels.combine_kernel
        p._rows = [ll_row_consts(lay, f) for f in range(3)]
        p.ctrl = torch.zeros((2, NB) if sends_in_flight == 1 else (2, 2, NB), dtype=torch.int64)
        p._ctrl = (p.ctrl[0], p.ctrl[1])
        p._host = torch.zeros(2, dtype=torch.int64)
        p._host_np = p._host.numpy()
        p.masks, p.profile = int(masks), 0
        p.err = torch.zeros(ERR_PROF + 2 * NB * PROF_WORDS, dtype=torch.int64)
        p.err[1:3] = torch.tensor([p._host.data_ptr(), p._host.data_ptr() + 8])
        p._slot_words = (W * T * MAX_TOPK, L * W * T, L, W)
        p.slots = [torch.zeros(sum(p._slot_words), dtype=torch.int32)
                   for _ in range(b.handle_slots)]
        p._failure = P.FailureLatch(r, "EPBuffer")
        p._launch = InterpreterLauncher()
        p._call_consts, p._slot_views, p._tags = {}, {}, {}
        p.num_warps = kernel_consts(lay, 1, b.settings)[2]
        b._impl = p
        bufs.append(b)
    return bufs


def _deep_ep_over(ep):
    """A ``deep_ep.Buffer`` whose EPBuffer is ``ep`` (the peer backend's, through the
    interpreter: its dispatch writes DeepEP's layouts)."""
    from llcomm.deep_ep import convert
    from llcomm.deep_ep.buffer import Buffer
    d = Buffer.__new__(Buffer)
    d.group, d.rank, d.group_size = None, ep.rank, ep.num_ranks
    d.num_nvl_bytes = d.num_rdma_bytes = 0
    d.low_latency_mode, d.explicitly_destroy, d.enable_shrink = True, False, False
    d._backend, d._timeout_ms, d._early_mask, d._destroyed = "peer", ep.timeout_ms, 0, False
    d._ep, d._dispatches, d._handle_outputs, d._scales, d._local = ep, 0, {}, {}, None
    d._aux = convert.layout_aux(ep.num_local_experts, ep.num_ranks * ep.max_tokens,
                                ep.max_tokens, ep.num_ranks, ep.device)
    return d


def simulate_sequences(api, W, E, T, H, dtype_name, NB, ll, masks, seeds, steps):
    """Sequences ``seeds`` of ``api`` on W virtual ranks at once; returns (failures, dispatches
    and combines checked on rank 0, seconds)."""
    import torch
    from _interp import run_ranks
    from llcomm.bench.ep_seqrun import SequenceRunner

    import triton.language as tl
    # the waits' static asserts AND a bool with a constexpr, which this interpreter's constexpr
    # cannot take from the right (compiled kernels fold it before); only these processes
    if not hasattr(tl.constexpr, "__rand__"):
        tl.constexpr.__rand__ = lambda self, other: tl.constexpr(
            other & tl.core._unwrap_if_constexpr(self))
    dtype = getattr(torch, dtype_name)
    bufs = _virtual_buffers(W, E, T, H, dtype, NB, ll, masks)
    if api == "deep_ep":
        bufs = [_deep_ep_over(b) for b in bufs]
    runners = [SequenceRunner(b, r, W, num_experts=E, dtype=dtype, device="cpu")
               for r, b in enumerate(bufs)]
    seqs = [S.generate(seed, api=api, world=W, max_tokens=T, hidden=H, num_experts=E,
                       max_topk=4, steps=steps, max_delay_s=VIRTUAL_MAX_DELAY_S)
            for seed in seeds]

    def rank_fn(r):
        return lambda: [f for seq in seqs for f in runners[r].run(seq)]

    t0 = time.monotonic()
    fails = [f"rank {r}: {f}" for r, fs in enumerate(run_ranks([rank_fn(r) for r in range(W)],
                                                              timeout=900)) for f in fs]
    return fails, runners[0].dispatches, runners[0].combines, time.monotonic() - t0


#: api, W, E, T, H, dtype, NB, LL dispatch, rank masks (the flag dispatch), seeds, steps. One
#: block per rank: the interpreter runs a launch's blocks one after another, and a block that
#: waits for a later block's flags (every block waits for all of them) would wait for ever.
VIRTUAL_CASES = [
    ("ep", 2, 8, 5, 128, "float32", 1, 1, False, [11, 12], 8),
    ("ep", 2, 8, 5, 128, "float16", 1, 0, True, [21, 22], 8),
    ("deep_ep", 2, 4, 4, 512, "float32", 1, 1, False, [31, 32], 8),
]


@pytest.mark.parametrize("case", VIRTUAL_CASES,
                         ids=[f"{c[0]}-{c[5]}-{'masks' if c[8] else 'll' if c[7] else 'flag'}"
                              for c in VIRTUAL_CASES])
def test_random_sequences_on_virtual_ranks_in_interpreter(case):
    fails, dispatches, combines, secs = run_in_interpreter(
        "test_ep_sequences_cpu", "simulate_sequences", *case)
    assert not fails, "\n".join(fails[:20])
    assert dispatches >= len(case[9]) * case[10] // 3 and combines >= dispatches, \
        (dispatches, combines)

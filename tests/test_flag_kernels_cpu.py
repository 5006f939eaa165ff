"""The flag kernels on the CPU: ``one_shot_kernel`` and ``two_shot_kernel`` (all_reduce),
``broadcast_kernel``, ``all_gather_kernel`` (movement), ``reduce_scatter_kernel``
(reduce_scatter) and the flag protocol they share (``signal_peers`` / ``wait_peers``), under
``TRITON_INTERPRET=1`` on virtual ranks.

Each virtual rank is a ``peer.PeerBackend`` whose workspace regions (flags, staging, gather)
are plain CPU tensors laid out as its constructor lays them out, the tables of their addresses
playing the peer tables; its own op code (plans, tags, word views, shards, launch arguments)
runs unchanged and launches through the interpreter. A flag kernel signals and then waits for
every peer, so the ranks' launches run at once, one thread per rank (``_interp.run_ranks``,
which also gives the interpreter the GPU clock the bounded waits read). Checked:

- matched rounds on one workspace (sizes and dtypes that change every round, 1 and 4099
  elements, blocks without data, blocks that loop, a call repeated so only the epoch tells the
  rounds apart): all_reduce by one_shot and two_shot is the fp32 sum of every rank's fresh
  random operand in rank order, rounded once, the same bits on every rank; broadcast from
  every root, all_gather (contiguous and 2-D) and reduce_scatter are byte-exact against torch;
  outputs are poisoned before every call, inputs unchanged, no error word, every op counter
  equal to the rounds run;
- the movement ops on every kind of dtype (int64, int16, int8, bool, float8, float64: int32
  word views, and uint8 views for odd byte counts), byte-exact, with LL off and on (4-byte
  words up to the LL size run the LL kernel through the same host code, the rest the flag
  kernels);
- ranks that disagree about the call (size, dtype, op, row shape; dtypes of the same bytes;
  as many words of another width): every rank's error word is
  a mismatch of its own op at the entry barrier naming the ranks that disagree, and its output
  (pre-filled with ``_payloads.POISON_BYTE``, a valid-looking value) is all POISON_BITS bytes
  (0xFF);
- a rank that never launches: its peers' error words are a timeout naming it (at the entry
  barrier, after a round whose same-tag words of an older epoch are still in the flags), the
  wait ended after the bound and not long after, its output all 0xFF bytes; a peer that stops
  between two_shot's barriers is a timeout at the exit barrier, and the waiting rank's output is
  0xFF bytes (its own shard too); a peer's word of a later epoch counts as arrived.
"""
from __future__ import annotations

import pytest

from _interp import run_in_interpreter, run_ranks
from _payloads import payload
from llcomm.tp import peer                                  # PeerBackend and its region layout
from llcomm.runtime import protocol as P                     # op / phase codes, decode_error
from llcomm.tp.kernels import (all_reduce, lamport_all_reduce, ll, movement,  # its kernels
                               reduce_scatter)

BF, F32 = "bfloat16", "float32"
#: Every byte of a failed call's output (protocol.POISON_BITS, all bits set).
FAILED_BYTE = P.POISON_BITS & 0xFF
#: Bound of the device waits in matched rounds and mismatches: long enough for any peer thread
#: of a loaded CPU to arrive (a mismatch is seen as soon as the peer's word arrives).
LONG_US = 10_000_000


class InterpreterLauncher:
    """``launch.Launcher``'s two entry points on Triton's own launch path, which is the
    interpreter here (no compiled-kernel cache, no CUDA stream, no first-launch bound).
    ``launched``: the name of every kernel launched, in order."""

    def __init__(self):
        self.launched = []

    def __call__(self, fn, grid, args, num_warps, **consts):
        self.launched.append(fn.__name__)
        fn[(grid,)](*args, num_warps=num_warps, **consts)

    def run(self, plan, *ts):
        ts = tuple(t if v is None else t.view(v) for t, v in zip(ts, plan.views))
        self(plan.fn, plan.grid, (*ts, *plan.tail), plan.num_warps, **plan.consts)


class VirtualPeers:
    """W virtual ranks: per rank the flags, staging and gather regions (sized as
    ``PeerBackend.__init__`` sizes them), private op counters and error words, and a
    ``PeerBackend`` bound to them with the Lamport reduce_scatter off and LL off (so every op
    runs its flag kernel) unless ``ll_bytes`` is given: then broadcasts and all-gathers of
    whole 4-byte words up to that size run the LL kernel, in the LL words and Lamport tag
    words ``PeerBackend.__init__`` would give it."""

    def __init__(self, W: int, NB: int, max_bytes: int, timeout_us: int = LONG_US,
                 ll_bytes: int = 0):
        import torch

        self.W, self.NB = W, NB
        cap_bytes = (max_bytes + 255) // 256 * 256
        ll_bytes = min(ll_bytes, peer.ll_bytes(max_bytes)) // 4 * 4
        sizes = {"flags": 8 * peer.FLAG_PHASES * NB * W, "stage": peer.HALVES * W * cap_bytes,
                 "gather": peer.HALVES * cap_bytes,
                 "ll": peer.HALVES * W * ll_bytes // 4 * peer.LL_WORD_BYTES,
                 "lamport_tags": peer.HALVES * NB * W * peer.LAMPORT_TAG_BYTES}
        self.regions = {k: [torch.zeros(v, dtype=torch.uint8) for _ in range(W)]
                        for k, v in sizes.items()}
        tabs = {k: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)
                for k, ts in self.regions.items()}
        self.host = [torch.zeros(1, dtype=torch.int64) for _ in range(W)]
        self.ranks = []
        for r in range(W):
            b = peer.PeerBackend.__new__(peer.PeerBackend)  # its __init__ needs GPUs and a group
            b.rank, b.world_size, b.nb, b.WP = r, W, NB, 1 << (W - 1).bit_length()
            b.max_bytes, b.cap_bytes, b.timeout_us = max_bytes, cap_bytes, timeout_us
            b.rs_lamport_bytes = b.lamport_bytes = 0
            b.ll_bytes = ll_bytes
            b._k_ar, b._k_mv, b._k_rs, b._k_ll, b._k_lam = (all_reduce, movement, reduce_scatter,
                                                             ll, lamport_all_reduce)
            b._plans, b.tabs = {}, tabs
            b.flags = self.regions["flags"][r].view(torch.int64)
            ctrl = torch.zeros(NB + peer.CTRL_ERR_WORDS, dtype=torch.int64)
            b.ctrl, b.err = ctrl[:NB], ctrl[NB:]
            b.err[1] = self.host[r].data_ptr()
            b._err, b._err_np = self.host[r], self.host[r].numpy()
            b._failure = P.FailureLatch(r, "communicator")
            b._launch = InterpreterLauncher()
            self.ranks.append(b)

    def error(self, r: int):
        """Rank r's error word decoded: [exception type, op, phase, ranks], or None."""
        e = P.decode_error(int(self.host[r][0]), r)
        return None if e is None else [type(e).__name__, e.op, e.phase, list(e.ranks)]


# -- one call of one rank ------------------------------------------------------------------------
def _dtype(name):
    import torch
    return getattr(torch, name)


def _poisoned(shape, dtype):
    from _payloads import poisoned
    return poisoned(shape, dtype)


def _numbers(spec, seed: int, rank: int, shape, dtype):
    """Fresh operand of one rank: normal floats for the sums; for the byte-exact movement,
    ``_payloads.payload`` (any bit pattern: NaN payloads, -0.0, subnormals, every float8
    pattern, bools 0 / 1)."""
    import zlib

    import torch
    key = (tuple(spec), seed, rank)
    if spec[0] in ("one_shot", "two_shot", "reduce_scatter"):
        g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
        return torch.randn(shape, generator=g).to(dtype)
    return payload(dtype, shape, key)


class Call:
    """Rank ``rank``'s call of ``spec``: ``("one_shot" | "two_shot", n, dtype)``,
    ``("broadcast", n, dtype, src)``, ``("all_gather", n, dtype)``, ``("all_gather_2d", rows,
    cols, dtype)`` or ``("reduce_scatter", m, dtype)`` (m elements out, W * m in)."""

    def __init__(self, spec, seed: int, rank: int, W: int):
        self.spec, self.kind, self.rank = tuple(spec), spec[0], rank
        dtype = _dtype(spec[3] if self.kind == "all_gather_2d" else spec[2])
        shape = {"all_gather_2d": (spec[1], spec[2]),
                 "reduce_scatter": (W * spec[1],)}.get(self.kind, (spec[1],))
        self.x = _numbers(spec, seed, rank, shape, dtype)
        self.x0 = self.x.clone()
        if self.kind == "broadcast" and rank != spec[3]:
            self.x = _poisoned(shape, dtype)
        out_shape = {"all_gather": (W * spec[1],), "all_gather_2d": (spec[1], W * spec[2]),
                     "reduce_scatter": (spec[1],), "broadcast": (0,)}.get(self.kind, shape)
        self.out = _poisoned(out_shape, dtype)

    def run(self, b) -> None:
        if self.kind in ("one_shot", "two_shot"):
            b.all_reduce(self.x, self.out, self.kind)
        elif self.kind == "broadcast":
            b.broadcast(self.x, self.spec[3])
        elif self.kind == "all_gather":
            b.all_gather(self.x, self.out)
        elif self.kind == "all_gather_2d":
            b.all_gather_2d(self.x, self.out)
        else:
            b.reduce_scatter(self.x, self.out)

    def result(self):
        return self.x if self.kind == "broadcast" else self.out

    def poisoned(self) -> bool:
        """A failed call's output: every byte 0xFF (protocol.POISON_BITS), none of the
        pre-fill left; broadcast's root keeps its operand."""
        import torch
        if self.kind == "broadcast" and self.rank == self.spec[3]:
            return _same_bits(self.x, self.x0)
        got = self.result().reshape(-1).view(torch.uint8)
        return bool((got == FAILED_BYTE).all())


def _same_bits(a, b) -> bool:
    import torch
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                              b.reshape(-1).view(torch.uint8))


def _rounded_once(got, acc) -> bool:
    """``got`` is the fp32 ``acc`` rounded once to got's dtype, element by element: to nearest
    even (the GPU) or, for bf16, toward zero (the interpreter truncates fp32 -> bf16)."""
    import torch
    if got.dtype == torch.float32:
        return _same_bits(got, acc)
    g = got.view(torch.int16)
    near = acc.to(got.dtype).view(torch.int16)
    ok = g == near
    if got.dtype == torch.bfloat16:
        ok |= g == (acc.view(torch.int32) >> 16).to(torch.int16)
    return bool(ok.all())


def check_round(calls) -> list[str]:
    """What is wrong with one matched round's results (empty: nothing)."""
    import torch
    fails = []
    kind, spec = calls[0].kind, calls[0].spec
    for r, c in enumerate(calls):
        where = f"{spec} rank {r}"
        if kind != "broadcast" and not _same_bits(c.x, c.x0):
            fails.append(f"{where}: the input changed")
        if kind in ("one_shot", "two_shot", "reduce_scatter"):
            acc = torch.zeros(c.x.shape)
            for o in calls:                         # fp32, in rank order
                acc += o.x0.float()
            if kind == "reduce_scatter":
                m = spec[1]
                acc = acc[r * m:(r + 1) * m]
            if not _rounded_once(c.out, acc):
                fails.append(f"{where}: not the rank-order fp32 sum rounded once")
            if kind != "reduce_scatter" and not _same_bits(c.out, calls[0].out):
                fails.append(f"{where}: other bits than rank 0")
        elif kind == "broadcast":
            if not _same_bits(c.x, calls[spec[3]].x0):
                fails.append(f"{where}: not the root's bytes")
        else:
            rows = spec[1] if kind == "all_gather_2d" else 1
            want = torch.cat([o.x0.reshape(rows, -1).view(torch.uint8) for o in calls], 1)
            if not torch.equal(c.out.reshape(rows, -1).view(torch.uint8), want):
                fails.append(f"{where}: not the ranks' bytes in rank order")
    return fails


def _nbytes(spec) -> int:
    """Bytes of one rank's operand (what a staging slot must hold)."""
    n = spec[1] * spec[2] if spec[0] == "all_gather_2d" else spec[1]
    return n * _dtype(spec[-2] if spec[0] == "broadcast" else spec[-1]).itemsize


def _launch_round(V: VirtualPeers, specs, seed: int):
    """Rank r calls specs[r] (None: it does not launch), all ranks at once. Returns the calls
    and each launching rank's seconds in its call."""
    import time
    calls = [None if s is None else Call(s, seed, r, V.W) for r, s in enumerate(specs)]

    def rank_fn(r):
        def go():
            t0 = time.monotonic()
            calls[r].run(V.ranks[r])
            return time.monotonic() - t0
        return go
    secs = run_ranks([rank_fn(r) for r, c in enumerate(calls) if c is not None])
    return calls, secs


# -- run in the interpreter process --------------------------------------------------------------
def simulate_matched(W, NB, rounds, ll_bytes=0):
    """Matched rounds (every rank calls ``rounds[i]``) on one set of workspaces (LL on up to
    ``ll_bytes``); returns the failures and, per round, the kernels rank 0 launched."""
    V = VirtualPeers(W, NB, max(_nbytes(s) for s in rounds), ll_bytes=ll_bytes)
    fails, kernels = [], []
    for i, spec in enumerate(rounds):
        launched = V.ranks[0]._launch.launched
        before = len(launched)
        calls, _ = _launch_round(V, [spec] * W, seed=i)
        kernels.append(launched[before:])
        fails += [f"round {i}: {f}" for f in check_round(calls)]
        fails += [f"round {i} {spec} rank {r}: error word {V.error(r)}" for r in range(W)
                  if V.error(r)]
    fails += [f"rank {r}: op counters {b.ctrl.tolist()}" for r, b in enumerate(V.ranks)
              if b.ctrl.tolist() != [len(rounds)] * NB]
    return fails, kernels


def simulate_faulty(W, NB, warmup, specs, timeout_us):
    """``warmup`` matched rounds, then one round where rank r calls specs[r] (None: it never
    launches) with waits bounded by ``timeout_us``. Returns per launching rank [its error word
    decoded, seconds in its call, whether its output is poisoned]; None for the others."""
    V = VirtualPeers(W, NB, max(_nbytes(s) for s in [*warmup, *specs] if s), timeout_us)
    for i, spec in enumerate(warmup):   # its results are test_matched_rounds' business
        _launch_round(V, [spec] * W, seed=i)
        assert not any(map(V.error, range(W))), "an error in the warm-up"
    calls, secs = _launch_round(V, specs, seed=len(warmup))
    secs = iter(secs)
    return [None if c is None else [V.error(r), next(secs), c.poisoned()]
            for r, c in enumerate(calls)]


def two_shot_exit_timeout(n, timeout_us):
    """Rank 0 of 2 runs two_shot (fp32, TIMEOUT_NB blocks); rank 1 is a peer that arrived at
    the entry barrier (its flag words; its shard in rank 0's staging is left zero) and then
    stopped. Returns rank 0's error word decoded, the seconds of its call and whether its
    output is poisoned."""
    import time
    V = VirtualPeers(2, TIMEOUT_NB, n * 4, timeout_us)
    tag = P.size_tag(P.OP_TWO_SHOT, n, "float32")
    V.ranks[0].flags.view(V.NB * peer.FLAG_PHASES, 2)[:V.NB, 1] = (1 << P.EPOCH_SHIFT) | tag
    c = Call(("two_shot", n, F32), 0, 0, 2)
    t0 = time.monotonic()
    run_ranks([lambda: c.run(V.ranks[0])])
    return [V.error(0), time.monotonic() - t0, c.poisoned()]


def later_epoch_arrives(n):
    """Rank 0 of 2 runs its first one_shot (epoch 1) where rank 1's flag words already hold
    epoch 2 with another tag (rank 1 finished this op and signalled its next one over the same
    slot). Returns rank 0's error word decoded and its op counters."""
    V = VirtualPeers(2, 2, n * 4, 1_000_000)
    word = (2 << P.EPOCH_SHIFT) | P.size_tag(P.OP_ALL_GATHER, 7, "int32")
    V.ranks[0].flags.view(V.NB * peer.FLAG_PHASES, 2)[:V.NB, 1] = word
    c = Call(("one_shot", n, F32), 0, 0, 2)
    run_ranks([lambda: c.run(V.ranks[0])])
    return [V.error(0), V.ranks[0].ctrl.tolist()]


def started_after_failure(n):
    """Two ranks run a matched one_shot (fp32) whose waits all succeed, but rank 0's device
    error word is already set (an earlier op failed; its host copy not yet read). Returns per
    rank [whether its output is poisoned, whether it holds the sum]."""
    V = VirtualPeers(2, 2, n * 4, LONG_US)
    V.ranks[0].err[0] = P.STATUS_TIMEOUT << 48
    calls, _ = _launch_round(V, [("one_shot", n, F32)] * 2, seed=0)
    want = calls[0].x0.float() + calls[1].x0.float()
    return [[c.poisoned(), _same_bits(c.out, want)] for c in calls]


# -- the tests -------------------------------------------------------------------------------------
def _rounds(W):
    """Matched rounds: sizes and dtypes change every round, 1 and 4099 elements (a partial
    last block, blocks without data), 16389 fp32 (every block loops: 64 KiB over NB blocks of
    16 KiB at NB 2), odd byte counts (uint8 word views) and 4-byte ones (int32), broadcast
    from every root; rounds 1 and 3 (and 2 and 4) make the same call on the same staging half,
    so only the epoch tells them apart."""
    return [("one_shot", 1, BF), ("one_shot", 4099, BF), ("two_shot", 4099, F32),
            ("one_shot", 4099, BF), ("two_shot", 4099, F32), ("two_shot", 1, BF),
            ("one_shot", 16389, F32), ("two_shot", 4099, BF),
            *[("broadcast", 4099, BF, s) for s in range(W)], ("broadcast", 1, BF, W - 1),
            ("all_gather", 1001, BF), ("all_gather", 4099, F32), ("all_gather_2d", 3, 5, BF),
            ("all_gather_2d", 4, 8, F32), ("reduce_scatter", 1, BF),
            ("reduce_scatter", 4099, F32), ("reduce_scatter", 1001, BF), ("one_shot", 5, F32)]


@pytest.mark.parametrize("W,NB", [(2, 2), (3, 3)])
def test_matched_rounds(W, NB):
    fails, _ = run_in_interpreter("test_flag_kernels_cpu", "simulate_matched", W, NB, _rounds(W))
    assert not fails, "\n".join(fails[:20])


def _dtype_rounds(W):
    """Movement of every kind of dtype through ``PeerBackend.broadcast`` / ``all_gather`` /
    ``all_gather_2d`` (its word views and tags): int64 from every root, 1-byte dtypes of odd
    byte counts (uint8 views: 3 int8, 1 bool, rows of 3 bytes), all 256 float8 patterns, float64
    and int16 with NaN-payload and subnormal bit patterns."""
    return [*[("broadcast", 5, "int64", s) for s in range(W)], ("broadcast", 3, "int8", 0),
            ("broadcast", 1, "bool", W - 1), ("broadcast", 7, "float64", 1),
            ("broadcast", 256, "float8_e5m2", 0), ("all_gather", 256, "float8_e4m3fn"),
            ("all_gather", 3, "bool"), ("all_gather", 1, "int8"), ("all_gather", 5, "int16"),
            ("all_gather", 4, "bool"), ("all_gather", 6, "float64"),
            ("all_gather_2d", 3, 3, "int8"), ("all_gather_2d", 2, 2, "float8_e5m2"),
            ("all_gather_2d", 4, 3, "int64"), ("all_gather_2d", 2, 4, "bool"),
            ("broadcast", 4099, "uint8", W - 1)]


#: Rounds of _dtype_rounds whose bytes are whole 4-byte words (LL when it is on), by index.
def _word_rounds(W):
    return [i for i, s in enumerate(_dtype_rounds(W))
            if _nbytes(s) % 4 == 0 and (s[0] != "all_gather_2d" or
                                        s[2] * _dtype(s[3]).itemsize % 4 == 0)]


@pytest.mark.parametrize("W,NB", [(2, 2), (3, 3)])
def test_every_dtype_through_peer_backend(W, NB):
    """Flag kernels (LL off): byte-exact for every dtype, odd byte counts included."""
    fails, kernels = run_in_interpreter("test_flag_kernels_cpu", "simulate_matched", W, NB,
                                        _dtype_rounds(W))
    assert not fails, "\n".join(fails[:20])
    assert all(k and "ll_gather_kernel" not in k for k in kernels), kernels


@pytest.mark.parametrize("W,NB", [(2, 2), (3, 4)])
def test_every_dtype_through_peer_backend_ll(W, NB):
    """LL on (4 KiB): messages of whole 4-byte words run the LL kernel (int32 words of any
    dtype), the others (3 bytes, rows of 3 bytes, over 4 KiB) the flag kernels; all byte-exact
    on the same counters."""
    rounds = _dtype_rounds(W)
    fails, kernels = run_in_interpreter("test_flag_kernels_cpu", "simulate_matched", W, NB,
                                        rounds, 4096)
    assert not fails, "\n".join(fails[:20])
    words = set(_word_rounds(W))
    for i, (spec, k) in enumerate(zip(rounds, kernels)):
        ll_ran = k == ["ll_gather_kernel"]
        assert ll_ran == (i in words and _nbytes(spec) <= 4096), (spec, k)


A = ("one_shot", 4099, BF)
#: name: (W, rank r's call, the op each rank names). Ranks that disagree about the call.
MISMATCHES = {
    "sizes": (2, [A, ("one_shot", 64, BF)], ["one_shot"] * 2),
    "dtypes": (2, [A, ("one_shot", 4099, F32)], ["one_shot"] * 2),
    "one_shot-vs-two_shot": (2, [A, ("two_shot", 4099, BF)], ["one_shot", "two_shot"]),
    "two_shot-sizes": (2, [("two_shot", 4099, BF), ("two_shot", 4000, BF)], ["two_shot"] * 2),
    "all_gather-rows": (2, [("all_gather_2d", 2, 8, F32), ("all_gather_2d", 4, 4, F32)],
                        ["all_gather"] * 2),
    "broadcast-vs-reduce_scatter": (2, [("broadcast", 64, F32, 0), ("reduce_scatter", 64, F32)],
                                    ["broadcast", "reduce_scatter"]),
    "broadcast-roots": (2, [("broadcast", 64, F32, 0), ("broadcast", 64, F32, 1)],
                        ["broadcast"] * 2),
    "all_gather-vs-one_shot-w3": (3, [A, ("all_gather", 4099, BF), A],
                                  ["one_shot", "all_gather", "one_shot"]),
    # the same bytes, other dtypes: a mismatch, as on the reference backend
    "int32-vs-float32": (2, [("broadcast", 64, "int32", 0), ("broadcast", 64, F32, 0)],
                         ["broadcast"] * 2),
    "int8-vs-bool": (2, [("all_gather", 3, "int8"), ("all_gather", 3, "bool")],
                     ["all_gather"] * 2),
    "float8-forms": (2, [("all_gather_2d", 2, 4, "float8_e4m3fn"),
                         ("all_gather_2d", 2, 4, "float8_e5m2")], ["all_gather"] * 2),
    # 8 int8 move as 2 int32 words, 2 int8 as 2 bytes: as many words, other sizes
    "int8-words-vs-bytes": (2, [("all_gather", 8, "int8"), ("all_gather", 2, "int8")],
                            ["all_gather"] * 2),
    "bf16-words-vs-bytes": (2, [("broadcast", 4, BF, 0), ("broadcast", 1, BF, 0)],
                            ["broadcast"] * 2),
    "int64-vs-int32-words": (2, [("broadcast", 4, "int64", 1), ("broadcast", 8, "int32", 1)],
                             ["broadcast"] * 2),
}
_OP = {"one_shot": P.OP_ONE_SHOT, "two_shot": P.OP_TWO_SHOT, "broadcast": P.OP_BROADCAST,
       "all_gather": P.OP_ALL_GATHER, "reduce_scatter": P.OP_REDUCE_SCATTER}
#: name: (W, rank r's call or None: never launches, timeout_us), at NB blocks that all have
#: data. After a matched warm-up of the same call, so the missing rank's words of the previous
#: epoch, same tag, are in the flags.
TIMEOUTS = {
    "one_shot": (2, [("one_shot", 8192, BF), None], 500_000),
    "broadcast-w3": (3, [("broadcast", 4096, F32, 2)] * 2 + [None], 2_000_000),
}
TIMEOUT_NB = 4


def _within_bound(secs: float, bound_us: int, nb: int) -> bool:
    """A call whose first wait ran out: it took the bound, and well under what blocks that
    waited a whole bound each would take (the later ones wait AFTER_FAILURE_US)."""
    bound = bound_us / 1e6
    return bound <= secs < bound * (1 + (nb - 1) / 2)


def simulate_faults(mismatches, timeouts):
    """Every case of MISMATCHES (after a matched round of A) and TIMEOUTS (after a matched
    round of the same call), each on fresh workspaces: name -> ``simulate_faulty``'s answer;
    and the two protocol cases below (``exit`` and ``later-epoch``)."""
    got = {name: simulate_faulty(W, 2, [A], specs, LONG_US)
           for name, (W, specs, _) in mismatches.items()}
    for name, (W, specs, bound) in timeouts.items():
        got[name] = simulate_faulty(W, TIMEOUT_NB, [next(s for s in specs if s)], specs, bound)
    got["exit"] = two_shot_exit_timeout(16384, 500_000)
    got["later-epoch"] = later_epoch_arrives(4099)
    got["after-failure"] = started_after_failure(4099)
    return got


@pytest.fixture(scope="module")
def faults():
    """Every fault case, run in one interpreter process."""
    return run_in_interpreter("test_flag_kernels_cpu", "simulate_faults", MISMATCHES, TIMEOUTS)


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_mismatch_is_reported_on_every_rank(faults, name):
    """Each rank names its own op at the entry barrier and ranks whose call differs from its
    own: all of them where there is one (a rank reports the first disagreeing words it sees,
    so with several it may name some before the others arrive); the output is poisoned."""
    W, specs, ops = MISMATCHES[name]
    seen = faults[name]
    for r in range(W):
        differ = [p for p in range(W) if specs[p] != specs[r]]
        assert seen[r][0], (r, seen)
        (kind, op, phase, ranks), _, poisoned = seen[r]
        assert [kind, op, phase] == ["CommMismatchError", P.OPS[_OP[ops[r]]],
                                     P.PHASES[P.PHASE_ENTRY]], (r, seen)
        assert ranks and set(ranks) <= set(differ) and (len(differ) > 1 or ranks == differ), \
            (r, seen)
        assert poisoned, f"rank {r}: its output after a mismatch is not poisoned"


@pytest.mark.parametrize("name", list(TIMEOUTS))
def test_rank_that_never_launches_is_a_timeout(faults, name):
    """The waiting ranks name the missing one at the entry barrier, within the bound
    (``_within_bound``), and poison their outputs."""
    W, specs, bound = TIMEOUTS[name]
    missing = [r for r, s in enumerate(specs) if s is None]
    seen = faults[name]
    for r in range(W):
        if specs[r] is None:
            continue
        err, secs, poisoned = seen[r]
        assert err == ["CommTimeoutError", P.OPS[_OP[specs[r][0]]], P.PHASES[P.PHASE_ENTRY],
                       missing], (r, seen)
        assert _within_bound(secs, bound, TIMEOUT_NB), (r, secs)
        assert poisoned, f"rank {r}: its output without its peers is not poisoned"


def test_peer_stopped_between_two_shot_barriers_is_an_exit_timeout(faults):
    err, secs, poisoned = faults["exit"]
    assert err == ["CommTimeoutError", P.OPS[P.OP_TWO_SHOT], P.PHASES[P.PHASE_EXIT], [1]], err
    assert _within_bound(secs, 500_000, TIMEOUT_NB), secs
    assert poisoned, "two_shot's output after an exit timeout is not poisoned"


def test_peer_word_of_a_later_epoch_counts_as_arrived(faults):
    err, ctrl = faults["later-epoch"]
    assert err is None and ctrl == [1] * 2, (err, ctrl)


def test_kernel_started_after_a_failure_poisons_its_output(faults):
    """A rank whose error word was set before the kernel began poisons what it computes, even
    though every wait succeeded (its round is not trusted); its peer's sum is unaffected."""
    assert faults["after-failure"] == [[True, False], [False, True]], faults["after-failure"]

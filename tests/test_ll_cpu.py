"""The LL broadcast / all-gather kernel (``kernels/ll.py``) on the CPU, under
``TRITON_INTERPRET=1``, on virtual ranks with regions laid out as ``peer.PeerBackend`` lays them
out (LL words zeroed, Lamport tag words idle at 0).

Each round runs the push half of every rank, then the receive half of every rank (the receive
half alone reads each source once instead of polling the GPU clock). Checked:

- matched rounds (all-gather contiguous and 2-D, broadcast from every root, sizes that change
  from round to round, blocks with and without data, several chunks per block, random 32-bit
  words including NaN payloads): every output is byte-exact, every tag is idle again, no error;
- a stale word is never taken for data: a rank that does not push in a round whose half still
  holds its words of two rounds earlier is a timeout, not an old result;
- ranks that disagree about the size, the row length or the broadcast root: every rank reports
  a mismatch of its own op in the data phase, naming the other.
"""
from __future__ import annotations

import pytest

from _interp import run_in_interpreter


class Regions:
    """W virtual ranks' LL words, Lamport tag words, op counters and error words."""

    def __init__(self, W: int, NB: int, cap: int):
        import torch
        from llcomm.tp import peer

        self.W, self.NB, self.cap = W, NB, cap
        self.words = [torch.zeros(peer.HALVES * W * cap, dtype=torch.int64) for _ in range(W)]
        self.tags = [torch.zeros(peer.HALVES * NB * W, dtype=torch.int32) for _ in range(W)]
        self.ll_tab = torch.tensor([t.data_ptr() for t in self.words], dtype=torch.int64)
        self.tag_tab = torch.tensor([t.data_ptr() for t in self.tags], dtype=torch.int64)
        self.host = [torch.zeros(1, dtype=torch.int64) for _ in range(W)]
        self.err = [torch.tensor([0, h.data_ptr()], dtype=torch.int64) for h in self.host]
        self.ctrl = [torch.zeros(NB, dtype=torch.int64) for _ in range(W)]

    def tags_idle(self) -> bool:
        return all(int(t.abs().sum()) == 0 for t in self.tags)


POISON = -7


class Call:
    """One rank's call: ``("gather", rows, part)`` (x is ``[rows, part]`` words; rows 1 is the
    contiguous all-gather) or ``("bcast", n, src)``."""

    def __init__(self, spec, seed: int, rank: int, W: int):
        import torch
        self.kind, a, b = spec
        g = torch.Generator().manual_seed(seed * 101 + rank)
        self.n = a * b if self.kind == "gather" else a
        self.part = b if self.kind == "gather" else a
        self.src = b if self.kind == "bcast" else 0
        # any 32-bit pattern, NaN payloads included (high bits set on about half the words)
        self.x = torch.randint(-2 ** 31, 2 ** 31 - 1, (self.n,), generator=g, dtype=torch.int32)
        self.x0 = self.x.clone()
        if self.kind == "bcast" and rank != self.src:
            self.x.fill_(POISON)
        self.out = torch.full((self.n * W if self.kind == "gather" else 1,), POISON,
                              dtype=torch.int32)

    def op_and_tag(self) -> tuple[int, int]:
        """The protocol op code and the tag word, as ``peer.PeerBackend`` computes them (the
        data is int32 words here)."""
        import torch
        from llcomm.tp import peer
        from llcomm.runtime import protocol as P
        op = P.OP_ALL_GATHER if self.kind == "gather" else P.OP_BROADCAST
        mix = self.part if self.kind == "gather" else self.src
        return op, peer.PeerBackend._lamport_tag(op, peer.PeerBackend._moved_numel(self.x, mix),
                                                 torch.int32)

    def launch(self, R: Regions, rank: int, stage: int) -> None:
        from llcomm.tp import peer
        from llcomm.tp.kernels import ll
        op, tag = self.op_and_tag()
        block, _ = peer._launch_shape(self.n, 4, R.NB)
        ll.ll_gather_kernel[(R.NB,)](
            self.x, self.out, self.n, self.part, self.src, R.ll_tab, R.tag_tab, R.ctrl[rank],
            R.err[rank], rank, tag, 0, R.cap, op=op, BCAST=int(self.kind == "bcast"), WORLD=R.W,
            WORLD_POW2=1 << (R.W - 1).bit_length(), NUM_BLOCKS=R.NB, BLOCK=block, STAGES=stage)

    def check(self, calls) -> str | None:
        import torch
        if self.kind == "bcast":
            ok = torch.equal(self.x, calls[self.src].x0)
        else:
            rows = self.n // self.part
            want = torch.cat([c.x0.view(rows, self.part) for c in calls], 1).reshape(-1)
            ok = torch.equal(self.out, want)
        return None if ok else f"{self.kind} n={self.n} part={self.part}: wrong words"


def _round(R: Regions, specs, seed: int, pushers=None, tags_only=()):
    """One round: rank r calls specs[r]; ranks in ``pushers`` (default all) push; ranks in
    ``tags_only`` store only their tag words (as if their data were still in flight); then every
    rank receives."""
    from llcomm.runtime.kernels import lamport as _lamport
    calls = [Call(s, seed, r, R.W) for r, s in enumerate(specs)]
    for r, c in enumerate(calls):
        if r in tags_only:
            half = int(R.ctrl[r][0]) % 2
            for d in range(R.W):
                for b in range(R.NB):
                    R.tags[d][(half * R.NB + b) * R.W + r] = c.op_and_tag()[1]
        elif pushers is None or r in pushers:
            c.launch(R, r, _lamport.PUSH)
    for r, c in enumerate(calls):
        c.launch(R, r, _lamport.REDUCE)
    return calls


def simulate_matched(W, NB, cap, rounds):
    R = Regions(W, NB, cap)
    fails = []
    for i, spec in enumerate(rounds):
        calls = _round(R, [tuple(spec)] * W, seed=i)
        fails += [f"round {i} rank {r}: {bad}" for r, c in enumerate(calls)
                  if (bad := c.check(calls))]
        if not R.tags_idle():
            fails.append(f"round {i} {spec}: tag words not idle afterwards")
        fails += [f"round {i} rank {r}: error word {int(h[0]):#x} without cause"
                  for r, h in enumerate(R.host) if int(h[0])]
    fails += [f"rank {r}: op counters {c.tolist()}" for r, c in enumerate(R.ctrl)
              if c.tolist() != [len(rounds)] * NB]
    return fails


def simulate_faulty(W, NB, cap, warmup, specs, pushers=None, tags_only=()):
    """Matched ``warmup`` rounds, then one round where rank r calls specs[r] (see ``_round``
    for ``pushers`` and ``tags_only``). Returns per rank [the decoded error (type, op, phase,
    ranks) or None, the number of output words that are neither POISON, protocol.POISON_BITS
    nor its own data, whether the output is poisoned: every word POISON_BITS (broadcast's root:
    its x unchanged)]."""
    from llcomm.runtime import protocol as P
    R = Regions(W, NB, cap)
    for i, spec in enumerate(warmup):
        _round(R, [tuple(spec)] * W, seed=i)
    assert not any(int(h[0]) for h in R.host), "the warm-up rounds failed"
    calls = _round(R, [tuple(s) for s in specs], seed=len(warmup),
                   pushers=None if pushers is None else set(pushers), tags_only=set(tags_only))
    seen = []
    for r, c in enumerate(calls):
        e = P.decode_error(int(R.host[r][0]), r)
        got = c.out if c.kind == "gather" else c.x
        foreign = int(((got != POISON) & (got != P.POISON_BITS) & ~torch_isin(got, c.x0)).sum())
        root = c.kind == "bcast" and r == c.src
        poisoned = bool((c.x == c.x0).all()) if root else bool((got == P.POISON_BITS).all())
        seen.append([None if e is None else [type(e).__name__, e.op, e.phase, list(e.ranks)],
                     foreign, poisoned])
    return seen


def torch_isin(a, b):
    import torch
    return torch.isin(a, b)


G64 = ("gather", 1, 64)
#: Matched rounds on one set of regions (cap 5000 words: 4100-word messages give block 0 two
#: chunks at NB=2): sizes, row shapes and roots change every round; rounds 0 and 2 (and 3 and 5)
#: reuse a half with the same call, so only the epoch tells the rounds apart.
MATCHED = [G64, ("bcast", 5, 1), G64, ("gather", 16, 8), ("bcast", 4100, 0), ("gather", 16, 8),
           ("gather", 1, 4100), ("bcast", 3, 0), ("gather", 3, 1)]


@pytest.mark.parametrize("W,NB", [(2, 2), (3, 4)])
def test_matched_rounds_are_byte_exact_and_leave_tags_idle(W, NB):
    fails = run_in_interpreter("test_ll_cpu", "simulate_matched", W, NB, 5000, MATCHED)
    assert not fails, "\n".join(fails[:20])


def test_stale_words_are_never_taken_for_data():
    """Round 2 uses the half round 0 used, with the same call. Rank 1's tag has arrived but its
    words have not: rank 0 finds round 0's words there (same size, same tag, older epoch) and
    must time out naming rank 1, with none of them in its output: it is poisoned."""
    from llcomm.runtime import protocol as P
    seen = run_in_interpreter("test_ll_cpu", "simulate_faulty", 2, 2, 256, [G64, G64],
                              [G64, G64], None, [1])
    assert seen[0] == [["CommTimeoutError", P.OPS[P.OP_ALL_GATHER], P.PHASES[P.PHASE_DATA], [1]],
                       0, True], seen


def test_rank_that_never_pushed_is_a_timeout():
    from llcomm.runtime import protocol as P
    seen = run_in_interpreter("test_ll_cpu", "simulate_faulty", 2, 4, 256, [G64], [G64, G64],
                              [0])
    assert seen[0] == [["CommTimeoutError", P.OPS[P.OP_ALL_GATHER], P.PHASES[P.PHASE_DATA], [1]],
                       0, True], seen


MISMATCHES = {  # name: (rank 0's call, rank 1's call, the op each reports)
    "gather-sizes": (G64, ("gather", 1, 32), ("all_gather", "all_gather")),
    "gather-rows": (("gather", 4, 16), ("gather", 8, 8), ("all_gather", "all_gather")),
    "bcast-roots": (("bcast", 64, 0), ("bcast", 64, 1), ("broadcast", "broadcast")),
    "bcast-vs-gather": (("bcast", 64, 0), G64, ("broadcast", "all_gather")),
}


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_mismatch_is_reported_on_every_rank(name):
    from llcomm.runtime import protocol as P
    a, b, ops = MISMATCHES[name]
    seen = run_in_interpreter("test_ll_cpu", "simulate_faulty", 2, 4, 256, [G64], [a, b])
    for r in range(2):
        assert seen[r] == [["CommMismatchError", ops[r], P.PHASES[P.PHASE_DATA], [1 - r]], 0,
                           True], (r, seen)


def test_ll_bytes():
    """LL up to 64 KiB (the measured winner), at most max_bytes, in whole 4-byte words."""
    from llcomm.tp.peer import LL_MAX_BYTES, ll_bytes
    assert LL_MAX_BYTES == 64 << 10
    assert ll_bytes(16 << 20) == LL_MAX_BYTES
    assert ll_bytes(8192) == 8192 and ll_bytes(4098) == 4096

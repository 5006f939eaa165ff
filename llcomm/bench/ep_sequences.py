"""Random legal sequences of EP calls, the same on every rank: what an engine may do with one
buffer, drawn from a seed (pure Python, no torch, no GPU).

    seq = generate(seed, api="deep_ep", world=2, max_tokens=24, hidden=512)
    for step in seq.steps: ...          # llcomm/bench/ep_seqrun.py runs and checks them

What a sequence covers (docs/ep.md and docs/deep_ep.md say what is legal):

- one or two dispatches before a combine: at most two handles outstanding (the buffer keeps two
  handle slots), dispatches and combines interleaved in any legal order;
- each handle combined once or twice (``deep_ep``: the second time zero-copy, through
  ``get_next_low_latency_combine_buffer``; a first combine may be zero-copy too);
- receive hooks (split phase) on dispatches and combines; a dispatch's hook may be deferred
  past the combine of the other outstanding handle (the two-micro-batch overlap), never past
  another dispatch or a combine of its own handle;
- bf16 (the buffer dtype), FP8, FP8 with ``round_scale`` and, through ``deep_ep`` only, UE8M0;
- carried weights (``EPBuffer.dispatch(topk_weights=...)``; ``deep_ep`` has no such argument);
- random token counts per rank in ``[0, max_tokens]`` (they may differ between ranks) and a
  top-k per dispatch (the same on every rank, as both APIs require), fresh routings (a seed per
  step);
- delays: before some steps (and between a send half and its hook) the ``slow_rank`` sleeps, so
  its peers' bounded waits meet a late rank; every other rank runs the same steps undelayed.

Rank masks are a property of the buffer (``enable_masks``), not of a step: runners may build
the buffer with them where the backend allows (peer), and the same sequences must pass.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

APIS = ("ep", "deep_ep")
#: Dispatch formats: the buffer dtype, FP8, FP8 with power-of-two scales, UE8M0 (deep_ep).
FORMATS = ("bf16", "fp8", "round_scale", "ue8m0")
#: Channels per FP8 scale, and per UE8M0 word (four scales).
FP8_CHANNELS, UE8M0_CHANNELS = 128, 512
#: Handles a buffer keeps; a dispatch overwrites the handle two dispatches older.
HANDLE_SLOTS = 2
#: Combines of one handle at most.
MAX_COMBINES = 2
#: Steps of a sequence (dispatches and combines) by default, at least.
DEFAULT_STEPS = 8
#: Chance that a step is delayed on the slow rank, and the largest delay by default (s).
DELAY_CHANCE, DEFAULT_MAX_DELAY_S = 0.35, 0.05
#: Chances of a hook, carried weights, a deferred dispatch hook, a zero-copy first combine, a
#: second combine of a handle.
HOOK_CHANCE, CARRY_CHANCE, DEFER_CHANCE, ZERO_COPY_CHANCE, TWICE_CHANCE = 0.35, 0.4, 0.5, 0.3, 0.5
#: Chance that a rank sends the most tokens (else a uniform count, 0 included).
FULL_CHANCE = 0.25
_SEED_SPACE = 1 << 31


@dataclass(frozen=True)
class Dispatch:
    handle: int                 # handle id: dispatches are numbered 0, 1, ... in order
    seed: int                   # routing, token rows and carried weights
    tokens: tuple               # tokens per rank
    topk: int
    fmt: str                    # one of FORMATS
    carry: bool                 # the weights travel with the dispatch (EPBuffer only)
    hook: bool                  # split phase
    defer_hook: bool            # the hook runs after the next step (a combine of another handle)
    delay_s: float = 0.0        # slow rank: sleep before the step
    hook_delay_s: float = 0.0   # slow rank: sleep between the send half and the hook


@dataclass(frozen=True)
class Combine:
    handle: int
    seed: int                   # the weights, when the dispatch did not carry them
    zero_copy: bool             # deep_ep: through get_next_low_latency_combine_buffer
    hook: bool
    delay_s: float = 0.0
    hook_delay_s: float = 0.0


@dataclass
class Sequence:
    seed: int
    api: str
    world: int
    max_tokens: int
    hidden: int
    slow_rank: int
    steps: list = field(default_factory=list)

    def describe(self) -> str:
        """One line per step, for failure reports."""
        return "\n".join(f"  {i}: {s}" for i, s in enumerate(self.steps))

    def dispatches(self) -> list:
        return [s for s in self.steps if isinstance(s, Dispatch)]


def formats(api: str, hidden: int) -> tuple:
    """The dispatch formats ``api`` offers at this ``hidden``."""
    out = ["bf16"]
    if hidden % FP8_CHANNELS == 0:
        out += ["fp8", "round_scale"]
    if api == "deep_ep" and hidden % UE8M0_CHANNELS == 0:
        out.append("ue8m0")
    return tuple(out)


def _delay(rng: random.Random, max_delay_s: float) -> float:
    return round(rng.uniform(0, max_delay_s), 4) if rng.random() < DELAY_CHANCE else 0.0


def generate(seed: int, *, api: str, world: int, max_tokens: int, hidden: int,
             max_topk: int = 8, num_experts: int | None = None, steps: int = DEFAULT_STEPS,
             max_delay_s: float = DEFAULT_MAX_DELAY_S, carry: bool = True) -> Sequence:
    """A random legal sequence of at least ``steps`` steps that leaves no handle uncombined.

    ``max_topk`` is capped by ``num_experts`` when given. ``carry=False`` leaves carried weights
    out (an ``EPBuffer`` runner that cannot carry them); ``deep_ep`` never carries."""
    if api not in APIS:
        raise ValueError(f"api={api!r}; expected one of {APIS}")
    rng = random.Random(seed)
    fmts = formats(api, hidden)
    top = min(max_topk, num_experts) if num_experts else max_topk
    seq = Sequence(seed, api, world, max_tokens, hidden, slow_rank=rng.randrange(world))
    live: list[int] = []            # the last HANDLE_SLOTS handles: combinable
    combined: dict[int, int] = {}   # handle -> combines so far
    next_handle = 0

    def must_combine():             # live handles not yet combined
        return [h for h in live if combined[h] == 0]

    while len(seq.steps) < steps or must_combine():
        pending = must_combine()
        again = [h for h in live if 0 < combined[h] < MAX_COMBINES]
        # a dispatch retires the oldest live handle: only once it has been combined; no new
        # dispatch once the sequence is long enough
        can_dispatch = len(seq.steps) < steps and (len(live) < HANDLE_SLOTS
                                                   or combined[live[0]] > 0)
        if again and rng.random() < TWICE_CHANCE / 2:
            seq.steps.append(_combine(rng, rng.choice(again), combined, api, max_delay_s))
        elif can_dispatch and (not pending or rng.random() < 0.5):
            h = next_handle
            next_handle += 1
            hook = rng.random() < HOOK_CHANCE
            defer = hook and bool(pending) and rng.random() < DEFER_CHANCE
            seq.steps.append(Dispatch(
                handle=h, seed=rng.randrange(_SEED_SPACE),
                tokens=tuple(max_tokens if rng.random() < FULL_CHANCE
                             else rng.randint(0, max_tokens) for _ in range(world)),
                topk=rng.randint(1, top), fmt=rng.choice(fmts),
                carry=api == "ep" and carry and rng.random() < CARRY_CHANCE, hook=hook,
                defer_hook=defer, delay_s=_delay(rng, max_delay_s),
                hook_delay_s=_delay(rng, max_delay_s) if hook else 0.0))
            live.append(h)
            combined[h] = 0
            if len(live) > HANDLE_SLOTS:
                live.pop(0)
            if defer:               # the next step: the other handle's combine, then the hook
                seq.steps.append(_combine(rng, pending[0], combined, api, max_delay_s))
        elif pending:
            seq.steps.append(_combine(rng, rng.choice(pending), combined, api, max_delay_s))
        elif again:
            seq.steps.append(_combine(rng, rng.choice(again), combined, api, max_delay_s))
    return seq


def _combine(rng, h: int, combined: dict, api: str, max_delay_s: float) -> Combine:
    """The next combine of handle ``h`` (deep_ep: a second one is zero-copy)."""
    zero = api == "deep_ep" and (combined[h] > 0 or rng.random() < ZERO_COPY_CHANCE)
    combined[h] += 1
    hook = rng.random() < HOOK_CHANCE
    return Combine(handle=h, seed=rng.randrange(_SEED_SPACE), zero_copy=zero, hook=hook,
                   delay_s=_delay(rng, max_delay_s),
                   hook_delay_s=_delay(rng, max_delay_s) if hook else 0.0)


def check_legal(seq: Sequence) -> list[str]:
    """What makes ``seq`` illegal for its api (empty: nothing). The generator's own test, and a
    runner's guard: every combine names one of the two latest dispatches, at most twice; every
    handle combined; a deferred hook is followed by a combine of another handle; formats,
    carried weights and zero copy only where the api has them; counts within the buffer."""
    bad = []
    fmts = formats(seq.api, seq.hidden)
    dispatched: list[int] = []
    count: dict[int, int] = {}
    for i, s in enumerate(seq.steps):
        if isinstance(s, Dispatch):
            if s.handle != len(dispatched):
                bad.append(f"step {i}: handle {s.handle} out of order")
            if s.fmt not in fmts:
                bad.append(f"step {i}: format {s.fmt} not offered by {seq.api} at hidden "
                           f"{seq.hidden}")
            if s.carry and seq.api != "ep":
                bad.append(f"step {i}: carried weights through {seq.api}")
            if len(s.tokens) != seq.world or not all(0 <= n <= seq.max_tokens for n in s.tokens):
                bad.append(f"step {i}: token counts {s.tokens}")
            if s.defer_hook:
                nxt = seq.steps[i + 1] if i + 1 < len(seq.steps) else None
                if not (s.hook and isinstance(nxt, Combine) and nxt.handle != s.handle):
                    bad.append(f"step {i}: a deferred hook not followed by another handle's "
                               "combine")
            if len(dispatched) >= HANDLE_SLOTS and count[dispatched[-HANDLE_SLOTS]] == 0:
                bad.append(f"step {i}: the dispatch retires uncombined handle "
                           f"{dispatched[-HANDLE_SLOTS]}")
            dispatched.append(s.handle)
            count[s.handle] = 0
        else:
            if s.handle not in dispatched[-HANDLE_SLOTS:]:
                bad.append(f"step {i}: combine of handle {s.handle}, not one of the two latest")
                continue
            count[s.handle] += 1
            if count[s.handle] > MAX_COMBINES:
                bad.append(f"step {i}: handle {s.handle} combined {count[s.handle]} times")
            if s.zero_copy and seq.api != "deep_ep":
                bad.append(f"step {i}: zero copy through {seq.api}")
    bad += [f"handle {h} never combined" for h, c in count.items() if c == 0]
    return bad

"""The EP part of ``llcomm check``: ``EPBuffer`` and ``llcomm.deep_ep`` dispatch + combine in every
variant, and a short random call sequence per API, each checked by ``ep_seqrun`` against its
oracle (every rank regenerates every rank's inputs; dispatch byte for byte, FP8 codes and
scales against an independent quantiser, combine bit for bit in the documented order).

Variants: through ``EPBuffer`` every dispatch format (the buffer dtype, FP8, FP8 round_scale)
with and without carried weights and receive hooks; through ``deep_ep`` every format (UE8M0
too), each handle combined twice, the second time zero-copy.
"""
from __future__ import annotations

import torch

from ..bench import ep_sequences as S
from ..bench import spawn
from ..bench.ep_seqrun import SequenceRunner

#: Shape (hidden a multiple of 512: UE8M0), experts per rank, top-k.
HIDDEN, TOKENS, EXPERTS_PER_RANK, TOPK = 512, 8, 4, 4
#: Steps of the random sequence per API, and its slow rank's largest sleep (s).
SEQ_STEPS, SEQ_MAX_DELAY_S = 8, 0.02
DTYPE = "bfloat16"


def _variants(api: str, world: int, seed: int):
    """(label, sequence) of every variant of ``api``: one dispatch and its combine(s)."""
    carries = (False, True) if api == "ep" else (False,)
    i = 0
    for fmt in S.formats(api, HIDDEN):
        for carry in carries:
            for hook in (False, True):
                i += 1
                tokens = tuple(TOKENS if (r + i) % 2 else TOKENS // 2 + r for r in range(world))
                d = S.Dispatch(handle=0, seed=seed + i, tokens=tokens, topk=TOPK, fmt=fmt,
                               carry=carry, hook=hook, defer_hook=False)
                steps = [d, S.Combine(0, seed + 100 + i, zero_copy=False, hook=hook)]
                label = f"ep {fmt}" + " carry" * carry + " hook" * hook
                if api == "deep_ep":
                    steps.append(S.Combine(0, seed + 200 + i, zero_copy=True, hook=not hook))
                    label = f"deep_ep {fmt}" + " hook" * hook + " +zero-copy"
                yield label, S.Sequence(seed + i, api, world, TOKENS, HIDDEN, 0, steps)
    yield f"{api} random sequence", S.generate(
        seed, api=api, world=world, max_tokens=TOKENS, hidden=HIDDEN,
        num_experts=EXPERTS_PER_RANK * world, max_topk=TOPK, steps=SEQ_STEPS,
        max_delay_s=SEQ_MAX_DELAY_S)


def ep_results(rank: int, world: int, backend: str, device, seed: int) -> list[dict]:
    """One result per variant and API, in ``check``'s format (``wrong``: failed checks summed
    over ranks; ``error``: the first failure or exception)."""
    import llcomm.deep_ep as deep_ep
    from llcomm.ep import EPBuffer
    E = EXPERTS_PER_RANK * world
    results = []
    for api in S.APIS:
        if api == "ep":
            buf = EPBuffer(num_experts=E, hidden=HIDDEN, num_max_dispatch_tokens_per_rank=TOKENS,
                           backend=backend)
        else:
            buf = deep_ep.Buffer(None, backend=backend)
        run = SequenceRunner(buf, rank, world, num_experts=E, dtype=getattr(torch, DTYPE),
                             device=device)
        broken = None
        for label, seq in _variants(api, world, seed):
            fails, err = [], broken
            if broken is None:
                try:
                    fails = run.run(seq)
                except Exception as e:  # noqa: BLE001 - reported as FAIL; the buffer is broken
                    err = broken = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
            if spawn.any_rank(err is not None or bool(fails), device) and err is None \
                    and not fails:
                err = "failed on another rank"
            results.append({"op": label, "count": TOKENS, "dtype": DTYPE, "mode": "eager",
                            "wrong": spawn.sum_over_ranks(len(fails), device),
                            "error": err or (fails[0] if fails else None), "exact": True})
        if broken is None:
            (buf.close if api == "ep" else buf.destroy)()
    return results

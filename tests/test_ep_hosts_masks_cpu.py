"""Rank masks in the two-level EP kernels (``MASKS`` = 1; ``hosts/kernels/masks.py``) on the
CPU, under ``TRITON_INTERPRET=1``, on virtual hosts with a simulated heap (as
``test_ep_hosts_kernels_cpu``).

The rule checked (docs/multihost.md, "Rank masks"), for a mask M that every rank holds: a
token of source s reaches rank q, and q's experts serve it, only if s, q and the forwarder of
s on q's host (its local rank ``s % R``) are all unmasked; a masked rank's own tokens get
zeros. Two ways to get a mask:

- *by hand*: every rank sets M in its mask word (``EPBuffer.set_mask``), all ranks run, the
  masked ones included (their rows and partials land and must be ignored); then the mask is
  cleared and the next round must match the full oracle on every rank;
- *a host or a rank that stops coming*: after two full rounds (both buffer sets hold its
  data), the ranks of the last host, or only the last rank, are not launched; each other rank
  that polls one of them (same rail: the rail wait; same host: the wait for the host's ranks to
  begin the call) masks it in the dispatch's first waits (one timeout), none reports an error,
  and the combine then runs without waiting for them. A rank that polls none of them masks
  nothing, and gets the same results: its tokens reach the absent rank only through ranks that
  masked it.

Outputs are poisoned first; dispatch is checked byte for byte against the single-level oracle
fed only the sources that reach each rank, combine against the two-level oracle with the
dropped top-k entries removed.
"""
from __future__ import annotations

import pytest
import torch

from _interp import run_in_interpreter
from test_ep_hosts_kernels_cpu import poisoned_handles, run_groups, stage_groups
from test_ep_kernels_cpu import _rows_fails, _same_up_to_interpreter_rounding

from llcomm.ep.hosts.nic import simulated_heap


#: The wait bound of a round in which every rank runs (no wait may run out).
FULL_ROUND_US = 20_000_000
#: The bound of the round with a rank missing: one bound of detection, then twice it for the
#: later waits, long enough for the interpreter's live ranks even on a loaded machine.
ABSENT_ROUND_US = 2_000_000


def reaches(s: int, q: int, R: int, M) -> bool:
    """Source s's tokens reach rank q under mask M (module doc)."""
    return s not in M and q not in M and (q // R) * R + s % R not in M


def masked_dispatch_oracle(xs, topks, W: int, E: int, T: int, R: int, M, r: int):
    """Rank r's expected dispatch under mask M: ``oracle_dispatch``'s (rows, counts, src_info)
    fed only the sources that reach r, and the token counts r records per source."""
    from test_ep_oracle import oracle_dispatch
    keep = [s not in M and (r // R) * R + s % R not in M for s in range(W)]
    xs_r = [x if k else x[:0] for k, x in zip(keep, xs)]
    tk_r = [t if k else t[:0] for k, t in zip(keep, topks)]
    return oracle_dispatch(xs_r, tk_r, W, E, T)[r], [x.shape[0] for x in xs_r]


def cut_topks(topks, W: int, E: int, R: int, M):
    """The top-k ids with every entry whose expert the token does not reach under mask M set
    to -1: fed to ``oracle_combine_hosts``, the expected combine."""
    L = E // W
    cut = []
    for s, tk in enumerate(topks):
        q = torch.where((tk >= 0) & (tk < E), tk // L, -1)
        gone = torch.tensor([[q_ < 0 or not reaches(s, q_, R, M) for q_ in row]
                             for row in q.tolist()], dtype=torch.bool).view(tk.shape)
        cut.append(torch.where(gone, -1, tk))
    return cut


def simulate_masked_hosts(R, N, E, T, H, K, NB, dtype_name, seed, masked, absent, staged,
                          timeout_us):
    """By hand: one round with ``masked`` masked, then one with the mask cleared. ``absent``
    ("host" or "rank"): two full rounds, then one without the last host or the last rank.
    Returns failures."""
    import triton  # noqa: F401  (TRITON_INTERPRET is set by the caller)
    from llcomm.ep.hosts.layout import hosts_layout
    from llcomm.ep.hosts.peer import hosts_consts, size_tag
    from llcomm.ep.hosts.kernels import combine as HC
    from llcomm.ep.hosts.kernels import dispatch as HD
    from llcomm.ep.layout import ERR_MASK
    from llcomm.runtime import protocol as P
    from test_ep_hosts import oracle_combine_hosts
    from test_ep_oracle import expert_fn, make_case

    dtype = getattr(torch, dtype_name)
    W = N * R
    L = E // W
    isz = torch.tensor([], dtype=dtype).element_size()
    lay = hosts_layout(T, H, N, R, K, isz, NB, False, E)
    bits = sum(1 << r for r in masked)
    heap, tab, host_words, err, ctrl, ledger = simulated_heap(lay, NB, bits, nic_seed=seed)
    dc, cc, _ = hosts_consts(lay, E, K, 0)
    d_tag = size_tag(P.OP_DISPATCH, H, K, 0, dtype)
    c_tag = size_tag(P.OP_COMBINE, H, K, 0, dtype)
    everyone = list(range(W))
    dead = list(range(W - R, W)) if absent == "host" else [W - 1]
    survivors = [r for r in everyone if r not in dead]

    def polled(r):      # the mask word rank r should end with: the dead ranks it polls
        return sum(1 << d for d in dead if d % R == r % R or d // R == r // R)
    d_groups, c_groups = stage_groups(staged)

    def run(groups, launch):
        run_groups(groups, launch, launched, staged)

    fails = []
    if absent:      # (mask, ranks launched, the mask words expected after the round)
        rounds = [([], everyone, [0] * W)] * 2 + [(dead, survivors, [polled(r) for r in everyone])]
    else:
        rounds = [(masked, everyone, [bits] * W), ([], everyone, [0] * W)]
    for round_, (M, launched, want_masks) in enumerate(rounds):
        sd = seed + round_
        bound = timeout_us if launched != everyone else FULL_ROUND_US
        tag = f"[{N} hosts x {R} ranks, NB={NB} {dtype_name} seed={sd} mask={M} absent={absent}]"
        if round_ and not absent:
            for r in launched:
                err[r][ERR_MASK] = 0
        xs, topks, weights = make_case(W, E, T, H, K, sd, "random", dtype)
        recv = [torch.full((L, W * T, H), float("nan"), dtype=dtype) for _ in range(W)]
        row_of, src, cnt, ntok, fwd_ids, fwd_ntok = poisoned_handles(N, R, L, T, K)

        def dispatch(r, stages):
            HD.hosts_dispatch_kernel[(NB,)](
                xs[r], topks[r], xs[r].shape[0], recv[r], recv[r], row_of[r], src[r], cnt[r],
                ntok[r], fwd_ids[r], fwd_ntok[r], tab, ctrl[r][0], err[r], r, d_tag, bound,
                ledger[r][0], None, **dict(dc, STAGES=stages, SHMEM=0, MASKS=1))
        run(d_groups, dispatch)

        checked = [r for r in launched if r not in M]
        for r in checked:
            exp_r, want_ntok = masked_dispatch_oracle(xs, topks, W, E, T, R, M, r)
            fails += _rows_fails(tag, r, exp_r, cnt, recv, src, L, ntok, want_ntok)
        if fails:
            return fails

        outs_e = [expert_fn(recv[r], cnt[r], r) if r in launched
                  else torch.zeros(L, W * T, H, dtype=dtype) for r in range(W)]
        outs = [torch.full((x.shape[0], H), float("nan"), dtype=dtype) for x in xs]

        def combine(r, stages):
            HC.hosts_combine_kernel[(NB,)](
                outs_e[r], topks[r], weights[r], xs[r].shape[0], outs[r], row_of[r], ntok[r],
                fwd_ids[r], fwd_ntok[r], tab, ctrl[r][1], err[r], r, c_tag, bound,
                ledger[r][1], None, **dict(cc, STAGES=stages, SHMEM=0, MASKS=1))
        run(c_groups, combine)

        # the top-k entries whose expert the token does not reach count as absent
        want = oracle_combine_hosts(outs_e, cut_topks(topks, W, E, R, M), weights, W, E, R,
                                    dtype)
        for r in checked:
            if not _same_up_to_interpreter_rounding(outs[r], want[r]):
                d = (outs[r].float() - want[r].float()).abs()
                fails.append(f"{tag} rank {r} combine differs (max {d.max() if d.numel() else 0})")
        for r in launched:
            want_mask = want_masks[r]
            if int(err[r][0]) or int(host_words[r][0]) or int(err[r][ERR_MASK]) != want_mask:
                fails.append(f"{tag} rank {r}: error words {int(err[r][0]):#x} / "
                             f"{int(host_words[r][0]):#x}, mask {int(err[r][ERR_MASK]):#x} "
                             f"(expected 0, 0, {want_mask:#x})")
    return fails


CASES = [  # R, N, E, T, H, K, NB, dtype, seed, masked by hand, staged
    (2, 2, 8, 5, 32, 3, 2, "float32", 1, [1], True),
    (2, 3, 12, 4, 32, 3, 2, "bfloat16", 2, [2, 5], True),
    (3, 2, 12, 4, 32, 4, 1, "float16", 3, [0], False),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[1]}x{c[0]}-m{''.join(map(str, c[9]))}"
                                             for c in CASES])
def test_ranks_masked_by_hand_are_skipped_on_both_levels(case):
    R, N, E, T, H, K, NB, dt, seed, masked, staged = case
    fails = run_in_interpreter("test_ep_hosts_masks_cpu", "simulate_masked_hosts", R, N, E, T,
                               H, K, NB, dt, seed, masked, "", staged, FULL_ROUND_US)
    assert not fails, "\n".join(fails[:10])


@pytest.mark.parametrize("R,N,absent", [(2, 2, "host"), (1, 3, "host"), (2, 2, "rank"),
                                        (3, 2, "rank")])
def test_a_host_or_rank_that_stops_coming_is_masked_not_fatal(R, N, absent):
    fails = run_in_interpreter("test_ep_hosts_masks_cpu", "simulate_masked_hosts", R, N,
                               4 * R * N, 4, 32, 2, 1, "float32", 4, [], absent, False,
                               ABSENT_ROUND_US)
    assert not fails, "\n".join(fails[:10])

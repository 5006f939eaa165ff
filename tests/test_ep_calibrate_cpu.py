"""``llcomm bench ep --calibrate`` (``llcomm/bench/ep_calibrate.py``) on the CPU, under
``TRITON_INTERPRET=1``: its setup at tiny shapes (hosts of 2 ranks, 3 tokens, hidden 128),
with the timing loop replaced by a single launch of each stage.

What the forward placed in each of the host's R regions is compared, byte for byte, with the
rows and ids the test itself gives every rail source and the routing sends each rank (not with
the module's own check), and so are the stages' byte counts; the partials and host sums must
fill exactly the slots the routing says. A setup that launches nothing must fail the module's
checks. No time is asserted: an interpreter's would mean nothing.
"""
from __future__ import annotations

import pytest
import torch

from _interp import run_in_interpreter

#: (ranks per host, hosts, calibrating rank): rank 3 of 2 hosts of 2 is local rank 1 of the
#: second host; rank 3 of 3 hosts of 2 has a host before and after its own.
CASES = [(2, 2, 0), (2, 2, 3), (2, 3, 3)]
T, H, K, NB = 3, 128, 2, 2


def _one_launch(fn):
    fn()
    return 0.0, 0.0, 0.0


def simulate_calibration(R: int, N: int, rank: int, launch: bool):
    """Build the calibration of ``rank`` on N hosts of R virtual ranks on the CPU; with
    ``launch``, measure it with one launch per stage and return (its rows, the placement
    problems this test finds on its own); without, return the module's own problems of the
    untouched setup."""
    import triton  # noqa: F401  (TRITON_INTERPRET is set by the caller)

    from llcomm.bench import ep_calibrate as C
    from llcomm.bench.ep_model import Shape
    from llcomm.ep.hosts.layout import row_bytes

    W, E = R * N, 4 * R * N
    s = Shape(ranks=W, ranks_per_host=R, tokens=T, hidden=H, experts=E, topk=K)
    st = C.build(s, torch.device("cpu"), seed=5, num_blocks=NB, rank=rank)
    if not launch:
        problems = []
        for stage in C.CALIBRATED_STAGES:
            C._poison(st, stage)
            problems += (C.forward_problems(st) if stage == "forward"
                         else C.combine_problems(st, stage))
        return problems
    rows = C.measure(st, _one_launch)
    # the test's own oracle: every rank q of the host holds, at (source, token), the row the
    # source's token sends it if it has an expert on q, else the poison byte; the ids of every
    # token of every rail source
    L, host, local = E // W, rank // R, rank % R
    put, slot, o = row_bytes(H, 2, True), st.lay.row_bytes, st.lay.offsets
    problems, pairs = [], 0
    for q in range(R):
        heap = st.regions[q]
        for g in range(N):
            src = g * R + local
            for t in range(T):
                at = o["d_host_rows"] + (src * T + t) * slot
                got = heap[at:at + slot]
                routed = any((host * R + q) * L <= e < (host * R + q + 1) * L
                             for e in st.topks[src][t].tolist())
                pairs += routed
                want = (st.rows[g, t] if routed
                        else torch.full((put,), C.POISON, dtype=torch.uint8, device="cpu"))
                if not torch.equal(got[:put], want):
                    problems.append(f"rank {host * R + q}: row of source {src} token {t} "
                                    f"({'routed' if routed else 'not routed'}) differs")
                ids_at = o["d_host_ids"] + (src * T + t) * K * 4
                if heap[ids_at:ids_at + 4 * K].view(torch.int32).tolist() != \
                        st.topks[src][t].tolist():
                    problems.append(f"rank {host * R + q}: ids of source {src} token {t}")
        others = [s_ for s_ in range(W) if s_ % R != local]
        for s_ in others:                     # sources of other rails: nothing of theirs here
            at = o["d_host_rows"] + s_ * T * slot
            if bool((heap[at:at + T * slot] != C.POISON).any()):
                problems.append(f"rank {host * R + q}: a row of source {s_}, not on this rail")
    mine = sum(any(rank * L <= e < (rank + 1) * L for e in tok)
               for t_ in st.topks for tok in t_.tolist())
    want_bytes = {"forward": pairs * put, "partials": mine * H * 2, "host sums": pairs * H * 2}
    for r in rows:
        if r["bytes"] != want_bytes[r["stage"]]:
            problems.append(f"{r['stage']}: bytes {r['bytes']} != {want_bytes[r['stage']]}")
    return rows, problems, pairs


@pytest.mark.parametrize("R,N,rank", CASES)
def test_the_calibration_places_exactly_what_the_routing_sends(R, N, rank):
    rows, problems, pairs = run_in_interpreter("test_ep_calibrate_cpu", "simulate_calibration",
                                               R, N, rank, True)
    assert not problems, "\n".join(problems[:10])
    assert pairs > 0
    assert [r["stage"] for r in rows] == ["forward", "partials", "host sums"]
    for r in rows:
        assert r["ranks"] == R * N and r["ranks_per_host"] == R and r["bytes"] > 0, r
        assert r["blocks"] == NB and r["rank"] == rank, r


def test_a_setup_that_moves_nothing_fails_the_checks():
    """Nothing launched: the forward's rows, ids and counts, and the partials and host sums
    slots, are all reported."""
    problems = run_in_interpreter("test_ep_calibrate_cpu", "simulate_calibration", 2, 2, 0,
                                  False)
    assert any("row slots differ" in p for p in problems), problems
    assert any("forwarded ids" in p for p in problems), problems
    assert any(p.startswith("partials:") for p in problems), problems
    assert any(p.startswith("host sums:") for p in problems), problems


def test_gpu_tag_and_default_path():
    from llcomm.bench import ep_calibrate as C
    assert C.gpu_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert C.gpu_tag("NVIDIA H200") == "h200"
    assert C.gpu_tag("NVIDIA A100-SXM4-80GB") == "a100"
    assert C.gpu_tag("NVIDIA GH200 480GB") == "gh200"
    assert C.gpu_tag("Some Accelerator") == "some-accelerator"

"""The two-level EP cost model (``llcomm/bench/ep_model.py``, printed by
``llcomm/bench/ep_model_cli.py``): its exact wire counts against ``wire_formula`` (the kernels
tests' own oracle) on random routings and against the ledger the two-level kernels count in
Triton's interpreter; its expected counts against the mean of the exact ones over random
uniform routings; each stage's time against its parameter; the schedule of stages that run
after or during the one before (the pipelined dispatch), the op's time and the stage that
limits it; the in-host constants against the result file they come from; a calibration file
read in their place; and ``llcomm bench ep --model``."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from test_ep_hosts_kernels_cpu import wire_formula

from llcomm import cli
from llcomm.bench import ep_inhost as I
from llcomm.bench import ep_model as M
from llcomm.bench import spawn
from llcomm.bench.ep_interp import run_child
from llcomm.bench.ep_oracle import expert_affine, uniform_routing
from llcomm.ep.hosts.layout import row_bytes

ROOT = Path(__file__).resolve().parents[1]
#: (ranks, ranks per host, experts, top-k, max tokens per rank) of the formula comparison.
EXACT_SHAPES = [(4, 2, 16, 4, 5), (6, 2, 12, 3, 7), (6, 3, 24, 5, 4), (8, 2, 32, 8, 9),
                (16, 8, 256, 8, 16)]
#: (ranks, ranks per host, experts, top-k, tokens, trials, relative tolerance) of the
#: expectation: the tolerance is several standard errors of the mean at that many trials.
MEAN_SHAPES = [(8, 2, 32, 4, 16, 60, 0.02), (16, 8, 256, 8, 128, 8, 0.01),
               (32, 8, 256, 8, 128, 6, 0.01), (64, 8, 256, 8, 128, 3, 0.01)]
#: The stages each parameter drives (they must move with it), and the direction: -1 for a
#: bandwidth or rate (more is faster), +1 for a latency.
DRIVES = {"nvlink_gbps": (-1, {"forward", "weights in", "partials", "host sums"}),
          "nic_gbps": (-1, {"send", "weights out", "entry", "host sums"}),
          "nic_latency_us": (1, {"send", "weights out", "entry", "host sums"}),
          "nic_msg_rate": (-1, {"send", "weights out", "entry", "host sums"}),
          "hbm_gbps": (-1, {"expand", "out"})}


def _routings(W: int, E: int, K: int, n_max: int, gen: torch.Generator, holes: bool):
    """Every rank's top-k ids: distinct uniform experts, 0 to ``n_max`` tokens a rank; with
    ``holes`` some ids are -1 or out of range, which name no expert."""
    topks = []
    for _ in range(W):
        n = int(torch.randint(0, n_max + 1, (1,), generator=gen))
        idx, _ = uniform_routing(n, E, K, gen, "cpu")
        if holes and n:
            drop = torch.rand(idx.shape, generator=gen) < 0.2
            idx = torch.where(drop, torch.where(torch.rand(idx.shape, generator=gen) < 0.5,
                                                -1, E), idx)
        topks.append(idx)
    return topks


@pytest.mark.parametrize("shape", EXACT_SHAPES)
@pytest.mark.parametrize("fp8", [False, True])
def test_exact_counts_equal_the_kernels_formula(shape, fp8):
    W, R, E, K, n_max = shape
    H = 256
    rb, sb = row_bytes(H, 2, fp8), H * 2
    gen = torch.Generator().manual_seed(W * 100 + R * 10 + K)
    for trial in range(6):
        topks = _routings(W, E, K, n_max, gen, holes=trial % 2 == 1)
        for r in range(W):
            got = M.wire_counts_exact(topks, r, R, E, rb, sb)
            want = wire_formula(topks, W, E, R, r, rb, H, 2, K)
            assert (got.dispatch.by_rank(r, R), got.combine.by_rank(r, R)) == want, (trial, r)


def test_exact_counts_equal_the_interpreters_ledger():
    """2 hosts of 2 ranks, hidden 256, 16 experts, top-4, 5 tokens, bf16 rows: the ledger the
    kernels count is what ``wire_counts_exact`` says, rank by rank."""
    W, R, H, E, K, n = 4, 2, 256, 16, 4, 5
    gen = torch.Generator().manual_seed(7)
    xs, idx, w = [], [], []
    for r in range(W):
        i, wt = uniform_routing(n, E, K, gen, "cpu")
        if r == 1:
            i[0, 1] = -1            # an empty entry names no expert
        xs.append(torch.randn(n, H, generator=gen).to(torch.bfloat16))
        idx.append(i)
        w.append(wt)
    scale, bias = expert_affine(E, "cpu")
    res = run_child({"xs": xs, "idx": idx, "w": w, "scale": scale, "bias": bias,
                     "ranks_per_host": R, "max_tokens": n, "timeout_us": 60_000_000})
    assert res["failed"] == []
    for r in range(W):
        want = M.wire_counts_exact(idx, r, R, E, row_bytes(H, 2, False), H * 2)
        assert res["wire"][r] == (want.dispatch.by_rank(r, R), want.combine.by_rank(r, R)), r
        assert res["bytes"][r] == (want.dispatch.wire_bytes, want.combine.wire_bytes), r


@pytest.mark.parametrize("shape", MEAN_SHAPES)
def test_expected_counts_are_the_mean_of_exact_ones(shape):
    W, R, E, K, n, trials, tol = shape
    rb, sb = row_bytes(7168, 2, True), 7168 * 2
    gen = torch.Generator().manual_seed(W + K)
    sums = {"dispatch": torch.zeros(3, dtype=torch.float64),
            "combine": torch.zeros(3, dtype=torch.float64)}
    count = 0
    for _ in range(trials):
        topks = [uniform_routing(n, E, K, gen, "cpu")[0] for _ in range(W)]
        for r in range(W):
            got = M.wire_counts_exact(topks, r, R, E, rb, sb)
            for op in sums:
                for v in getattr(got, op).hosts.values():
                    sums[op] += torch.tensor(v, dtype=torch.float64)
                    count += op == "dispatch"
    want = M.wire_counts(W, R, n, K, E, rb, sb)
    for op, total in sums.items():
        expected = next(iter(getattr(want, op).hosts.values()))
        mean = (total / count).tolist()
        for got_v, want_v in zip(mean, expected):
            assert got_v == pytest.approx(want_v, rel=tol), (op, mean, expected)
    assert len(want.dispatch.hosts) == W // R - 1


def test_expected_counts_at_the_tables_shape():
    """EP16 / 32 / 64 with 8 GPUs per host, 128 tokens, top-8 of 256: the messages to each
    other host (docs/multihost.md, "The wire ledger")."""
    for W, msgs in ((16, 128.6), (32, 116.7), (64, 85.7)):
        s = M.Shape(ranks=W)
        per_host = next(iter(s.wire().dispatch.hosts.values()))
        assert per_host[0] == pytest.approx(msgs, abs=0.05), W
        assert M.hit_probability(256, W // 8, 8) == pytest.approx(
            1 - math.comb(256 - 256 // (W // 8), 8) / math.comb(256, 8))


def test_in_host_constants_are_the_result_files():
    """The peer kernels' measured points are the result file's CUDA-graph rows, and the fitted
    line goes through them."""
    rows = json.loads((ROOT / "bench/results/h200x2-ep-b256.json").read_text())["rows"]
    got = {(r["op"], r["bytes"]): r["median_us"] for r in rows
           if r["impl"] == "llcomm" and r["mode"] == "graph"}
    in_host = M.LinkParams().in_host
    assert in_host is I.SCALED and in_host.host_sums is None
    for op, points, fit in (("dispatch_fp8", I.PEER_DISPATCH_FP8, in_host.forward),
                            ("combine", I.PEER_COMBINE_BF16, in_host.partials)):
        for nbytes, us in points:
            assert got[(op, nbytes)] == pytest.approx(us, abs=1e-3), op
            assert fit.us(nbytes) == pytest.approx(us, abs=1e-6), op


def _stages(p: M.LinkParams, s: M.Shape) -> dict:
    return {st.name: st.us for m in (M.dispatch_model(s, p), M.combine_model(s, p))
            for st in m.stages}


def _stage(m: M.OpModel, name: str) -> M.Stage:
    return next(st for st in m.stages if st.name == name)


@pytest.mark.parametrize("field", sorted(DRIVES))
@pytest.mark.parametrize("ranks", [16, 64])
@pytest.mark.parametrize("carry", [True, False])
def test_each_stage_is_monotone_in_its_parameter(field, ranks, carry):
    sign, driven = DRIVES[field]
    s = M.Shape(ranks=ranks, carry=carry)
    base = getattr(M.LinkParams(), field)
    runs = [_stages(M.LinkParams(**{field: base * f}), s) for f in (1e-3, 1e-2, 0.1, 1, 10, 1e2)]
    for name in runs[0]:
        seq = [r[name] for r in runs]
        steps = [sign * (b - a) for a, b in zip(seq, seq[1:])]
        assert min(steps) >= -1e-9, (field, name, seq)
        if name in driven:
            assert seq[0] != pytest.approx(seq[-1]), (field, name, seq)
        else:
            assert seq[0] == pytest.approx(seq[-1]), (field, name, seq)


def _op(*stages) -> M.OpModel:
    """An op of stages ``(name, µs)`` or ``(name, µs, tail µs)``: the latter overlap the stage
    before them."""
    return M.OpModel("op", tuple(M.Stage(st[0], "x", 0, 0, st[1], overlaps=len(st) > 2,
                                         tail_us=st[2] if len(st) > 2 else 0.0)
                                 for st in stages))


def test_stages_in_series_add_and_the_longest_limits():
    m = _op(("a", 3.0), ("b", 7.0), ("c", 2.0))
    assert m.schedule() == [(0.0, 3.0), (3.0, 10.0), (10.0, 12.0)]
    assert m.total_us == 12.0 and m.on_path_us() == [3.0, 7.0, 2.0] and m.limit == "b"


def test_an_overlapping_stage_adds_only_what_outlasts_the_one_it_overlaps():
    """Shorter than the stage it overlaps, it adds only its last batch (its tail) after that
    stage's end, and the overlapped stage limits; longer, its own time from the common start
    decides, it limits, and the overlapped stage is off the critical path."""
    m = _op(("send", 10.0), ("forward", 6.0, 0.0), ("expand", 1.0))
    assert m.total_us == 11.0 and m.limit == "send"
    assert m.on_path_us() == [10.0, 0.0, 1.0]
    m = _op(("send", 10.0), ("forward", 6.0, 2.5), ("expand", 1.0))
    assert m.schedule()[1] == (0.0, 12.5) and m.total_us == 13.5 and m.limit == "send"
    assert m.on_path_us() == [10.0, 2.5, 1.0]
    m = _op(("send", 10.0), ("forward", 14.0, 2.5), ("expand", 1.0))
    assert m.schedule()[1] == (0.0, 14.0) and m.total_us == 15.0 and m.limit == "forward"
    assert m.on_path_us() == [0.0, 14.0, 1.0]
    # longer than the send alone but ending by the send's end and its last batch: the send
    # limits, though the forward's own time is the longest
    m = _op(("send", 10.0), ("forward", 11.0, 3.0), ("expand", 1.0))
    assert m.total_us == 14.0 and m.on_path_us() == [10.0, 3.0, 1.0] and m.limit == "send"
    # a stage after the series starts at the end of the one before: overlap only shortens
    m = _op(("w", 1.0), ("send", 10.0), ("forward", 14.0, 2.5))
    assert m.schedule() == [(0.0, 1.0), (1.0, 11.0), (1.0, 15.0)]
    assert m.on_path_us() == [1.0, 0.0, 14.0] and m.total_us == 15.0
    # two stages in turn overlapping their predecessors all start together
    m = _op(("a", 5.0), ("b", 3.0, 1.0), ("c", 8.0, 0.5))
    assert m.schedule() == [(0.0, 5.0), (0.0, 6.0), (0.0, 8.0)] and m.limit == "c"


@pytest.mark.parametrize("ranks", [16, 32, 64])
def test_the_dispatch_forwards_during_the_send(ranks):
    """The forward starts with the send and ends at the later of its own time and the send's
    end (the last row's arrival) plus its last batch; the expand follows. Every op's stages
    share its total on the critical path, and the limiting stage is the one with the most."""
    s = M.Shape(ranks=ranks)
    d = M.dispatch_model(s)
    send, fwd, expand = d.stages
    assert fwd.overlaps and not send.overlaps and not expand.overlaps and fwd.tail_us > 0
    assert d.total_us == pytest.approx(max(fwd.us, send.us + fwd.tail_us) + expand.us)
    assert d.total_us < sum(st.us for st in d.stages)
    assert d.limit == ("forward" if fwd.us > send.us + fwd.tail_us else "send")
    # weights carried by the dispatch: the entry, the partials and the host sums start together
    c = M.combine_model(s)
    entry, part, sums, out = c.stages
    assert [st.name for st in c.stages if st.overlaps] == ["partials", "host sums"]
    assert c.total_us == pytest.approx(max(entry.us, part.us, sums.us,
                                           max(entry.us, part.us) + sums.tail_us) + out.us)
    assert c.total_us < sum(st.us for st in c.stages)
    # weights at the combine: they cross and are handed out before the partials
    c2 = M.combine_model(dataclasses.replace(s, carry=False))
    w_out, w_in, part2, sums2, out2 = c2.stages
    assert [st.name for st in c2.stages if st.overlaps] == ["host sums"]
    assert c2.total_us == pytest.approx(w_out.us + w_in.us + max(part2.us, sums2.us,
                                        part2.us + sums2.tail_us) + out2.us)
    assert c2.total_us > c.total_us
    for m in (d, c, c2):
        path = m.on_path_us()
        assert sum(path) == pytest.approx(m.total_us)
        assert m.limit_stage is m.stages[path.index(max(path))]
    assert d.stages[0].messages == pytest.approx(s.wire().dispatch.total()[0])


def test_a_fast_nic_leaves_the_forward_limiting_and_the_sums_hide_the_partials():
    """With a NIC far faster than the links inside the host the forward limits the dispatch.
    The host sums overlap the partials (the kernel sends a host's sums once its partials are
    complete), which hides the partials under the sums at EP64, where the sums outlast them
    by far; in series the combine would take the partials longer."""
    s = M.Shape(ranks=16)
    d = M.dispatch_model(s, M.LinkParams(nic_gbps=1e4, nic_latency_us=0.1))
    assert d.limit == "forward" and d.limit_stage.bound == "in host (scaled)"
    assert d.total_us == pytest.approx(d.stages[1].us + d.stages[2].us)
    piped = M.combine_model(M.Shape(ranks=64))
    stages = list(piped.stages)
    i = [st.name for st in stages].index("host sums")
    assert stages[i].overlaps
    stages[i] = dataclasses.replace(stages[i], overlaps=False)
    serial = M.OpModel("combine", tuple(stages))
    assert stages[i].us > stages[i - 1].us
    assert piped.total_us < serial.total_us - stages[i - 1].us / 2
    assert piped.limit == "host sums" and piped.on_path_us()[i - 1] == 0.0


def test_parameters_and_shapes_are_checked():
    with pytest.raises(ValueError, match="nic_gbps"):
        M.LinkParams(nic_gbps=0)
    with pytest.raises(ValueError, match="experts"):
        M.Shape(ranks=16, experts=100)
    with pytest.raises(ValueError, match="gbps"):
        I.HostExchange(1.0, 0.0)
    with pytest.raises(ValueError, match="positive"):
        I.HostExchange.fit([(100, -1.0)])


# -- calibration files ---------------------------------------------------------------------------
#: A made-up calibration for the tests: these lines are not a measurement of anything.
FAKE_LINES = {"forward": (2.0, 900.0), "partials": (1.5, 1200.0), "host sums": (1.0, 2000.0)}


def _fake_calibration(path: Path, date: str = "2030-01-01", machine: str = "1xTEST") -> Path:
    rows = []
    for ep in (16, 64):
        s = M.Shape(ranks=ep)
        for stage, (fixed, gbps) in FAKE_LINES.items():
            nbytes = s.host_rows * (s.row_bytes if stage == "forward" else s.sum_bytes)
            rows.append({"stage": stage, "ranks": ep, "bytes": nbytes,
                         "median_us": fixed + nbytes / (gbps * 1e3)})
    path.write_text(json.dumps({"commit": "0" * 40, "machine": machine, "date": date,
                                "rows": rows}))
    return path


def test_a_calibration_file_gives_the_in_host_stages(tmp_path):
    """The lines through a calibration's points are its own; the model's in-host stages are
    those lines at the stage's bytes, at least their NVLink time, and name the calibration."""
    got = I.load_calibration(_fake_calibration(tmp_path / "x1-ep-calibration.json"))
    assert got.source == "calibrated" and "1xTEST" in got.note
    for stage, c in (("forward", got.forward), ("partials", got.partials),
                     ("host sums", got.host_sums)):
        assert (c.fixed_us, c.gbps) == pytest.approx(FAKE_LINES[stage]), stage
    p = M.LinkParams(in_host=got)
    for ranks in (16, 64):
        s = M.Shape(ranks=ranks)
        fwd = M.dispatch_model(s, p).stages[1]
        moved = s.host_rows * s.row_bytes
        nv = (moved * 7 / 8 + s.hosts * s.tokens * s.topk * 4 * 7) / (M.NVLINK_GBPS * 1e3)
        assert fwd.us == pytest.approx(max(got.forward.us(moved), nv))
        assert fwd.bound == ("NVLink" if nv > got.forward.us(moved) else "in host (calibrated)")
        part = _stage(M.combine_model(s, p), "partials")
        assert part.us >= got.partials.us(s.host_rows * s.sum_bytes) - 1e-9
        sums = _stage(M.combine_model(s, p), "host sums")
        assert sums.us >= got.host_sums.us(s.host_rows * s.sum_bytes) + M.NIC_LATENCY_US - 1e-9


def test_a_bad_calibration_file_is_refused(tmp_path):
    bad = tmp_path / "bad-ep-calibration.json"
    bad.write_text(json.dumps({"rows": [{"stage": "forward", "bytes": 10, "median_us": 1.0}]}))
    with pytest.raises(ValueError, match="partials"):
        I.load_calibration(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        I.load_calibration(bad)


def test_the_newest_calibration_is_the_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(I, "RESULTS", tmp_path)
    assert I.newest_calibration() is None
    assert cli.main(["bench", "ep", "--model"]) == 0
    assert "in host (scaled): the peer kernels on 2xH200" in capsys.readouterr().out
    _fake_calibration(tmp_path / "a-ep-calibration.json", "2030-01-01", "1xOLD")
    _fake_calibration(tmp_path / "b-ep-calibration.json", "2031-01-01", "1xNEW")
    assert I.newest_calibration() == tmp_path / "b-ep-calibration.json"
    assert cli.main(["bench", "ep", "--model"]) == 0
    out = capsys.readouterr().out
    assert "in host (calibrated): calibrated on 1xNEW" in out and "b-ep-calibration.json" in out
    assert cli.main(["bench", "ep", "--model", "--calibration",
                     str(tmp_path / "a-ep-calibration.json")]) == 0
    assert "calibrated on 1xOLD" in capsys.readouterr().out
    assert cli.main(["bench", "ep", "--model", "--no-calibration"]) == 0
    assert "in host (scaled)" in capsys.readouterr().out


def test_cli_prints_the_model_without_starting_processes(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(I, "RESULTS", tmp_path)         # no calibration file: the 2-GPU scaling

    def no_launch(*a, **k):
        raise AssertionError("--model started processes")
    monkeypatch.setattr(spawn, "launch", no_launch)
    assert cli.main(["bench", "ep", "--model"]) == 0
    out = capsys.readouterr().out
    for ep in (16, 32, 64):
        assert f"EP{ep}: " in out
    assert "| dispatch | send | first | NIC |" in out
    assert "| dispatch | forward | during send |" in out
    assert "| combine | host sums | during partials | NIC |" in out
    assert "| dispatch | 44.4 | send | NIC bandwidth |" in out          # EP16, pipelined
    assert "| combine | 48.3 | host sums | NIC bandwidth | <= 55 | met |" in out
    assert "| combine, weights at the combine | " in out
    assert "limited by" in out and "DeepEP V1 low-latency" in out and "not met" in out
    assert cli.main(["bench", "ep", "--model", "--nic-gbps", "90",
                     "--nic-latency-us", "1.5"]) == 0
    assert "NIC 90 GB/s + 1.5 µs" in capsys.readouterr().out


@pytest.mark.parametrize("args, flag", [
    (["--model", "--nic-gbps", "-1"], "--nic-gbps"),
    (["--model", "--nvlink-gbps", "0"], "--nvlink-gbps"),
    (["--model", "--nic-msg-rate", "nan"], "--nic-msg-rate"),
    (["--model", "--nic-latency-us", "inf"], "--nic-latency-us"),
    (["--nic-latency-us", "2"], "--nic-latency-us needs --model"),
    (["--model", "--experts", "100"], "--experts 100"),
    (["--calibration", "x.json"], "--calibration needs --model"),
    (["--no-calibration"], "--no-calibration needs --model"),
    (["--model", "--calibration", "x.json", "--no-calibration"], "exclude each other"),
    (["--model", "--calibration", "/nonexistent/x.json"], "cannot read"),
    (["--calibrate", "--model"], "--calibrate does not take --model"),
    (["--calibrate", "--nic-gbps", "9"], "--calibrate does not take --nic-gbps"),
    (["--calibrate", "--iters", "0"], "--iters must be at least 1"),
])
def test_cli_rejects_a_bad_parameter(capsys, args, flag):
    assert cli.main(["bench", "ep", *args]) == 2
    assert flag in capsys.readouterr().out


def test_cli_rejects_a_parameter_that_is_not_a_number(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "ep", "--model", "--nic-gbps", "fast"])
    assert "--nic-gbps" in capsys.readouterr().err


def test_calibrate_needs_a_gpu(monkeypatch, capsys):
    """Where CUDA is absent (CI), ``--calibrate`` says so and writes nothing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "ep", "--calibrate"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out

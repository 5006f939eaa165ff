"""``llcomm bench soak`` on CPU (two gloo processes, reference backend) with tiny counts: every
kind of op runs, random EP sequences of both APIs run, nothing is wrong, the result file has the
documented keys; and the soak's device-side checker does count a wrong element (so "0 wrong" means
something)."""
import json

import torch

from llcomm import cli
from llcomm.bench import soak

ROW_KEYS = {"op", "impl", "algo", "mode", "dtype", "world_size", "bytes", "median_us", "p10_us",
            "p90_us", "wrong", "count"}


def test_soak_cpu_tiny(tmp_path, capsys):
    path = tmp_path / "soak.json"
    rc = cli.main(["bench", "soak", "--cpu", "--ops", "120", "--ep-every", "8",
                   "--check-every", "40", "--ep-sequences", "2", "--no-progress", "--json",
                   str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    result = json.loads(path.read_text())
    s = result["soak"]
    assert s["ops"] == 120 and s["wrong"] == 0 and s["timeouts"] == 0 and not s["failures"], s
    assert {"commit", "machine", "date", "versions", "rows"} <= set(result)
    for row in result["rows"]:
        assert ROW_KEYS <= set(row), row
    counts = {(r["op"], r["algo"]): r["count"] for r in result["rows"]}
    assert counts[("dispatch", None)] == counts[("combine", None)] == 15
    assert sum(counts.values()) == 120 + 15  # an EP round is one dispatch and one combine
    assert "wrong 0, timeouts 0" in out
    q = s["ep_sequences"]          # 2 per API, on rank 0
    assert q["run"] == 4 and q["failed"] == s["ep_sequences_failed"] == 0, s
    assert q["dispatches"] >= 4 * 2 and q["combines"] >= q["dispatches"], q
    assert "ep sequences: 4 run on rank 0" in out


def test_checker_counts_wrong_elements():
    chk = soak._Checker(torch.device("cpu"), exact_sums=True)
    stack = torch.randn(2, 64).to(torch.bfloat16)
    good = (stack[0].float() + stack[1].float()).to(torch.bfloat16)
    chk.sum("one_shot", good.clone(), stack)
    bad = good.clone()
    bad[5] = float("nan")
    bad[9] += 1
    chk.sum("two_shot", bad, stack)
    moved = stack[1].clone()
    moved.view(torch.int16)[3] ^= 1  # one flipped bit
    chk.bits("broadcast", moved, stack[1])
    loose = soak._Checker(torch.device("cpu"), exact_sums=False)
    loose.sum("one_shot", good, stack)
    loose.sum("lamport", bad, stack)
    got = dict(zip(soak.KINDS, chk.read()))
    assert (got["one_shot"], got["two_shot"], got["broadcast"]) == (0, 2, 1), got
    got = dict(zip(soak.KINDS, loose.read()))
    assert (got["one_shot"], got["lamport"]) == (0, 2), got

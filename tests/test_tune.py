"""``llcomm tune`` and the all_reduce algorithm tables (llcomm/tp/algo_table.py): parsing, merging,
lookup, the resolution order Communicator follows, the converter from a bench result file, and
the command line on a host without GPUs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import llcomm
from _dist import run_distributed
from llcomm.tp import algo_table as T
from llcomm.runtime.settings import TPSettings
from llcomm.commands import tune
from llcomm.tp.api import AUTO_TABLE

REPO = Path(__file__).resolve().parents[1]
BENCH_RESULT = REPO / "bench" / "results" / "h200x2-tp.json"
SHIPPED_H200 = REPO / "llcomm" / "tp" / "tables" / "h200-w2.json"
RUN_TIMEOUT_S = 120
KiB, MiB = 1 << 10, 1 << 20


def _doc(device="NVIDIA H200", world_size=2, rows=((MiB, "lamport"), (8 * MiB, "one_shot"))):
    return {"llcomm_algo_table": 1, "op": "all_reduce", "device": device,
            "world_size": world_size, "rows": [{"max_bytes": m, "algo": a} for m, a in rows]}


def _write(path: Path, doc) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return path


# -- merging and lookup -------------------------------------------------------------------------
def test_winners_and_merge():
    times = {8: {"lamport": 2.0, "one_shot": 4.0, "two_shot": 7.0},
             16: {"lamport": 2.0, "one_shot": 2.0, "two_shot": 7.0},  # tie: TABLE_ALGOS order
             32: {"lamport": None, "one_shot": 5.0, "two_shot": 6.0},  # lamport failed
             64: {"lamport": 9.0, "one_shot": 5.0, "two_shot": 6.0},
             128: {"one_shot": 9.0, "two_shot": 6.0},
             256: {"one_shot": None, "two_shot": None}}                 # nothing ran: dropped
    win = T.winners(times)
    assert win == {8: "lamport", 16: "lamport", 32: "one_shot", 64: "one_shot",
                   128: "two_shot"}
    assert T.merge(win) == [(16, "lamport"), (64, "one_shot"), (128, "two_shot")]
    doc = T.document("NVIDIA H200", 2, times, dtype="bfloat16")
    assert [(r["max_bytes"], r["algo"]) for r in doc["rows"]] == T.merge(win)
    assert doc["times_us"][0] == {"bytes": 8, "lamport": 2.0, "one_shot": 4.0, "two_shot": 7.0}
    with pytest.raises(ValueError, match="nothing to tabulate"):
        T.document("x", 2, {8: {"one_shot": None}})


def test_selection_lookup_boundaries():
    table = T.parse(_doc(rows=((512 * KiB, "lamport"), (8 * MiB, "one_shot"),
                               (16 * MiB, "two_shot"))))
    sel = T.table_selection(table, lamport_cap=MiB)
    assert sel.limits == (512 * KiB, 8 * MiB) and sel.algos == ("lamport", "one_shot", "two_shot")
    for nbytes, algo in ((1, "lamport"), (512 * KiB, "lamport"), (512 * KiB + 2, "one_shot"),
                         (8 * MiB, "one_shot"), (8 * MiB + 2, "two_shot"),
                         (1 << 30, "two_shot")):
        assert sel.choose(nbytes) == algo, nbytes


def test_lamport_beyond_its_buffer_falls_to_the_next_row():
    table = T.parse(_doc(rows=((4 * MiB, "lamport"), (8 * MiB, "one_shot"))))
    sel = T.table_selection(table, lamport_cap=MiB)
    assert sel.choose(MiB) == "lamport" and sel.choose(MiB + 2) == "one_shot"
    assert sel.choose(16 * MiB) == "one_shot"  # above the last row: the last row's algorithm
    only = T.table_selection(T.parse(_doc(rows=((64 * KiB, "lamport"),))), lamport_cap=MiB)
    assert [only.choose(n) for n in (8, 64 * KiB, 512 * KiB, MiB, MiB + 2)] == \
        ["lamport"] * 4 + ["one_shot"]


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("cap", [None, 64 * KiB, MiB])
def test_compiled_rule_equals_first_match(world_size, cap):
    """The sorted lookup gives what the first-match loop over AUTO_TABLE gave."""
    rows = [(limit, algo) for ws, limit, algo in AUTO_TABLE if ws in (None, world_size)]
    sel = T.compile_rows(rows, "two_shot", "rule", cap)
    for k in range(0, 27):
        for nbytes in {max(1, (1 << k) - 2), 1 << k, (1 << k) + 2}:
            expected = "two_shot"
            for limit, algo in rows:
                if nbytes <= limit and not (algo == "lamport" and cap and nbytes > cap):
                    expected = algo
                    break
            assert sel.choose(nbytes) == expected, (nbytes, sel)


# -- parsing --------------------------------------------------------------------------------------
def test_malformed_tables_name_the_file_and_every_problem(tmp_path):
    bad = _doc(rows=((MiB, "lamport"), (MiB, "one_shot"), (0, "three_shot")))
    bad["world_size"] = 1
    path = _write(tmp_path / "bad.json", bad)
    with pytest.raises(T.AlgoTableError) as e:
        T.load(path)
    msg = str(e.value)
    assert str(path) in msg
    assert "world_size=1" in msg and "rows[1].max_bytes=1048576 does not exceed" in msg
    assert "rows[2].algo='three_shot'" in msg and "rows[2].max_bytes=0" in msg
    with pytest.raises(T.AlgoTableError, match=r"not valid JSON"):
        T.load(_write(tmp_path / "trunc.json", '{"rows": ['))
    with pytest.raises(T.AlgoTableError, match="llcomm_algo_table"):
        T.load(_write(tmp_path / "other.json", {"rows": [{"max_bytes": 8, "algo": "one_shot"}],
                                                "device": "H200", "world_size": 2}))
    with pytest.raises(T.AlgoTableError, match="expected a JSON object"):
        T.load(_write(tmp_path / "list.json", "[]"))
    with pytest.raises(T.AlgoTableError, match="non-empty list"):
        T.load(_write(tmp_path / "empty.json", _doc(rows=())))
    with pytest.raises(T.AlgoTableError, match=r"rows\[0\].max_bytes=True"):
        T.parse({**_doc(), "rows": [{"max_bytes": True, "algo": "one_shot"}]})


def test_device_names_match_with_or_without_vendor():
    assert T.device_key("NVIDIA H200") == T.device_key(" h200 ") == "h200"
    assert T.device_key("NVIDIA H100 80GB HBM3") != T.device_key("H100")
    table = T.parse(_doc(device="H200"))
    assert T.matches(table, "NVIDIA H200", 2)
    assert not T.matches(table, "NVIDIA H200", 4) and not T.matches(table, "NVIDIA H100", 2)


# -- resolution order ----------------------------------------------------------------------------
@pytest.fixture
def clean_env(tmp_path, monkeypatch):
    monkeypatch.delenv("LLCOMM_TUNE_TABLE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def _tune_table():
    """LLCOMM_TUNE_TABLE as Communicator reads it."""
    return TPSettings.read(2).tune_table


def test_user_path_default_and_env(clean_env, monkeypatch):
    p = T.user_table_path("NVIDIA H200", 2, _tune_table())
    assert p == clean_env / "cache" / "llcomm" / "tune-nvidia-h200-w2.json"
    monkeypatch.setenv("LLCOMM_TUNE_TABLE", str(clean_env / "mine.json"))
    assert T.user_table_path("NVIDIA H200", 2, _tune_table()) == clean_env / "mine.json"
    monkeypatch.setenv("LLCOMM_TUNE_TABLE", "")        # set but empty: the cache path
    assert T.user_table_path("NVIDIA H200", 2, _tune_table()) == p


def test_resolution_order(clean_env, monkeypatch):
    shipped = clean_env / "shipped"
    _write(shipped / "a-h100.json", _doc(device="NVIDIA H100", rows=((64, "two_shot"),)))
    _write(shipped / "b-h200.json", _doc(device="H200", rows=((64, "one_shot"),)))

    def find(device, world):
        return T.find_table(device, world, _tune_table(), shipped)
    # nothing of the user's: the shipped table for this GPU and world size
    assert find("NVIDIA H200", 2).path.endswith("b-h200.json")
    # another world size or another GPU: no table (Communicator then uses the rule)
    assert find("NVIDIA H200", 4) is None
    assert find("NVIDIA B200", 2) is None
    # the user's cache table wins over the shipped one
    user = _write(T.user_table_path("NVIDIA H200", 2, None), _doc(rows=((128, "lamport"),)))
    assert find("NVIDIA H200", 2).path == str(user)
    # LLCOMM_TUNE_TABLE replaces the cache path
    env = _write(clean_env / "env.json", _doc(rows=((256, "two_shot"),)))
    monkeypatch.setenv("LLCOMM_TUNE_TABLE", str(env))
    assert find("NVIDIA H200", 2).rows == ((256, "two_shot"),)
    # ... a table in it for another GPU is skipped, and the shipped tables apply again
    _write(env, _doc(device="NVIDIA H100", rows=((256, "two_shot"),)))
    assert find("NVIDIA H200", 2).path.endswith("b-h200.json")
    # ... a missing file is skipped (warned), a malformed one is an error naming it
    monkeypatch.setenv("LLCOMM_TUNE_TABLE", str(clean_env / "missing.json"))
    assert find("NVIDIA H200", 2).path.endswith("b-h200.json")
    _write(env, "{not json")
    monkeypatch.setenv("LLCOMM_TUNE_TABLE", str(env))
    with pytest.raises(T.AlgoTableError, match=str(env)):
        find("NVIDIA H200", 2)


def test_shipped_tables_parse(clean_env):
    tables = sorted(T.SHIPPED_DIR.glob("*.json"))
    assert SHIPPED_H200 in tables
    for path in tables:
        T.load(path)
    assert T.find_table("NVIDIA H200", 2, None).path == str(SHIPPED_H200)
    assert T.find_table("NVIDIA H200", 4, None) is None  # world size 4: the rule


# -- the converter from a bench result file ------------------------------------------------------
def test_converter_from_the_h200_bench_result():
    result = json.loads(BENCH_RESULT.read_text())
    doc = tune.table_from_bench(result, source="h200x2-tp.json")
    assert doc["device"] == "H200" and doc["world_size"] == 2 and doc["dtype"] == "bfloat16"
    assert doc["commit"] == result["commit"]
    times = tune.times_from_bench(result)
    assert len(times) == 22 and set(times[8]) == {"lamport", "one_shot", "two_shot"}
    # the run's Lamport slot was 16 MiB (the default at 2 ranks): Lamport measured everywhere
    assert set(times[16 * MiB]) == {"lamport", "one_shot", "two_shot"}
    # every measured size runs its fastest algorithm
    table = T.parse(doc)
    sel = T.table_selection(table, lamport_cap=16 * MiB)
    for nbytes, per in times.items():
        assert sel.choose(nbytes) == min(per, key=per.get), nbytes
    assert [a for _, a in table.rows] == ["lamport", "two_shot"]


def test_shipped_h200_table_is_the_converted_measurement():
    """llcomm/tp/tables/h200-w2.json is generated, not typed: regenerate it to compare."""
    shipped = json.loads(SHIPPED_H200.read_text())
    doc = tune.table_from_bench(json.loads(BENCH_RESULT.read_text()),
                                source="bench/results/h200x2-tp.json")
    assert shipped == json.loads(json.dumps(doc))


def test_converter_refuses_results_without_per_algorithm_rows():
    result = json.loads(BENCH_RESULT.read_text())
    result["rows"] = [r for r in result["rows"] if r.get("requested_algo") == "auto"]
    with pytest.raises(ValueError, match="--algos all"):
        tune.table_from_bench(result, source="x.json")
    with pytest.raises(ValueError, match="--device"):
        tune.device_from_machine("")
    assert tune.device_from_machine("2xH200 NV18") == "H200"


# -- Communicator ------------------------------------------------------------------------------
def _reference_comm(rank, ws):
    comm = llcomm.Communicator(backend="reference", deterministic=True)
    try:
        assert comm.algo_source == "rule llcomm.tp.api.AUTO_TABLE" and comm.deterministic
        assert comm.choose_algo(8) == "lamport" and comm.choose_algo(64 << 20) == "two_shot"
        x = torch.full((16,), float(rank + 1))
        assert comm.all_reduce(x).eq(3.0).all()
    finally:
        comm.close()


def test_reference_communicator_uses_the_rule():
    run_distributed(_reference_comm, 2)


def _peer_comm_table(rank, ws, path):
    os.environ["LLCOMM_TUNE_TABLE"] = path
    comm = llcomm.Communicator(backend="peer", max_bytes=4 * MiB, deterministic=True)
    try:
        assert comm.algo_source == f"table {path}", comm.algo_source
        assert [comm.choose_algo(n) for n in (8, 4 * KiB, 2 * MiB)] == \
            ["two_shot", "lamport", "one_shot"]
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(1024, dtype=dtype, device=comm.device)
            ref = comm.all_reduce(x, algo="one_shot")
            for algo in ("auto", "two_shot"):
                assert torch.equal(comm.all_reduce(x, algo=algo).view(torch.uint8),
                                   ref.view(torch.uint8)), (dtype, algo)
        with pytest.raises(ValueError, match="deterministic=True"):
            comm.all_reduce(torch.ones(8, device=comm.device), algo="lamport")
        comm.check()
    finally:
        comm.close()


@pytest.mark.gpu
def test_peer_communicator_follows_the_user_table(tmp_path):
    path = _write(tmp_path / "t.json", _doc(device=torch.cuda.get_device_name(0), rows=(
        (8, "two_shot"), (64 * KiB, "lamport"), (4 * MiB, "one_shot"))))
    run_distributed(_peer_comm_table, 2, str(path), backend="nccl")


# -- command line ---------------------------------------------------------------------------------
def _llcomm(*args, cwd, env=None):
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "llcomm", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def test_cli_tune_without_gpus_explains_and_exits_2(tmp_path):
    p = _llcomm("tune", cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 2, p.stdout + p.stderr
    assert "peer backend" in p.stdout and "two or more GPUs" in p.stdout
    assert not list(tmp_path.iterdir())


def test_cli_tune_from_bench_writes_the_table(tmp_path):
    p = _llcomm("tune", "--from-bench", str(BENCH_RESULT), "--out", "t.json", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "wrote t.json" in p.stdout and "lamport" in p.stdout
    written = T.load(tmp_path / "t.json")
    assert written.rows == T.load(SHIPPED_H200).rows
    # default output: LLCOMM_TUNE_TABLE
    p = _llcomm("tune", "--from-bench", str(BENCH_RESULT), cwd=tmp_path,
                env={"LLCOMM_TUNE_TABLE": str(tmp_path / "env.json")})
    assert p.returncode == 0 and (tmp_path / "env.json").exists(), p.stdout + p.stderr
    p = _llcomm("tune", "--from-bench", str(tmp_path / "nope.json"), cwd=tmp_path)
    assert p.returncode == 2 and "nope.json" in p.stdout


def test_cli_tune_bad_arguments(tmp_path):
    p = _llcomm("tune", "--sizes", "8,x", "--iters", "0", cwd=tmp_path,
                env={"CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 2
    assert "size 'x'" in p.stdout and "--iters" in p.stdout


# -- on GPUs --------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cli_tune_gpu_then_communicator_uses_it(tmp_path):
    out = tmp_path / "t.json"
    # a 1 MiB Lamport slot (the default at world size 2 is 16 MiB), so 2M is above it
    p = _llcomm("tune", "--sizes", "8,64K,2M", "--iters", "5", "--warmup", "2",
                "--no-progress", "--out", str(out), cwd=tmp_path,
                env={"LLCOMM_LAMPORT_BYTES": str(MiB)})
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    table = T.parse(doc, str(out))
    assert T.matches(table, torch.cuda.get_device_name(0), torch.cuda.device_count())
    assert [t["bytes"] for t in doc["times_us"]] == [8, 64 * KiB, 2 * MiB]
    assert doc["times_us"][-1]["lamport"] is None  # above Lamport's buffer
    assert all(t["one_shot"] and t["two_shot"] for t in doc["times_us"]), doc["times_us"]

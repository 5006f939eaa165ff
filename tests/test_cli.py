"""The command line: ``llcomm bench``, ``llcomm doctor``, ``llcomm check``.

The CPU tests force two gloo processes (``--cpu``) so they behave the same on every host; the
``gpu`` tests run the same commands on the GPUs (one process per GPU).
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _interp import run_in_interpreter

from llcomm import cli
from llcomm.bench import link, options, verify
from llcomm.commands import check, doctor

REPO = Path(__file__).resolve().parents[1]
#: Seconds one CLI run may take before the test fails instead of hanging.
RUN_TIMEOUT_S = 120
ROW_KEYS = {"op", "impl", "algo", "mode", "dtype", "world_size", "bytes", "median_us", "p10_us",
            "p90_us", "wrong"}
HEADER_KEYS = {"commit", "dirty", "machine", "date", "versions", "rows"}


def llcomm(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "llcomm", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def _bench(tmp_path: Path, *extra: str) -> dict:
    p = llcomm("bench", "tp", "--sizes", "8,1K", "--iters", "5", "--warmup", "2",
               "--json", "tmp.json", "--plot", "tmp.png", *extra, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tmp_path / "tmp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((tmp_path / "tmp.json").read_text())
    assert HEADER_KEYS <= set(result)
    assert {"torch", "triton", "nccl"} <= set(result["versions"])
    assert result["rows"]
    for row in result["rows"]:
        assert ROW_KEYS <= set(row), row
    assert {r["bytes"] for r in result["rows"]} == {8, 1024}
    return result


def test_bench_tp_cpu_writes_json_and_plot(tmp_path):
    result = _bench(tmp_path, "--cpu")
    assert result["machine"] == "2xCPU gloo" and result["world_size"] == 2
    assert result["pdl"] is False           # no GPU: no programmatic dependent launch
    for row in result["rows"]:
        assert row["impl"] == "reference" and row["mode"] == "eager", row
        assert row["wrong"] == 0 and row["median_us"] > 0, row
    assert "all_reduce" in (tmp_path / "tmp.json").read_text()
    # The plot can be redrawn from the result file alone.
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "llcomm.bench.plot", "tmp.json", "again.png"],
                       cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=RUN_TIMEOUT_S)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "again.png").stat().st_size > 0


def test_bench_fused_cpu_writes_json(tmp_path):
    from llcomm.bench.fused_ops import OPS
    p = llcomm("bench", "fused", "--cpu", "--tokens", "1,3", "--hidden", "128,256", "--iters",
               "3", "--warmup", "1", "--json", "fused.json", "--no-progress", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    for op in OPS:                                   # one table per op, every op by default
        assert f"# {op} vs " in p.stdout, op
    result = json.loads((tmp_path / "fused.json").read_text())
    assert HEADER_KEYS <= set(result) and result["bench"] == "fused"
    assert result["hidden"] == [128, 256]
    assert {(r["op"], r["impl"], r["hidden"], r["tokens"]) for r in result["rows"]} == {
        (op, impl, h, t) for op in OPS for impl in ("reference", "unfused") for h in (128, 256)
        for t in (1, 3)}
    for row in result["rows"]:
        assert ROW_KEYS <= set(row), row
        assert row["mode"] == "eager", row
        assert row["wrong"] == 0 and row["median_us"] > 0, row
        assert row["bytes"] == row["tokens"] * row["hidden"] * 2, row


def test_bench_fused_one_op_any_hidden(tmp_path):
    """Without the per-group op, rows need not hold whole 128-channel groups."""
    p = llcomm("bench", "fused", "--cpu", "--ops", "all_reduce_rmsnorm", "--tokens", "2",
               "--hidden", "72", "--iters", "2", "--warmup", "1", "--json", "f.json",
               "--no-progress", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads((tmp_path / "f.json").read_text())["rows"]
    assert {(r["op"], r["impl"], r["hidden"]) for r in rows} == {
        ("all_reduce_rmsnorm", impl, 72) for impl in ("reference", "unfused")}
    assert all(r["wrong"] == 0 for r in rows)


def test_bench_fused_bad_arguments(tmp_path):
    p = llcomm("bench", "fused", "--tokens", "0,x", "--hidden", "0", "--ops", "all_reduce,nope",
               cwd=tmp_path)
    assert p.returncode == 2
    assert "--tokens" in p.stdout and "--hidden" in p.stdout and "--ops" in p.stdout
    p = llcomm("bench", "fused", "--hidden", "72", cwd=tmp_path)   # the per-group op is in "all"
    assert p.returncode == 2 and "--hidden 72" in p.stdout and "multiples of 128" in p.stdout


EP_ROW_KEYS = ROW_KEYS | {"tokens_per_rank", "hidden", "num_experts", "topk", "max_tokens", "fp8"}


def test_bench_ep_cpu_writes_json_and_plot(tmp_path):
    p = llcomm("bench", "ep", "--cpu", "--tokens", "1,8", "--hidden", "64", "--experts", "8",
               "--topk", "3", "--iters", "3", "--warmup", "1", "--json", "ep.json", "--plot",
               "ep.png", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "# dispatch" in p.stdout and "# combine" in p.stdout
    assert (tmp_path / "ep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((tmp_path / "ep.json").read_text())
    assert HEADER_KEYS <= set(result) and result["bench"] == "ep"
    rows = result["rows"]
    assert {(r["op"], r["tokens_per_rank"]) for r in rows} == {
        (op, n) for op in ("dispatch", "combine") for n in (1, 8)}
    for row in rows:
        assert EP_ROW_KEYS <= set(row), row
        assert row["impl"] == "reference" and row["mode"] == "eager", row
        assert row["wrong"] == 0 and row["median_us"] > 0 and not row.get("error"), row
        assert (row["hidden"], row["num_experts"], row["topk"]) == (64, 8, 3)
        assert row["max_tokens"] == 8                # the buffer: the largest --tokens
        assert 0 < row["bytes"] <= 8 * 2 * 64 * 2   # at most every token to both ranks
    assert "buffer for 8 tokens per rank" in p.stdout


def test_bench_ep_max_tokens_sizes_the_buffer(tmp_path):
    """--max-tokens sizes the buffer apart from the tokens sent (the dispatch's cost depends on
    it), and is refused below the largest --tokens."""
    p = llcomm("bench", "ep", "--cpu", "--tokens", "2", "--max-tokens", "16", "--hidden", "64",
               "--experts", "8", "--topk", "3", "--iters", "2", "--warmup", "1", "--json",
               "ep.json", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads((tmp_path / "ep.json").read_text())["rows"]
    assert rows and all(r["max_tokens"] == 16 and r["wrong"] == 0 for r in rows), rows
    assert "buffer for 16 tokens per rank" in p.stdout
    for bad in ("4", "-3"):
        p = llcomm("bench", "ep", "--cpu", "--tokens", "1,8", "--max-tokens", bad, cwd=tmp_path)
        assert p.returncode == 2 and f"--max-tokens {bad}" in p.stdout, p.stdout


def test_bench_ep_carry_weights_cpu(tmp_path):
    """--carry-weights: every dispatch carries the weights, combines take None; still checked."""
    p = llcomm("bench", "ep", "--cpu", "--tokens", "1,8", "--hidden", "64", "--experts", "8",
               "--topk", "3", "--iters", "2", "--warmup", "1", "--carry-weights", "--json",
               "ep.json", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "weights carried by the dispatch" in p.stdout
    rows = json.loads((tmp_path / "ep.json").read_text())["rows"]
    assert {r["op"] for r in rows} == {"dispatch", "combine"}
    assert all(r["carry_weights"] and r["wrong"] == 0 and not r.get("error") for r in rows), rows


def _expected_both_ranks_alike(x, idx, W, T, E):
    """The EP bench's oracle in one process: a stand-in for its gather in which every rank sent
    the same tokens (``x``, ``idx``), weights 0.5, the bench's stand-in experts."""
    from llcomm.bench import ep_oracle
    scale, bias = ep_oracle.expert_affine(E, "cpu")
    orig = verify.gather_inputs
    verify.gather_inputs = lambda t: torch.stack([t] * W)
    try:
        w = torch.full((T, idx.shape[1]), 0.5)
        return ep_oracle.Expected(x, idx, w, 0, W, T, scale, bias)
    finally:
        verify.gather_inputs = orig


def test_bench_ep_oracle_catches_a_wrong_byte():
    W, T, H, E = 2, 4, 16, 4
    x = torch.randn(T, H).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]])
    exp = _expected_both_ranks_alike(x, idx, W, T, E)
    assert exp.count.tolist() == [4, 4]          # experts 0 and 1, two tokens each per rank
    recv = torch.zeros(E // W, W * T, H, dtype=torch.bfloat16)
    recv[exp.e, exp.row] = exp.rows

    class Handle:
        src_info = torch.zeros(E // W, W * T, dtype=torch.int32)
    Handle.src_info[exp.e, exp.row] = exp.src
    assert exp.dispatch_wrong(recv, exp.count, Handle) == 0
    recv.view(torch.int16)[1, 0, 3] ^= 1
    assert exp.dispatch_wrong(recv, exp.count, Handle) == 1


def test_doctor_names_the_backend(tmp_path):
    p = llcomm("doctor", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert 'Communicator(backend="auto")' in p.stdout
    assert "NVLink multicast (NVLS):" in p.stdout and "NCCL_NVLS_ENABLE" in p.stdout
    assert "llcomm: does not use multicast" in p.stdout
    assert "must stay off" not in p.stdout and "NOT off" not in p.stdout
    # across hosts: the NVSHMEM facts and the predicted transport, on any machine
    section = p.stdout[p.stdout.index("Across hosts (NVSHMEM):"):]
    for part in ("NVSHMEM: ", "RDMA ports: ", "GPUDirect RDMA: ", "GDRCopy: ", "settings: ",
                 "remote transport: "):
        assert part in section, part
    if not torch.cuda.is_available():
        assert '"reference"' in p.stdout
        assert "programmatic dependent launch (LLCOMM_PDL): off (no CUDA GPU)" in p.stdout


def test_doctor_without_nvshmem_says_so(monkeypatch):
    monkeypatch.setattr(doctor.transport, "find_nvshmem", lambda: None)
    text = "\n".join(doctor.report())
    assert "Across hosts (NVSHMEM):\n  NVSHMEM: not installed" in text
    assert "remote transport: unknown: no NVSHMEM wheel" in text


def test_doctor_launch_line(monkeypatch):
    assert doctor.launch_line(True).startswith("kernel launches: direct")   # this Triton
    assert doctor.launch_line(False) == "kernel launches: none (Triton not usable)"
    monkeypatch.setattr(doctor.launch, "triton_unchecked", lambda: "Triton 9.0.0 is outside")
    assert doctor.launch_line(True).endswith("kernel[grid](...), slower per eager call "
                                             "(Triton 9.0.0 is outside)")


def test_doctor_pdl_line(monkeypatch):
    """The PDL line says off, and why, for each reason; on where nothing stands in the way."""
    from llcomm.runtime import launch
    monkeypatch.setenv("LLCOMM_PDL", "0")
    assert doctor.pdl_line(2, True).endswith("off (LLCOMM_PDL=0)")
    monkeypatch.setenv("LLCOMM_PDL", "yes")
    assert "invalid setting (LLCOMM_PDL='yes': expected 0 or 1)" in doctor.pdl_line(2, True)
    monkeypatch.delenv("LLCOMM_PDL")
    assert doctor.pdl_line(0, True).endswith("off (no CUDA GPU)")
    assert doctor.pdl_line(2, False).endswith("off (Triton not importable)")
    monkeypatch.setattr(launch, "pdl_unavailable", lambda device: "sm_80 is older than sm_90")
    assert doctor.pdl_line(2, True).endswith("off (sm_80 is older than sm_90)")
    monkeypatch.setattr(launch, "pdl_unavailable", lambda device: None)
    assert doctor.pdl_line(2, True).endswith(": on")


def test_doctor_multicast_section_reports_the_settings():
    """Neutral: what the GPUs report and how NCCL / torch are set, no advice either way."""
    lines = doctor.multicast_lines([True, True], {})
    text = "\n".join(lines)
    assert "GPUs: supported (driver attribute MULTICAST_SUPPORTED, all 2)" in text
    assert "NCCL: NVLS used where NCCL finds it supported (NCCL_NVLS_ENABLE unset)" in text
    assert ("torch symmetric memory: rendezvous sets up a multicast object where the GPUs "
            "support it (TORCH_SYMM_MEM_DISABLE_MULTICAST unset)") in text
    text = "\n".join(doctor.multicast_lines(
        [True, False, None], {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}))
    assert "GPU0 supported, GPU1 not supported, GPU2 unknown (not readable)" in text
    assert "NCCL: NVLS off (NCCL_NVLS_ENABLE=0)" in text
    assert ("torch symmetric memory: no multicast object "
            "(TORCH_SYMM_MEM_DISABLE_MULTICAST=1)") in text
    assert "GPUs: no CUDA GPU" in "\n".join(doctor.multicast_lines([], {}))


def test_doctor_multicast_support_reads_the_device_attribute(monkeypatch):
    """The driver is asked for CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED of each GPU, and nothing
    that creates a multicast object; a failed query is None, a missing driver all None."""
    asked = []

    class FakeDriver:
        def cuInit(self, flags):
            return 0

        def cuDeviceGet(self, dev, ordinal):
            dev._obj.value = 10 + ordinal
            return 0

        def cuDeviceGetAttribute(self, val, attr, dev):
            asked.append((attr, dev.value))
            if dev.value == 12:
                return 1                                   # CUDA_ERROR_INVALID_VALUE
            val._obj.value = 1 if dev.value == 10 else 0
            return 0

        def __getattr__(self, name):
            raise AssertionError(f"doctor called {name}")

    monkeypatch.setattr(doctor.ctypes, "CDLL", lambda name: FakeDriver())
    assert doctor.multicast_support(3) == [True, False, None]
    assert asked == [(132, 10), (132, 11), (132, 12)]
    assert doctor.multicast_support(0) == []

    def no_driver(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(doctor.ctypes, "CDLL", no_driver)
    assert doctor.multicast_support(2) == [None, None]


def _rank_env(rank, world, names):
    return {n: os.environ.get(n) for n in names}


def test_launch_leaves_multicast_settings_unless_asked(monkeypatch):
    """Benchmarks pass the user's multicast settings on; --no-multicast switches it off."""
    from llcomm.bench import spawn
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    names = list(spawn.MULTICAST_OFF_ENV)
    got = spawn.launch(_rank_env, names, force_cpu=True)
    assert got["NCCL_NVLS_ENABLE"] == "1" and got["TORCH_SYMM_MEM_DISABLE_MULTICAST"] is None
    assert spawn.launch(_rank_env, names, force_cpu=True, multicast_off=True) == \
        spawn.MULTICAST_OFF_ENV
    assert os.environ["NCCL_NVLS_ENABLE"] == "1"           # the caller's own is untouched


def test_check_passes_on_cpu(tmp_path):
    p = llcomm("check", "--cpu", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASS" in p.stdout and "FAIL" not in p.stdout
    for op in ("all_reduce", "broadcast", "all_gather", "all_gather_2d", "reduce_scatter",
               "ep fp8 carry hook", "ep round_scale", "ep random sequence",
               "deep_ep ue8m0 hook +zero-copy", "deep_ep random sequence",
               "all_reduce_residual_rmsnorm[auto]", "all_reduce_rmsnorm[auto]",
               "all_reduce_residual_rmsnorm_fp8[auto]",
               "all_reduce_residual_rmsnorm_fp8_per_group[auto] round_scale"):
        assert op in p.stdout
    # 54 TP checks, 30 fused joins (5 variants x 2 shapes x 3 dtypes), 12 EPBuffer variants and
    # 8 deep_ep ones, a random sequence per API
    assert "# 106 of 106 checks passed" in p.stdout, p.stdout


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed (pip install -e '.[hf]')")
def test_bench_decode_cpu_writes_json_and_plot(tmp_path):
    p = llcomm("bench", "decode", "--cpu", "--batches", "1,2", "--iters", "2", "--warmup", "1",
               "--json", "d.json", "--plot", "d.png", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "tp: dense-70b" in p.stdout and "ep: deepseek-v3-moe" in p.stdout
    assert "LlamaDecoderLayer" in p.stdout and "Qwen3MoeSparseMoeBlock" in p.stdout
    assert (tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((tmp_path / "d.json").read_text())
    assert HEADER_KEYS <= set(result) and result["bench"] == "decode"
    rows = result["rows"]
    assert {(r["part"], r["impl"], r["batch"]) for r in rows} == {
        *(("tp", i, b) for i in ("none", "reference", "reference_fused") for b in (1, 2)),
        ("ep", "none", 4), ("ep", "reference", 4)}
    for row in rows:
        assert ROW_KEYS | {"model", "batch", "ms_per_step"} <= set(row), row
        assert row["op"] == "decode_step" and row["mode"] == "eager" and not row.get("error")
        assert row["ms_per_step"] > 0 and row["tokens_per_s"] > 0
        if row["impl"] != "none":
            assert row["comm_ms"] is not None
    for row in rows:                # the TP all-reduce left both ranks the same bits
        if row["part"] == "tp" and row["impl"] != "none":
            assert row["wrong"] == 0, row
        if row["part"] == "tp":
            assert row["context"] == 16, row


def test_bench_decode_bad_shapes_name_the_option():
    from llcomm.bench import decode
    from llcomm.bench import decode_models as M

    parser = argparse.ArgumentParser()
    decode.add_arguments(parser)
    with pytest.raises(ValueError, match="--context must be at least 1"):
        decode.config_from_args(parser.parse_args(["--context", "0"]), on_cpu=True)
    cfg = decode.config_from_args(parser.parse_args(["--context", "5"]), on_cpu=True)
    assert cfg.dense.context == 5 and cfg.dense.hidden == M.DENSE_CPU.hidden
    odd = M.DenseShape(hidden=64, q_heads=3, kv_heads=3, head_dim=16, intermediate=96)
    with pytest.raises(ValueError, match="q_heads=3, kv_heads=3 not a multiple of the world "
                                         "size 2"):
        M.DenseTP(odd, M.Group(0, 2), 1, 0, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="rows=0"):
        from llcomm.hf.moe_ep import ExpertParallelMoE
        ExpertParallelMoE(None, None, rows=0)


def test_bench_decode_without_transformers_says_so(monkeypatch, capsys):
    """Where transformers is missing, ``llcomm bench decode`` names the hf extra and exits 2
    (no traceback, no processes started)."""
    import llcomm.hf
    from llcomm.bench import decode

    monkeypatch.setattr(llcomm.hf, "transformers_available", lambda: False)
    started = []
    monkeypatch.setattr(decode.spawn, "launch", lambda *a, **k: started.append(a))
    assert decode.run(argparse.Namespace(cpu=True)) == 2
    out = capsys.readouterr().out
    assert "transformers is not installed" in out and "llcomm[hf]" in out, out
    assert started == []
    with pytest.raises(ImportError, match=r"llcomm\[hf\]"):
        llcomm.hf.require_transformers("x")


def test_bench_subcommands_and_default(capsys):
    assert set(cli.BENCHES) == {"tp", "fused", "ep", "decode", "soak", "link"}
    assert cli._default_bench(["bench", "--sizes", "8"]) == ["bench", "tp", "--sizes", "8"]
    assert cli._default_bench(["bench"]) == ["bench", "tp"]
    assert cli._default_bench(["bench", "-h"]) == ["bench", "-h"]


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this host can run the probe")
def test_bench_link_says_why_it_cannot_run(tmp_path):
    """Without two peer GPUs `llcomm bench link` says so and exits 2 (as `llcomm tune`), and
    refuses bad options first."""
    p = llcomm("bench", "link", cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "llcomm bench link: needs two or more CUDA GPUs with peer access" in p.stdout
    assert "Traceback" not in p.stderr
    p = llcomm("bench", "link", "--sizes", "64K,24", "--blocks", "-1", cwd=tmp_path)
    assert p.returncode == 2 and "--sizes" in p.stdout and "--blocks" in p.stdout, p.stdout
    p = llcomm("bench", "link", "--help", cwd=tmp_path)
    assert p.returncode == 0 and "--no-multicast" in p.stdout


def test_bench_link_routing():
    """Whose words land where: a push writes into the next GPU's buffer, a pull reads the next
    GPU's; in pattern 'one' only GPU 0 moves data."""
    for W in (2, 3, 4):
        for way in ("copy_engine", "sm_push"):
            assert [link.sender_of(way, "all", r, W) for r in range(W)] == \
                [(r - 1) % W for r in range(W)]
            assert [link.sender_of(way, "one", r, W) for r in range(W)] == \
                [0 if r == 1 else None for r in range(W)]
        assert [link.sender_of("sm_pull", "all", r, W) for r in range(W)] == \
            [(r + 1) % W for r in range(W)]
        assert [link.sender_of("sm_pull", "one", r, W) for r in range(W)] == \
            [1] + [None] * (W - 1)


def simulate_link_move(n: int, blocks: int) -> list[int]:
    """Under the Triton interpreter: link's kernel moves ``n`` words with ``blocks`` blocks;
    returns the destination (one word past ``n`` included, which must stay untouched)."""
    from llcomm.bench.link import POISON, pattern_of
    from llcomm.bench.link_kernel import move
    src = pattern_of(3, n + 1, "cpu")
    dst = torch.full((n + 1,), POISON, dtype=torch.int32)
    move[(blocks,)](src, dst, n, BLOCK=link.WARPS * 32 * 4)
    return dst.tolist()


def test_bench_link_kernel_moves_every_word():
    n, blocks = 3 * 1024 + 5, 2          # more words than one step of all blocks, a ragged end
    got = run_in_interpreter("test_cli", "simulate_link_move", n, blocks)
    want = link.pattern_of(3, n, "cpu").tolist()
    assert got[:n] == want and got[n] == link.POISON


def test_bad_arguments_are_refused(tmp_path):
    p = llcomm("bench", "--sizes", "8,x", "--ops", "nope", cwd=tmp_path)
    assert p.returncode == 2
    assert "--ops" in p.stdout and "size 'x'" in p.stdout


def test_sizes_and_oracles():
    assert options.parse_sizes("8,64K,1M") == [8, 65536, 1 << 20]
    assert options.parse_sizes(None)[0] == 8 and options.parse_sizes(None)[-1] == 16 << 20
    assert len(options.parse_sizes(None)) == 22
    stack = torch.randn(3, 100, dtype=torch.bfloat16)
    exp = verify.rank_order_sum(stack, torch.bfloat16)
    assert verify.count_wrong(exp.clone(), exp) == 0
    bad = exp.clone()
    bad.view(torch.int16)[7] ^= 1                       # one flipped bit is wrong
    assert verify.count_wrong(bad, exp) == 1
    bound = verify.sum_bound(stack, torch.bfloat16)
    exact = stack.double().sum(0)
    assert verify.count_wrong(exp, exact, bound) == 0  # rounding is within the bound
    assert verify.count_wrong(verify.poison_(exp.clone()), exact, bound) == 100  # NaN is wrong


def test_predict_backend():
    assert doctor.predict_backend(0, [], True)[0] == "reference"
    assert doctor.predict_backend(1, [[True]], True)[0] == "reference"
    backend, why = doctor.predict_backend(2, [[True, False], [True, True]], True)
    assert backend == "reference" and "GPU 0 cannot access GPU 1" in why
    assert doctor.predict_backend(2, [[True, True], [True, True]], True)[0] == "peer"
    assert "Triton" in doctor.predict_backend(2, [[True, True], [True, True]], False)[1]


def test_check_summary_reports_failures():
    res = {"results": [
        {"op": "all_reduce[auto]", "count": 1, "dtype": "bfloat16", "mode": "eager", "wrong": 0,
         "error": None},
        {"op": "all_reduce[auto]", "count": 1, "dtype": "float16", "mode": "eager", "wrong": 3,
         "error": None}]}
    lines, failures = check.summarize(res)
    assert failures == 1 and lines[0].startswith("FAIL") and "3 wrong" in lines[1]


@pytest.mark.gpu
def test_bench_tp_gpu(tmp_path):
    result = _bench(tmp_path, "--ops", "all", "--algos", "all")
    mine = [r for r in result["rows"] if r["impl"] in ("llcomm", "reference")]
    assert {r["mode"] for r in mine} == {"graph", "eager"}
    for row in mine:
        assert not row.get("error") and row["wrong"] == 0, row
    assert {"nccl", "torch_one_shot", "torch_two_shot"} <= {r["impl"] for r in result["rows"]}


@pytest.mark.gpu
def test_bench_ep_gpu(tmp_path):
    p = llcomm("bench", "ep", "--tokens", "1,128", "--iters", "5", "--warmup", "1",
               "--json", "ep.json", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads((tmp_path / "ep.json").read_text())["rows"]
    assert {(r["impl"], r["mode"]) for r in rows} == {
        (i, m) for i in ("llcomm", "reference") for m in ("graph", "eager")}
    for row in rows:
        assert row["wrong"] == 0, row
        assert row["impl"] != "llcomm" or not row.get("error"), row


@pytest.mark.gpu
@pytest.mark.parametrize("round_scale", [False, True])
def test_bench_ep_fp8_overlap_gpu(tmp_path, round_scale):
    p = llcomm("bench", "ep", "--tokens", "1,128", "--iters", "5", "--warmup", "1", "--fp8",
               "--overlap", *(["--round-scale"] if round_scale else []), "--json", "ep.json",
               cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads((tmp_path / "ep.json").read_text())["rows"]
    for op in ("dispatch_fp8", "overlap_step"):
        llc = [r for r in rows if r["op"] == op and r["impl"] == "llcomm"]
        assert {r["mode"] for r in llc} == {"graph", "eager"}, op
        for row in llc:
            assert row["wrong"] == 0 and not row.get("error"), row
    for row in rows:
        assert row["wrong"] in (0, None), row


@pytest.mark.gpu
def test_bench_decode_gpu(tmp_path):
    p = llcomm("bench", "decode", "--layers", "2", "--batches", "1,8", "--moe-layers", "1",
               "--iters", "3", "--warmup", "1", "--json", "d.json", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads((tmp_path / "d.json").read_text())["rows"]
    assert {"none", "llcomm", "nccl", "reference"} <= {r["impl"] for r in rows}
    for row in rows:
        if row["impl"] == "llcomm":
            assert row["wrong"] == 0 and not row.get("error"), row


@pytest.mark.gpu
def test_check_passes_on_gpu(tmp_path):
    p = llcomm("check", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr


def test_bench_ep_cpu_fp8_and_overlap(tmp_path):
    p = llcomm("bench", "ep", "--cpu", "--tokens", "1,8", "--hidden", "128", "--experts", "8",
               "--topk", "3", "--iters", "2", "--warmup", "1", "--fp8", "--round-scale",
               "--overlap", "--json", "ep.json", "--plot", "ep.png", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "# dispatch_fp8 (round_scale)" in p.stdout and "# overlap_step" in p.stdout
    rows = json.loads((tmp_path / "ep.json").read_text())["rows"]
    fp8 = [r for r in rows if r["op"] == "dispatch_fp8"]
    assert {r["tokens_per_rank"] for r in fp8} == {1, 8}
    for r in fp8:
        assert r["fp8"] and r["round_scale"] and r["wrong"] == 0 and not r.get("error"), r
        bf16 = next(b for b in rows if b["op"] == "dispatch"
                    and b["tokens_per_rank"] == r["tokens_per_rank"])
        assert r["bytes"] * 128 == bf16["bytes"] * 66     # (128 + 4) bytes per row, not 256
    steps = [r for r in rows if r["op"] == "overlap_step"]
    assert {(r["tokens_per_rank"], r["recv_hook"]) for r in steps} == {
        (n, h) for n in (1, 8) for h in (False, True)}
    for r in steps:
        assert EP_ROW_KEYS <= set(r) and r["micro_batches"] == 2, r
        assert r["wrong"] == 0 and r["median_us"] > 0 and not r.get("error"), r
        assert r["algo"] == ("recv_hook" if r["recv_hook"] else "plain")
        assert ("saving_us" in r) == r["recv_hook"]


def test_bench_ep_fp8_option_errors(tmp_path):
    p = llcomm("bench", "ep", "--cpu", "--hidden", "64", "--fp8", cwd=tmp_path)
    assert p.returncode == 2 and "multiple of 128" in p.stdout, p.stdout
    p = llcomm("bench", "ep", "--cpu", "--round-scale", cwd=tmp_path)
    assert p.returncode == 2 and "--round-scale needs --fp8" in p.stdout, p.stdout


@pytest.mark.parametrize("round_scale", [False, True])
def test_bench_ep_fp8_oracle_matches_ep_fp8(round_scale):
    """The bench's own quantiser and llcomm.runtime.fp8_format (what the reference backend sends)
    agree byte for byte, on blocks that reach the corners: zeros, -0.0, tiny (subnormal scales),
    huge, e4m3 ties and subnormal codes."""
    from llcomm.bench import ep_oracle
    from llcomm.runtime.fp8_format import quantize
    g = torch.Generator().manual_seed(3)
    H = 128
    rows = [torch.randn(64, H, generator=g) * 10.0 ** torch.randint(-6, 6, (64, 1), generator=g),
            torch.zeros(1, H), -torch.zeros(1, H),
            torch.randn(2, H, generator=g) * 1e-40, torch.randn(2, H, generator=g) * 1e38]
    tie = torch.full((1, H), 448.0)                  # scale 1 (amax 448): x / 1 lands on ...
    tie[0, 1:9] = torch.tensor([1.0625, 1.1875, 0.0029296875, -0.0048828125, 17.0, 19.0,
                                -208.0, 240.0])      # ... e4m3 midpoints (ties to even)
    x = torch.cat(rows + [tie])
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        codes, scales = ep_oracle.fp8_oracle(xd, round_scale)
        q, s = quantize(xd, round_scale=round_scale)
        assert torch.equal(codes, q.view(torch.uint8)), dtype
        assert torch.equal(scales.view(torch.int32), s.view(torch.int32)), dtype


def test_bench_ep_fp8_check_catches_a_wrong_byte():
    W, T, H, E = 2, 4, 128, 4
    x = torch.randn(T, H).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]])
    exp = _expected_both_ranks_alike(x, idx, W, T, E)
    from llcomm.runtime.fp8_format import quantize
    q, s = quantize(exp.rows, round_scale=True)
    codes = torch.zeros(E // W, W * T, H, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(E // W, W * T, 1)
    codes[exp.e, exp.row], scales[exp.e, exp.row] = q, s

    class Handle:
        src_info = torch.zeros(E // W, W * T, dtype=torch.int32)
    Handle.src_info[exp.e, exp.row] = exp.src
    assert exp.dispatch_fp8_wrong((codes, scales), exp.count, Handle, True) == 0
    assert exp.dispatch_fp8_wrong((codes, scales), exp.count, Handle, False) > 0
    codes.view(torch.uint8)[1, 0, 5] ^= 1
    scales.view(torch.int32)[0, 1, 0] ^= 1
    assert exp.dispatch_fp8_wrong((codes, scales), exp.count, Handle, True) == 2

"""``llcomm bench ep --ranks-per-host N`` on CPU: the two-level kernels
(``llcomm/ep/hosts/kernels/*.py``) in Triton's interpreter, on the bench's own inputs, for the
bytes they put across hosts as they count them.

The bench's ranks are processes, while the kernels' simulated heap (one CPU region per virtual
rank, the rail puts as plain stores: ``SHMEM`` = 0) needs every rank in one process. So rank 0
runs them in a child process with ``TRITON_INTERPRET=1`` (Triton reads it at import), on every
rank's inputs: stage group by stage group, the ranks in turn, with NUM_BLOCKS blocks; the
messages across hosts go through the simulated NIC (``llcomm/ep/hosts/nic.py``), which lands
them lazily while the waits poll. Each rank then checks its results against its own oracle
(``ep_oracle.Expected``): the dispatch byte for byte, the combine within the interpreter's bf16
rounding (it truncates fp32 to bf16 where a GPU rounds to nearest even, at two roundings: an
element counts as wrong beyond 2^-5 of itself plus 2^-5 of the largest value, as in the
interpreter tests; a wrong row or weight is off by far more). The rows carry no time: an
interpreter's would mean nothing.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import types

import torch
import torch.distributed as dist

from . import spawn, verify

#: Blocks per kernel: each block of a launch runs in turn in the interpreter. The signals'
#: share of the bytes grows with it (8 bytes per block and other host, each way).
NUM_BLOCKS = 2
#: The seed of the simulated NIC, which lands the messages across hosts lazily
#: (``llcomm/ep/hosts/nic.py``).
NIC_SEED = 0
#: The impl name of these rows.
IMPL = "interpreter"
#: Where the simulated heap and every tensor of the child live.
CPU = torch.device("cpu")


def simulate(case: dict) -> dict:
    """In the child: one dispatch and one combine of every rank (``case``: ``xs``, ``idx``,
    ``w`` per rank, ``scale`` and ``bias`` of the stand-in experts, ``ranks_per_host``,
    ``max_tokens``, ``timeout_us``). Returns per rank ``recv_count``, ``recv_x``, ``src_info``,
    ``out`` and ``bytes`` (dispatch, combine)."""
    from ..ep.hosts.layout import hosts_layout
    from ..ep.hosts.nic import simulated_heap
    from ..ep.hosts.peer import hosts_consts, ledger_by_rank, ledger_bytes, size_tag
    from ..ep.hosts.kernels import combine as HC
    from ..ep.hosts.kernels import dispatch as HD
    from ..runtime import protocol as P

    xs, idx, w = case["xs"], case["idx"], case["w"]
    W, R, T = len(xs), case["ranks_per_host"], case["max_tokens"]
    N, (n, H), K, E = W // R, xs[0].shape, idx[0].shape[1], case["scale"].shape[0]
    L, dtype, NB = E // W, xs[0].dtype, NUM_BLOCKS
    lay = hosts_layout(T, H, N, R, K, dtype.itemsize, NB, False, E)
    heap, tab, host_words, err, ctrl, ledger = simulated_heap(lay, NB, nic_seed=NIC_SEED)
    dc, cc, _ = hosts_consts(lay, E, K, 0)
    recv = [torch.full((L, W * T, H), float("nan"), dtype=dtype, device=CPU) for _ in range(W)]
    src = [torch.full((L, W * T), -1, dtype=torch.int32, device=CPU) for _ in range(W)]
    cnt = [torch.full((L,), -1, dtype=torch.int32, device=CPU) for _ in range(W)]
    row_of = [torch.zeros((W, T, K), dtype=torch.int32, device=CPU) for _ in range(W)]
    ntok = [torch.zeros(W, dtype=torch.int32, device=CPU) for _ in range(W)]
    fwd_ids = [torch.zeros((N, T, K), dtype=torch.int32, device=CPU) for _ in range(W)]
    fwd_ntok = [torch.zeros(N, dtype=torch.int32, device=CPU) for _ in range(W)]
    for stages in HD.HOSTS_DISPATCH_STEPS:     # each group after the one before it on every rank
        for r in range(W):
            HD.hosts_dispatch_kernel[(NB,)](
                xs[r], idx[r], n, recv[r], recv[r], row_of[r], src[r], cnt[r], ntok[r],
                fwd_ids[r], fwd_ntok[r], tab, ctrl[r][0], err[r], r,
                size_tag(P.OP_DISPATCH, H, K, 0, dtype), case["timeout_us"], ledger[r][0], None,
                **dict(dc, STAGES=stages, SHMEM=0))
    # the stand-in experts: y = x * scale[g] + bias[g], g the row's global expert
    g = torch.arange(W * L, dtype=torch.int64, device=CPU).view(W, L, 1, 1)
    eo = [(recv[r].float() * case["scale"][g[r]] + case["bias"][g[r]]).to(dtype)
          for r in range(W)]
    out = [torch.full((n, H), float("nan"), dtype=dtype, device=CPU) for _ in range(W)]
    for stages in HC.HOSTS_COMBINE_STEPS:
        for r in range(W):
            HC.hosts_combine_kernel[(NB,)](
                eo[r], idx[r], w[r], n, out[r], row_of[r], ntok[r], fwd_ids[r], fwd_ntok[r], tab,
                ctrl[r][1], err[r], r, size_tag(P.OP_COMBINE, H, K, 0, dtype),
                case["timeout_us"], ledger[r][1], None, **dict(cc, STAGES=stages, SHMEM=0))
    failed = [r for r in range(W) if int(err[r][0]) or int(host_words[r][0])]
    return {"recv_count": cnt, "recv_x": recv, "src_info": src, "out": out, "failed": failed,
            "bytes": [(ledger_bytes(ledger[r][0]), ledger_bytes(ledger[r][1])) for r in range(W)],
            "wire": [(ledger_by_rank(ledger[r][0], r, R), ledger_by_rank(ledger[r][1], r, R))
                     for r in range(W)]}


def run_child(case: dict) -> dict:
    """``simulate(case)`` in a child process under the interpreter."""
    with tempfile.TemporaryDirectory() as d:
        inp, outp = os.path.join(d, "case.pt"), os.path.join(d, "result.pt")
        torch.save(case, inp)
        env = dict(os.environ, TRITON_INTERPRET="1")
        p = subprocess.run([sys.executable, "-m", "llcomm.bench.ep_interp", inp, outp], env=env,
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"the interpreter run failed:\n{p.stderr[-3000:]}")
        return torch.load(outp)


def _wrong_elements(got: torch.Tensor, want: torch.Tensor) -> int:
    """Elements of ``got`` further from ``want`` than the interpreter's bf16 rounding allows
    (module doc; NaN counts as wrong)."""
    scale = 1 + float(want.float().abs().max()) if want.numel() else 1.0
    return int((~torch.isclose(got.float(), want.float(), rtol=2 ** -5, atol=2 ** -5 * scale))
               .sum())


def print_wire_ledger(wire: list, only: str | None = None) -> None:
    """Per rank, what its dispatch and combine (``wire[r]``: their ledgers; ``only``: just
    that op) sent across hosts as the kernels counted it (``HostsPeerEP.wire_ledger``):
    messages, flags and bytes to each destination rank."""
    print("# wire ledger (two-level kernels): rank -> destination: messages / flags / bytes")
    for r, (d, c) in enumerate(wire):
        for op, led in (("dispatch", d), ("combine", c)):
            if only is not None and op != only:
                continue
            parts = [f"{q}: {m} / {f} / {b}" for q, (m, f, b) in sorted(led.items())]
            print(f"#   rank {r} {op:8s} " + ("; ".join(parts) or "nothing"))


def interpreter_rows(R, x, idx, w, exp, base: dict, with_bytes) -> list[dict]:
    """The dispatch and combine rows of the kernels in the interpreter for one token count
    (every rank's ``x``, ``idx``, ``w``; ``exp`` this rank's oracle). A collective.
    ``with_bytes(buf, rows, idx, row_bytes)`` adds the byte columns as for the other rows."""
    world, cfg = R.world, R.cfg
    case = {"xs": list(verify.gather_bytes(x)), "idx": list(verify.gather_inputs(idx)),
            "w": list(verify.gather_inputs(w)), "scale": R.scale, "bias": R.bias,
            "ranks_per_host": R.hosts.ranks_per_host, "max_tokens": cfg.buffer_tokens,
            "timeout_us": 60_000_000}
    box = [None]
    if R.rank == 0:
        try:
            res = run_child(case)
            box = [{k: (v[r] if isinstance(v, list) and k != "failed" else v)
                    for k, v in res.items()} for r in range(world)]
        except RuntimeError as e:
            box = [{"error": str(e)} for _ in range(world)]
    part = [None]
    dist.scatter_object_list(part, box if R.rank == 0 else None, src=0)
    mine = part[0]
    rows = []
    for op in ("dispatch", "combine"):
        row = {**base, "op": op, "impl": IMPL, "algo": "two-level", "mode": "interpreter",
               "median_us": None, "p10_us": None, "p90_us": None, "num_blocks": NUM_BLOCKS}
        if "error" in mine:
            row.update(wrong=None, error=mine["error"][-500:])
        elif op == "dispatch":
            cnt, rx, si = mine["recv_count"], mine["recv_x"], mine["src_info"]
            bad = int(not torch.equal(cnt, exp.count.cpu()))
            if not bad:
                e, r_ = exp.e.cpu(), exp.row.cpu()
                bad = int((rx[e, r_].view(torch.uint8) != exp.rows.cpu().view(torch.uint8))
                          .any(-1).sum() + (si[e, r_] != exp.src.cpu()).sum())
            row["wrong"] = bad + int(R.rank in mine["failed"])
        else:
            row["wrong"] = _wrong_elements(mine["out"], exp.combine.cpu())
        rows.append(row)
    for row in rows:        # summed over ranks, as the other rows' (a collective each)
        if row["wrong"] is not None:
            row["wrong"] = spawn.sum_over_ranks(row["wrong"], R.device)
    if "error" in mine:
        return rows
    d_bytes, c_bytes = mine["bytes"]
    d_wire, c_wire = mine["wire"]
    row_bytes = cfg.hidden * x.dtype.itemsize
    return (with_bytes(types.SimpleNamespace(last_inter_host_bytes=d_bytes,
                                             last_wire_ledger=d_wire), rows[:1], idx, row_bytes)
            + with_bytes(types.SimpleNamespace(last_inter_host_bytes=c_bytes,
                                               last_wire_ledger=c_wire), rows[1:], idx,
                         row_bytes))


def main(argv: list[str]) -> int:
    torch.save(simulate(torch.load(argv[0])), argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

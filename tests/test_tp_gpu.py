"""GPU tests of the peer backend (2 GPUs, NCCL group): every op against an fp32 rank-order oracle,
NCCL (the reference backend) and across ranks, under repetition, resizing, CUDA-graph replay,
and with a peer that never arrives. Run on a 2-GPU host: ``python -m pytest -m gpu -q``."""

import pytest
import torch
import torch.distributed as dist

from _dist import absent_peer_error, run_distributed
from llcomm.bench.timing import capture

pytestmark = pytest.mark.gpu

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_BYTES = 4 << 20
ALGOS = ("one_shot", "two_shot", "lamport")


def _comm(**kw):
    import llcomm
    return llcomm.Communicator(max_bytes=kw.pop("max_bytes", MAX_BYTES), backend="peer", **kw)


def _inputs(n, dtype, seed, rank):
    """Fresh random operand of rank ``rank`` and every rank's operand (gathered)."""
    g = torch.Generator(device="cuda")
    g.manual_seed(seed * 1009 + rank)
    x = torch.randn(n, generator=g, device="cuda", dtype=torch.float32).to(dtype)
    xs = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(xs, x)
    return x, xs


def _oracle_sum(xs):
    acc = torch.zeros_like(xs[0], dtype=torch.float32)
    for x in xs:
        acc += x.float()
    return acc.to(xs[0].dtype)


def _same_on_all_ranks(t):
    got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t.contiguous())
    return all(torch.equal(g.view(torch.uint8), got[0].view(torch.uint8)) for g in got)


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _sizes(dtype):
    """1 element up to max_bytes, odd sizes included, growing then shrinking (seed hazards)."""
    top = MAX_BYTES // torch.tensor([], dtype=dtype).element_size()
    up = [1, 2, 7, 100, 1000, 4096, 16385, 65536 + 7, 1 << 18, top]
    return up + up[::-1][1:]


def _all_ops_body(rank, ws):
    import llcomm
    comm = _comm()
    ref = llcomm.Communicator(backend="reference")
    seed = 0
    for dtype in DTYPES:
        for n in _sizes(dtype):
            seed += 1
            x, xs = _inputs(n, dtype, seed, rank)
            want = _oracle_sum(xs)
            results = []
            for algo in ALGOS:
                if algo == "lamport" and n * x.element_size() > comm.lamport_bytes:
                    continue
                for _ in range(2):  # a repeat must give the same bits (read-after-write edge)
                    out = torch.full_like(x, float("nan"))
                    comm.all_reduce(x, out=out, algo=algo)
                    assert torch.equal(_bits(out), _bits(want)), (algo, dtype, n)
                    results.append(out)
            nccl = ref.all_reduce(x)
            tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
            torch.testing.assert_close(results[0], nccl, rtol=tol, atol=tol)
            assert _same_on_all_ranks(results[0])
            for src in range(ws):
                y = x.clone() if rank == src else torch.full_like(x, float("nan"))
                comm.broadcast(y, src)
                assert torch.equal(_bits(y), _bits(xs[src])), ("broadcast", dtype, n, src)
            got = comm.all_gather(x, out=torch.full((ws * n,), float("nan"), dtype=dtype,
                                                    device="cuda"))
            assert torch.equal(_bits(got), _bits(ref.all_gather(x))), ("all_gather", dtype, n)
            if n % ws == 0:
                rs = comm.reduce_scatter(x, out=torch.full((n // ws,), float("nan"), dtype=dtype,
                                                           device="cuda"))
                assert torch.equal(_bits(rs), _bits(want.view(ws, -1)[rank])), \
                    ("reduce_scatter", dtype, n)
                torch.testing.assert_close(rs, ref.reduce_scatter(x), rtol=tol, atol=tol)
        for tokens, part in ((1, 8), (3, 1000), (64, 4096 // 2), (7, 129)):
            seed += 1
            x, xs = _inputs(tokens * part, dtype, seed, rank)
            x = x.view(tokens, part)
            got = comm.all_gather_2d(x, out=torch.full((tokens, ws * part), float("nan"),
                                                       dtype=dtype, device="cuda"))
            assert torch.equal(_bits(got), _bits(ref.all_gather_2d(x))), \
                ("all_gather_2d", dtype, tokens, part)
            for r in range(ws):  # rank r's part of token t at t * full + r * part
                assert torch.equal(_bits(got[:, r * part:(r + 1) * part]),
                                   _bits(xs[r].view(tokens, part)))
    comm.check()
    comm.close()


def test_all_ops_match_oracle_and_nccl():
    run_distributed(_all_ops_body, 2, backend="nccl", timeout=600)


def _broadcast_exact_body(rank, ws):
    comm = _comm()
    for nbytes in (4, 4 << 10, 64 << 10, 1 << 20):
        for src in range(ws):
            payload = torch.arange(nbytes, device="cuda", dtype=torch.int64).to(torch.uint8)
            payload = (payload * 7 + src * 13 + nbytes).to(torch.uint8).view(torch.float32)
            x = payload.clone() if rank == src else torch.full_like(payload, float("nan"))
            comm.broadcast(x, src)
            assert torch.equal(_bits(x), _bits(payload)), (nbytes, src)
    comm.close()


def test_broadcast_byte_exact():
    run_distributed(_broadcast_exact_body, 2, backend="nccl")


LL_BYTES = 64 << 10


def _random_words(nbytes, seed, rank):
    """Any bit patterns (NaN payloads, -0.0, denormals): float32 words, or bfloat16 halves when
    ``nbytes`` is not a multiple of 4 (other dtypes: test_movement_every_dtype)."""
    g = torch.Generator(device="cuda")
    g.manual_seed(seed * 7919 + rank)
    if nbytes % 4:
        return torch.randint(-2 ** 15, 2 ** 15 - 1, (nbytes // 2,), generator=g, device="cuda",
                             dtype=torch.int16).view(torch.bfloat16)
    return torch.randint(-2 ** 31, 2 ** 31 - 1, (nbytes // 4,), generator=g, device="cuda",
                         dtype=torch.int32).view(torch.float32)


def _ll_body(rank, ws):
    """broadcast / all_gather / all_gather_2d up to the LL limit take the LL kernels, above it
    (and messages that are not whole 4-byte words) the flagged ones; interleaved with Lamport
    (which shares the tag words) and one-shot all-reduces; byte-exact against NCCL, eager and in
    a replayed graph on fresh inputs."""
    import llcomm
    comm = _comm()
    assert comm._impl.ll_bytes == LL_BYTES
    ref = llcomm.Communicator(backend="reference")
    seed = 0
    for nbytes in (4, 6, 8 << 10, 8 << 10, 40000, LL_BYTES, LL_BYTES + 4, 1 << 20):
        seed += 1
        x = _random_words(nbytes, seed, rank)
        for src in range(ws):
            y = x.clone() if rank == src else torch.full_like(x, 7)
            comm.broadcast(y, src)
            assert torch.equal(_bits(y), _bits(ref.broadcast(x.clone(), src))), (nbytes, src)
        got = comm.all_gather(x, out=torch.full((ws * x.numel(),), 7, dtype=x.dtype, device="cuda"))
        assert torch.equal(_bits(got), _bits(ref.all_gather(x))), ("all_gather", nbytes)
        a, _ = _inputs(2048, torch.bfloat16, seed, rank)
        assert torch.equal(_bits(comm.all_reduce(a, algo="lamport")),
                           _bits(comm.all_reduce(a, algo="one_shot")))
        if x.numel() % 8 == 0:
            x2 = x.view(8, -1)
            got = comm.all_gather_2d(x2)
            assert torch.equal(_bits(got), _bits(ref.all_gather_2d(x2))), ("2d", nbytes)
    # a replayed graph of LL ops (and a Lamport one between them), fresh inputs each replay
    xs = _random_words(8 << 10, 0, rank)
    a = torch.zeros(2048, dtype=torch.bfloat16, device="cuda")
    outs = []

    def step():
        outs.clear()
        outs.append(comm.all_gather(xs))
        y = xs.clone()
        outs.append(comm.broadcast(y, 1))
        outs.append(comm.all_reduce(a, algo="lamport"))
        outs.append(comm.all_gather_2d(xs.view(16, -1)))

    g = capture(step, 1)
    for i in range(20):
        xs.copy_(_random_words(8 << 10, 100 + i, rank))
        a.copy_(_inputs(2048, torch.bfloat16, 100 + i, rank)[0])
        g.replay()
        assert torch.equal(_bits(outs[0]), _bits(ref.all_gather(xs))), i
        assert torch.equal(_bits(outs[1]), _bits(ref.broadcast(xs.clone(), 1))), i
        assert torch.equal(_bits(outs[2]), _bits(_oracle_sum(_inputs(2048, torch.bfloat16, 100 + i,
                                                                      rank)[1]))), i
        assert torch.equal(_bits(outs[3]), _bits(ref.all_gather_2d(xs.view(16, -1)))), i
    comm.check()
    comm.close()


def test_ll_movement_byte_exact_eager_and_graph():
    run_distributed(_ll_body, 2, backend="nccl", timeout=300)


def _dtypes_body(rank, ws):
    """broadcast / all_gather / all_gather_2d of every dtype (LL sizes, flag sizes, odd byte
    counts) against payloads every rank builds itself, then a replayed graph of a decode step
    that broadcasts rank 0's sampled int64 token ids."""
    from _payloads import MOVE_DTYPES, payload, poisoned
    comm = _comm()

    def pay(dtype, shape, key, r):
        return payload(dtype, shape, key + (r,)).cuda()

    for dtype in MOVE_DTYPES:
        name = str(dtype)
        for n in (1, 3, 1000, 40000):          # 40000 elements: past LL for every dtype
            for src in range(ws):
                sent = pay(dtype, (n,), ("bcast", name, n), src)
                x = sent.clone() if rank == src else poisoned((n,), dtype).cuda()
                comm.broadcast(x, src)
                assert torch.equal(_bits(x), _bits(sent)), ("broadcast", dtype, n, src)
            parts = [pay(dtype, (n,), ("gather", name, n), r) for r in range(ws)]
            out = poisoned((ws * n,), dtype).cuda()
            comm.all_gather(parts[rank], out=out)
            assert torch.equal(_bits(out), torch.cat([_bits(p) for p in parts])), \
                ("all_gather", dtype, n)
        for tokens, part in ((1, 1), (3, 3), (16, 100), (7, 2001)):
            parts = [pay(dtype, (tokens, part), ("2d", name, tokens), r) for r in range(ws)]
            got = comm.all_gather_2d(parts[rank])
            want = torch.cat([p.view(torch.uint8).view(tokens, -1) for p in parts], 1)
            assert torch.equal(_bits(got), _bits(want)), ("all_gather_2d", dtype, tokens, part)
    # decode: rank 0 samples, every rank embeds the same ids (a replayed graph)
    ids = torch.zeros(8, dtype=torch.int64, device="cuda")
    seen = torch.zeros_like(ids)

    def step():
        comm.broadcast(ids, 0)
        seen.copy_(ids)

    g = capture(step, 1)
    for i in range(10):
        want = torch.randint(0, 2 ** 40, (8,), generator=torch.Generator().manual_seed(i))
        ids.copy_(want.cuda() if rank == 0 else torch.full((8,), -1))
        g.replay()
        assert torch.equal(seen.cpu(), want), i
    comm.check()
    comm.close()


def test_movement_every_dtype():
    run_distributed(_dtypes_body, 2, backend="nccl", timeout=600)


def _lamport_bits_body(rank, ws):
    """Lamport all_reduce (each rank's own term from its operand) and the fused Lamport join
    give the bits of the oracle / the flag one-shot, in place too, eager and in a replayed
    graph, sizes changing every call."""
    comm = _comm()
    for i, n in enumerate((1, 7, 4096, 5000, 65536 + 3, comm.lamport_bytes // 4, 4096, 1)):
        for dtype in DTYPES:
            x, xs = _inputs(n, dtype, 50 + i, rank)
            want = _oracle_sum(xs)
            assert torch.equal(_bits(comm.all_reduce(x, algo="lamport")), _bits(want)), (n, dtype)
            y = x.clone()
            comm.all_reduce(y, out=y, algo="lamport")                   # in place
            assert torch.equal(_bits(y), _bits(want)), ("in place", n, dtype)
    tokens, hidden = 8, 8192
    x, _ = _inputs(tokens * hidden, torch.bfloat16, 90, rank)
    x = x.view(tokens, hidden)
    res = torch.randn(tokens, hidden, device="cuda", generator=torch.Generator(
        device="cuda").manual_seed(91)).to(torch.bfloat16)
    w = torch.rand(hidden, device="cuda", generator=torch.Generator(device="cuda").manual_seed(92))
    w = (w + 0.5).to(torch.bfloat16)
    got = comm.all_reduce_residual_rmsnorm(x, res, w, algo="lamport")
    want = comm.all_reduce_residual_rmsnorm(x, res, w, algo="one_shot")
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want)), "fused"
    static, outs = torch.zeros(3000, dtype=torch.bfloat16, device="cuda"), {}

    def step():
        outs["y"] = comm.all_reduce(static, algo="lamport")

    g = capture(step, 1)
    for i in range(20):
        x, xs = _inputs(3000, torch.bfloat16, 200 + i, rank)
        static.copy_(x)
        g.replay()
        assert torch.equal(_bits(outs["y"]), _bits(_oracle_sum(xs))), i
    comm.check()
    comm.close()


def test_lamport_own_term_from_the_operand():
    run_distributed(_lamport_bits_body, 2, backend="nccl", timeout=300)


#: Pipelined Lamport (several chunks per block): slot and sizes up to 16 MiB, odd sizes too;
#: all_reduce and reduce_scatter.
BIG_LAMPORT_BYTES = 16 << 20
BIG_SIZES = (((2 << 20) + 7, torch.bfloat16), (4 << 20, torch.bfloat16),
             ((1 << 20) + 3, torch.float32), (8 << 20, torch.bfloat16),
             ((3 << 20) - 1, torch.float16), (2 << 20, torch.float32))


def _big_lamport_body(rank, ws):
    import os

    os.environ["LLCOMM_LAMPORT_BYTES"] = str(BIG_LAMPORT_BYTES)
    comm = _comm(max_bytes=BIG_LAMPORT_BYTES)
    assert comm.lamport_bytes == BIG_LAMPORT_BYTES
    for i, (n, dtype) in enumerate(BIG_SIZES):
        x, xs = _inputs(n, dtype, 100 + i, rank)
        want = _oracle_sum(xs)
        for _ in range(3):      # repeats alternate the halves and must re-arm every word
            out = torch.full_like(x, float("nan"))
            comm.all_reduce(x, out=out, algo="lamport")
            assert torch.equal(_bits(out), _bits(want)), (n, dtype)
        assert torch.equal(_bits(comm.all_reduce(x, algo="one_shot")), _bits(want)), (n, dtype)
    # graph replay with fresh inputs each time, sizes interleaved with an eager call
    n = (6 << 20) + 5
    static = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    outs = {}
    graph = capture(lambda: outs.__setitem__("y", comm.all_reduce(static, algo="lamport")), 1)
    for i in range(20):
        x, xs = _inputs(n, torch.bfloat16, 200 + i, rank)
        static.copy_(x)
        graph.replay()
        assert torch.equal(_bits(outs["y"]), _bits(_oracle_sum(xs))), i
        if i % 5 == 0:
            y, ys = _inputs(4096, torch.bfloat16, 300 + i, rank)
            assert torch.equal(_bits(comm.all_reduce(y, algo="lamport")), _bits(_oracle_sum(ys)))
    assert _same_on_all_ranks(outs["y"])
    # reduce_scatter: the Lamport kernel and the flag kernel give the same bits
    flag = _comm(max_bytes=BIG_LAMPORT_BYTES)
    flag._impl.rs_lamport_bytes = 0     # reduce_scatter: the flag kernel at every size
    for i, (n, dtype) in enumerate(BIG_SIZES):
        n = n // ws * ws
        x, xs = _inputs(n, dtype, 400 + i, rank)
        want = _oracle_sum(xs).view(ws, -1)[rank]
        for c in (comm, flag, comm):
            rs = c.reduce_scatter(x, out=torch.full((n // ws,), float("nan"), dtype=dtype,
                                                    device="cuda"))
            assert torch.equal(_bits(rs), _bits(want)), ("reduce_scatter", n, dtype)
    flag.close()
    comm.check()
    comm.close()


def test_lamport_pipelined_large_sizes():  # all_reduce and reduce_scatter
    run_distributed(_big_lamport_body, 2, backend="nccl", timeout=300)


def _second_comm_body(rank, ws):
    a = _comm()
    b = _comm(max_bytes=1 << 20)
    for i in range(20):
        x, xs = _inputs(5000 + i, torch.bfloat16, i, rank)
        want = _oracle_sum(xs)
        assert torch.equal(a.all_reduce(x, algo="lamport"), want)
        assert torch.equal(b.all_reduce(x, algo="one_shot"), want)
        assert torch.equal(a.all_reduce(x, algo="two_shot"), want)
    a.close()
    b.close()


def test_second_communicator():
    run_distributed(_second_comm_body, 2, backend="nccl")


def _other_gpu_current_body(rank, ws):
    """Ops called while the *other* GPU is the current device (an engine that switched devices):
    the launcher must launch on the communicator's own GPU. Fresh sizes, so the compiling
    launch happens under the switch too."""
    comm = _comm()
    me = torch.cuda.current_device()
    other = (me + 1) % torch.cuda.device_count()
    for seed, n in enumerate((4096, 65536 + 7, 1 << 20)):
        x, xs = _inputs(n, torch.bfloat16, 50_000 + seed, rank)
        want = _oracle_sum(xs)
        with torch.cuda.device(other):
            outs = {algo: comm.all_reduce(x, algo=algo) for algo in ALGOS}
        torch.cuda.synchronize(me)
        for algo, out in outs.items():
            assert out.device == x.device and torch.equal(_bits(out), _bits(want)), (algo, n)
    x, _ = _inputs(2 * 4096, torch.bfloat16, 60_000, rank)
    g = torch.Generator(device="cuda").manual_seed(7)       # the same on every rank
    res = torch.randn(2, 4096, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.rand(4096, generator=g, device="cuda").to(torch.bfloat16)
    want = comm.all_reduce_residual_rmsnorm(x.view(2, 4096), res, w)
    with torch.cuda.device(other):
        got = comm.all_reduce_residual_rmsnorm(x.view(2, 4096), res, w)
    torch.cuda.synchronize(me)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want))
    comm.check()
    comm.close()


def test_ops_with_another_gpu_current():
    run_distributed(_other_gpu_current_body, 2, backend="nccl")


REPLAYS = 100


def _graph_body(rank, ws):
    comm = _comm()
    n = 3000 * ws
    dtype = torch.bfloat16
    static_x = torch.zeros(n, dtype=dtype, device="cuda")
    static_2d = static_x.view(ws * 100, 30)
    outs = {}

    def ops():
        for algo in ALGOS:
            outs[algo] = comm.all_reduce(static_x, algo=algo)
        b = static_x.clone()
        comm.broadcast(b, ws - 1)
        outs["broadcast"] = b
        outs["all_gather"] = comm.all_gather(static_x)
        outs["all_gather_2d"] = comm.all_gather_2d(static_2d)
        outs["reduce_scatter"] = comm.reduce_scatter(static_x)

    g = capture(ops, 1)
    for i in range(REPLAYS):
        x, xs = _inputs(n, dtype, 10_000 + i, rank)
        static_x.copy_(x)
        for o in outs.values():
            o.view(torch.uint8).fill_(0xFF)  # poison: NaN patterns in bf16
        g.replay()
        if i % 2:  # eager calls between replays must not disturb the device-side round counter
            assert torch.equal(comm.all_reduce(x, algo="lamport"), _oracle_sum(xs))
        want = _oracle_sum(xs)
        for algo in ALGOS:
            assert torch.equal(_bits(outs[algo]), _bits(want)), (algo, i)
        assert torch.equal(_bits(outs["broadcast"]), _bits(xs[ws - 1]))
        assert torch.equal(_bits(outs["all_gather"]), _bits(torch.cat(xs)))
        assert torch.equal(_bits(outs["all_gather_2d"]),
                           _bits(torch.cat([t.view(ws * 100, 30) for t in xs], 1)))
        assert torch.equal(_bits(outs["reduce_scatter"]), _bits(want.view(ws, -1)[rank]))
        assert _same_on_all_ranks(outs["one_shot"])
    comm.check()
    comm.close()


def test_graph_replay_every_op():
    run_distributed(_graph_body, 2, backend="nccl", timeout=300)


TIMEOUT_MS = 200


def _timeout_body(rank, ws, op):
    import llcomm
    # "ll_broadcast": the LL kernel (kernels/ll.py, the default at this size); "broadcast":
    # the flagged one
    ll = op.startswith("ll_")
    op = op.removeprefix("ll_")
    comm = _comm(timeout_ms=TIMEOUT_MS)
    if not ll:
        comm._impl.ll_bytes = 0     # every message above the LL limit: the flagged kernel
    x = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    calls = {"one_shot": lambda: comm.all_reduce(x, algo="one_shot"),
             "two_shot": lambda: comm.all_reduce(x, algo="two_shot"),
             "lamport": lambda: comm.all_reduce(x, algo="lamport"),
             "broadcast": lambda: comm.broadcast(x, 0),
             "all_gather": lambda: comm.all_gather(x),
             "reduce_scatter": lambda: comm.reduce_scatter(x)}
    err = absent_peer_error(rank, calls[op], comm.check, TIMEOUT_MS)
    if err is None:
        return None
    assert op.split("_")[0] in err.op, err
    assert err.phase in ("entry barrier", "data poll"), err
    with pytest.raises(llcomm.CommBrokenError, match="destroy it"):
        comm.all_reduce(x)
    return str(err)


@pytest.mark.parametrize("op", ["one_shot", "two_shot", "lamport", "broadcast", "all_gather",
                                "reduce_scatter", "ll_broadcast", "ll_all_gather"])
def test_missing_peer_times_out(op):
    msgs = run_distributed(_timeout_body, 2, op, backend="nccl")
    assert "did not arrive" in msgs[0]


QUEUED = 20


def _queued_body(rank, ws, algo):
    """Rank 1 stops; rank 0 queues QUEUED ops before the first one's wait has run out. Only the
    first may take the whole timeout: the kernels behind it start with the error word set and
    give up after AFTER_FAILURE_US (without that, QUEUED timeouts, 4 s here)."""
    import time

    import llcomm
    comm = _comm(timeout_ms=TIMEOUT_MS)
    x = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    comm.all_reduce(x, algo=algo)           # warm: the first launch of a key waits 60 s
    comm.check()
    dist.barrier()
    if rank == 1:
        dist.barrier()
        return None
    t0 = time.monotonic()
    for _ in range(QUEUED):                 # enqueued well within the 200 ms of the first wait
        comm.all_reduce(x, algo=algo)
    queued_s = time.monotonic() - t0
    with pytest.raises(llcomm.CommTimeoutError):
        comm.check()
    elapsed = time.monotonic() - t0
    dist.barrier()
    assert queued_s < TIMEOUT_MS / 1000 / 2, f"enqueueing took {queued_s:.3f} s"
    assert elapsed < TIMEOUT_MS / 1000 + 0.5, f"{QUEUED} queued ops took {elapsed:.2f} s"
    return elapsed


@pytest.mark.parametrize("algo", ["one_shot", "lamport"])
def test_ops_queued_behind_a_timeout_end_fast(algo):
    run_distributed(_queued_body, 2, algo, backend="nccl")


def _shared_gpu_body(rank, ws):
    import llcomm
    torch.cuda.set_device(0)  # both ranks on one GPU: peer stores would be undefined
    with pytest.raises(llcomm.UnsupportedConfigError, match="share one GPU"):
        llcomm.Communicator(backend="peer")
    comm = llcomm.Communicator(backend="auto")
    assert comm.backend == "reference"


def test_peer_refused_when_ranks_share_a_gpu():
    run_distributed(_shared_gpu_body, 2, backend="gloo")

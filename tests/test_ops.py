"""The torch.library custom ops (``llcomm.ops``) on the reference backend (gloo, CPU): the same
bits as the methods, ``torch.library.opcheck`` (schema, fake implementation, aot dispatch), and
``torch.compile(fullgraph=True)`` of a step with every op against the same step run eagerly."""
import pytest
import torch

from _dist import run_distributed

E, H, T, TOPK = 4, 8, 4, 2        # experts, hidden, max tokens per rank, top-k (fp32: 32-byte rows)


def _objects():
    import llcomm
    comm = llcomm.Communicator(backend="reference")
    buf = llcomm.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                          dtype=torch.float32, backend="reference")
    return comm, buf


def _ep_case(rank, seed, n=3):
    g = torch.Generator().manual_seed(seed * 31 + rank)
    x = torch.randn(n, H, generator=g)
    topk_idx = torch.randint(-1, E, (n, TOPK), generator=g)
    topk_weights = torch.rand(n, TOPK, generator=g)
    return x, topk_idx, topk_weights


def _filled_rows_equal(a, b, count):
    return all(torch.equal(a[e, :int(c)], b[e, :int(c)]) for e, c in enumerate(count))


def _match_body(rank, ws):
    import llcomm.ops as ops
    comm, buf = _objects()
    assert isinstance(comm.op_handle, int) and comm.op_handle != buf.op_handle
    assert ops.register(comm) == comm.op_handle      # idempotent
    x = torch.randn(2 * ws, 5) * (rank + 1)
    for algo in ("auto", "one_shot", "two_shot"):
        assert torch.equal(ops.all_reduce(comm, x, algo=algo), comm.all_reduce(x, algo=algo))
    assert torch.equal(torch.ops.llcomm.all_reduce(comm.op_handle, x, "auto"), comm.all_reduce(x))
    assert torch.equal(ops.all_gather(comm, x), comm.all_gather(x))
    assert torch.equal(ops.all_gather_2d(comm, x), comm.all_gather_2d(x))
    assert torch.equal(ops.reduce_scatter(comm, x), comm.reduce_scatter(x))
    mine = torch.full((3, 4), float(rank + 7))
    assert ops.broadcast(comm, mine, 1) is mine and torch.equal(mine, torch.full((3, 4), 8.0))

    for seed in range(3):
        xe, topk_idx, w = _ep_case(rank, seed)
        rx, cnt, handle = buf.dispatch(xe, topk_idx)
        y = buf.combine(rx * 3 - 1, topk_idx, w, handle)
        orx, ocnt, ticket = ops.ep_dispatch(buf, xe, topk_idx)
        assert ticket.dtype == torch.int64 and ticket.dim() == 0 and ticket.device.type == "cpu"
        assert int(ticket) == handle.index + 1
        assert torch.equal(ocnt, cnt) and _filled_rows_equal(orx, rx, cnt)
        src = ops.ep_src_info(buf, ticket)
        assert _filled_rows_equal(src, handle.src_info, cnt)
        oy = ops.ep_combine(buf, orx * 3 - 1, topk_idx, w, ticket)
        assert torch.equal(oy, y)

    # A ticket lives for two dispatches, like its handle.
    xe, topk_idx, w = _ep_case(rank, 9)
    _, _, t0 = ops.ep_dispatch(buf, xe, topk_idx)
    for _ in range(3):
        rx, _, t = ops.ep_dispatch(buf, xe, topk_idx)
    ops.ep_combine(buf, rx, topk_idx, w, t)
    with pytest.raises(ValueError, match="combine before dispatching again"):
        ops.ep_combine(buf, rx, topk_idx, w, t0)
    with pytest.raises(TypeError, match="ticket must be"):
        ops.ep_combine(buf, rx, topk_idx, w, torch.tensor(1.0))
    with pytest.raises(ValueError, match="no live Communicator or EPBuffer"):
        torch.ops.llcomm.all_reduce(10 ** 9, x, "auto")
    # The methods' own validation runs behind the ops.
    with pytest.raises(ValueError, match="algo="):
        ops.all_reduce(comm, x, algo="nope")


def test_ops_match_methods():
    run_distributed(_match_body, 2)


def _opcheck_body(rank, ws):
    from torch.library import opcheck
    comm, buf = _objects()
    c, b = comm.op_handle, buf.op_handle
    x = torch.randn(2 * ws, 6) + rank
    L = torch.ops.llcomm
    opcheck(L.all_reduce.default, (c, x, "auto"))
    opcheck(L.broadcast_.default, (c, x.clone(), 0))
    opcheck(L.all_gather.default, (c, x))
    opcheck(L.all_gather_2d.default, (c, x))
    opcheck(L.reduce_scatter.default, (c, x))
    xe, topk_idx, w = _ep_case(rank, 5)
    # Each run of ep_dispatch is a new dispatch with a new ticket, so the test that compares two
    # runs' outputs (aot dispatch) cannot apply; combine and src_info are pure given a ticket.
    opcheck(L.ep_dispatch.default, (b, xe, topk_idx),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    recv_x, _, ticket = L.ep_dispatch(b, xe, topk_idx)
    opcheck(L.ep_combine.default, (b, recv_x * 2, topk_idx, w, ticket))
    opcheck(L.ep_src_info.default, (b, ticket))


def test_opcheck():
    run_distributed(_opcheck_body, 2)


def _compile_body(rank, ws, compilers):
    comm, buf = _objects()
    for compiler in compilers:
        torch._dynamo.reset()
        _compile_one(comm, buf, rank, ws, compiler)


def _compile_one(comm, buf, rank, ws, compiler):
    import llcomm.ops as ops

    def step(x, xe, topk_idx, w):
        h = ops.all_reduce(comm, x)
        ops.broadcast(comm, h, 0)
        g = ops.all_gather(comm, h)
        g2 = ops.all_gather_2d(comm, h)
        s = ops.reduce_scatter(comm, g)
        recv_x, recv_count, ticket = ops.ep_dispatch(buf, xe, topk_idx)
        expert_out = torch.tanh(recv_x) * 2      # stands in for the experts
        y = ops.ep_combine(buf, expert_out, topk_idx, w, ticket)
        return h, g, g2, s, recv_count, y

    compiled = torch.compile(step, fullgraph=True, backend=compiler)
    for seed in range(3):   # repeat: new tickets, no recompilation needed
        x = torch.randn(2 * ws, 4) * (rank + 1)
        args = (x, *_ep_case(rank, seed, n=rank + 2))
        want = step(*args)
        got = compiled(*args)
        for name, a, b in zip(("all_reduce", "all_gather", "all_gather_2d", "reduce_scatter",
                               "recv_count", "combine"), got, want):
            assert a.shape == b.shape and torch.equal(a, b), (compiler, seed, name)


def test_compile_fullgraph():
    # Inductor on CPU needs a C++ compiler and half a minute per rank; the GPU test
    # (tests/test_compile_gpu.py) runs the default backend.
    run_distributed(_compile_body, 2, ("eager", "aot_eager"), timeout=300)


H8 = 128          # FP8 dispatch needs hidden a multiple of 128


def _fp8_body(rank, ws, compilers):
    import llcomm
    import llcomm.ops as ops
    from llcomm.runtime.fp8_format import dequantize
    from torch.library import opcheck
    buf = llcomm.EPBuffer(num_experts=E, hidden=H8, num_max_dispatch_tokens_per_rank=T,
                          dtype=torch.float32, backend="reference")
    for seed, round_scale in ((0, False), (1, True)):
        g = torch.Generator().manual_seed(seed * 31 + rank)
        x = torch.randn(3, H8, generator=g) * 10
        topk_idx = torch.randint(-1, E, (3, TOPK), generator=g)
        w = torch.rand(3, TOPK, generator=g)
        (q, s), cnt, handle = buf.dispatch(x, topk_idx, use_fp8=True, round_scale=round_scale)
        y = buf.combine(dequantize(q, s, torch.float32), topk_idx, w, handle)
        (oq, os_), ocnt, ticket = ops.ep_dispatch(buf, x, topk_idx, use_fp8=True,
                                                  round_scale=round_scale)
        assert oq.dtype == torch.float8_e4m3fn and os_.dtype == torch.float32
        assert os_.shape == (E // ws, ws * T, H8 // 128)
        assert torch.equal(ocnt, cnt) and int(ticket) == handle.index + 1
        assert _filled_rows_equal(oq.view(torch.uint8), q.view(torch.uint8), cnt)
        assert _filled_rows_equal(os_, s, cnt)
        oy = ops.ep_combine(buf, dequantize(oq, os_, torch.float32), topk_idx, w, ticket)
        assert torch.equal(oy, y)
    with pytest.raises(ValueError, match="round_scale=True needs use_fp8=True"):
        ops.ep_dispatch(buf, x, topk_idx, round_scale=True)
    with pytest.raises(TypeError, match="use_fp8="):
        ops.ep_dispatch(buf, x, topk_idx, use_fp8=1)
    opcheck(torch.ops.llcomm.ep_dispatch_fp8.default, (buf.op_handle, x, topk_idx, True),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))

    def step(x, topk_idx, w):
        (q, s), recv_count, ticket = ops.ep_dispatch(buf, x, topk_idx, use_fp8=True)
        y = ops.ep_combine(buf, dequantize(q, s, torch.float32) * 2, topk_idx, w, ticket)
        return recv_count, y

    for compiler in compilers:
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, backend=compiler)
        for seed in range(2):
            g = torch.Generator().manual_seed(100 + seed * 31 + rank)
            n = rank + 2
            args = (torch.randn(n, H8, generator=g), torch.randint(-1, E, (n, TOPK), generator=g),
                    torch.rand(n, TOPK, generator=g))
            for a, b in zip(compiled(*args), step(*args)):
                assert torch.equal(a, b), (compiler, seed)


def test_ep_dispatch_fp8_ops():
    run_distributed(_fp8_body, 2, ("eager", "aot_eager"), timeout=300)


HF = 256          # fused norms: hidden (two FP8 groups)


def _fused_case(rank, seed, tokens=3):
    """This rank's x; residual, weight and the static scale the same on every rank."""
    g = torch.Generator().manual_seed(seed * 31 + rank)
    gs = torch.Generator().manual_seed(seed * 31 + 1000)
    x = torch.randn(tokens, HF, generator=g)
    res = torch.randn(tokens, HF, generator=gs)
    w = torch.rand(HF, generator=gs) + 0.5
    scale = torch.rand((), generator=gs) * 0.02 + 0.001
    return x, res, w, scale


def _bits_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _fused_ops_body(rank, ws, compilers):
    import llcomm
    import llcomm.ops as ops
    from torch.library import opcheck
    comm = llcomm.Communicator(backend="reference")
    c = comm.op_handle
    for seed in range(2):
        x, res, w, scale = _fused_case(rank, seed)
        pairs = [
            (ops.all_reduce_residual_rmsnorm(comm, x, res, w, 1e-5),
             comm.all_reduce_residual_rmsnorm(x, res, w, 1e-5)),
            (ops.all_reduce_rmsnorm(comm, x, w), comm.all_reduce_rmsnorm(x, w)),
            (ops.all_reduce_residual_rmsnorm_fp8(comm, x, res, w, scale=scale),
             comm.all_reduce_residual_rmsnorm_fp8(x, res, w, scale=scale)),
            (ops.all_reduce_residual_rmsnorm_fp8_per_group(comm, x, res, w, round_scale=True),
             comm.all_reduce_residual_rmsnorm_fp8_per_group(x, res, w, round_scale=True)),
        ]
        for i, (got, want) in enumerate(pairs):
            assert len(got) == len(want) and all(map(_bits_equal, got, want)), (seed, i)
    assert pairs[2][0][0].dtype == torch.float8_e4m3fn
    assert pairs[3][0][1].shape == (3, HF // 128) and pairs[3][0][1].dtype == torch.float32
    # the methods' validation, and the wrappers' own for the Python scalars
    with pytest.raises(ValueError, match=r"all_reduce_residual_rmsnorm_fp8_per_group: .*hidden=8"):
        ops.all_reduce_residual_rmsnorm_fp8_per_group(
            comm, x[:, :8].contiguous(), res[:, :8].contiguous(), w[:8].contiguous())
    with pytest.raises(TypeError, match=r"all_reduce_residual_rmsnorm_fp8: scale has dtype"):
        ops.all_reduce_residual_rmsnorm_fp8(comm, x, res, w, scale=scale.double())
    with pytest.raises(TypeError, match="round_scale=1"):
        ops.all_reduce_residual_rmsnorm_fp8_per_group(comm, x, res, w, round_scale=1)
    with pytest.raises(TypeError, match="eps='1e-6'"):
        ops.all_reduce_rmsnorm(comm, x, w, "1e-6")

    L = torch.ops.llcomm
    opcheck(L.all_reduce_residual_rmsnorm.default, (c, x, res, w, 1e-6, "auto"))
    opcheck(L.all_reduce_rmsnorm.default, (c, x, w, 1e-6, "auto"))
    opcheck(L.all_reduce_residual_rmsnorm_fp8.default, (c, x, res, w, 1e-6, scale, "auto"))
    opcheck(L.all_reduce_residual_rmsnorm_fp8_per_group.default,
            (c, x, res, w, 1e-6, False, "auto"))

    def step(x, res, w, scale):
        y0, h0 = ops.all_reduce_rmsnorm(comm, x, w)                 # the first layer
        y1, h1 = ops.all_reduce_residual_rmsnorm(comm, y0 * 2, h0, w)
        q2, h2 = ops.all_reduce_residual_rmsnorm_fp8(comm, y1, h1, w, scale=scale)
        q3, s3, h3 = ops.all_reduce_residual_rmsnorm_fp8_per_group(
            comm, q2.float() * scale, h2, w, round_scale=False)
        return y0, h0, y1, h1, q2, h2, q3, s3, h3

    for compiler in compilers:
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, backend=compiler)
        for seed in range(2, 4):      # a new scale value each time: an input, not a constant
            args = _fused_case(rank, seed, tokens=seed)      # two shapes: dynamic tokens
            got, want = compiled(*args), step(*args)
            assert all(map(_bits_equal, got, want)), (compiler, seed)
    comm.close()


def test_fused_norm_ops():
    run_distributed(_fused_ops_body, 2, ("eager", "aot_eager"), timeout=300)

"""``torch.compile(fullgraph=True)`` with the default backend (Inductor) of a step that calls the
llcomm custom ops on the peer backend (2 GPUs, NCCL group), against the same step run eagerly and
against the methods. Run on a 2-GPU host: ``python -m pytest tests/test_compile_gpu.py -m gpu``."""
import pytest
import torch

from _dist import run_distributed

pytestmark = pytest.mark.gpu

E, H, T, TOPK = 8, 512, 16, 4       # experts, hidden, max tokens per rank, top-k
COMPILE_TIMEOUT_MS = 120_000


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _case(rank, seed, n):
    """The TP operand has the same shape on every rank (a join's contract: a different size is a
    mismatch, and the Lamport tag reports it); only EP token counts differ per rank."""
    g = torch.Generator(device="cuda")
    g.manual_seed(seed * 131 + rank)
    x = torch.randn(T - seed, 4096, generator=g, device="cuda").to(torch.bfloat16)
    xe = torch.randn(n, H, generator=g, device="cuda").to(torch.bfloat16)
    topk_idx = torch.randint(-1, E, (n, TOPK), generator=g, device="cuda")
    w = torch.rand(n, TOPK, generator=g, device="cuda")
    return x, xe, topk_idx, w


def _compile_body(rank, ws):
    import llcomm
    import llcomm.ops as ops
    # Inductor compiles inside the first call of each shape, for seconds and not equally long on
    # both ranks, while the faster rank's kernels already wait for the other: the bound must
    # cover a compile (docs/compile.md). The first GPU run, with the 1 s default, failed.
    comm = llcomm.Communicator(max_bytes=1 << 20, backend="peer", timeout_ms=COMPILE_TIMEOUT_MS)
    buf = llcomm.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                          backend="peer", timeout_ms=COMPILE_TIMEOUT_MS)

    def step(x, xe, topk_idx, w):
        h = ops.all_reduce(comm, x * 0.5)
        g = ops.all_gather_2d(comm, h[:, :256].contiguous())
        recv_x, recv_count, ticket = ops.ep_dispatch(buf, xe, topk_idx)
        expert_out = recv_x * 2                        # exact in bf16: same bits either way
        y = ops.ep_combine(buf, expert_out, topk_idx, w, ticket)
        return h, g, recv_count, y

    compiled = torch.compile(step, fullgraph=True)
    for seed in range(4):
        args = _case(rank, seed, n=T - rank - seed)    # EP token counts differ per rank
        want = step(*args)
        got = compiled(*args)
        torch.cuda.synchronize()
        for name, a, b in zip(("all_reduce", "all_gather_2d", "recv_count", "combine"), got, want):
            assert a.shape == b.shape and torch.equal(_bits(a), _bits(b)), (seed, name)
        # and the methods, for the same inputs
        x, xe, topk_idx, w = args
        assert torch.equal(_bits(comm.all_reduce(x * 0.5)), _bits(got[0]))
        rx, cnt, handle = buf.dispatch(xe, topk_idx)
        assert torch.equal(cnt, got[2])
        assert torch.equal(_bits(buf.combine(rx * 2, topk_idx, w, handle)), _bits(got[3]))
    comm.check()
    buf.check()
    buf.close()
    comm.close()


def test_compiled_step_matches_eager():
    run_distributed(_compile_body, 2, backend="nccl", timeout=300)


def _fused_body(rank, ws):
    """The four fused-norm ops chained in one compiled step (the first layer's join, then the
    residual joins with FP8 outputs), against the same step eagerly; the static scale is an
    input of the graph, a new value each call."""
    import llcomm
    import llcomm.ops as ops
    comm = llcomm.Communicator(max_bytes=1 << 20, backend="peer", timeout_ms=COMPILE_TIMEOUT_MS)

    def step(x, w, scale):
        y0, h0 = ops.all_reduce_rmsnorm(comm, x, w)
        y1, h1 = ops.all_reduce_residual_rmsnorm(comm, y0 * 0.5, h0, w)   # * 0.5: exact
        q2, h2 = ops.all_reduce_residual_rmsnorm_fp8(comm, y1, h1, w, scale=scale)
        q3, s3, h3 = ops.all_reduce_residual_rmsnorm_fp8_per_group(comm, y1, h2, w,
                                                                   round_scale=True)
        return y0, h0, y1, h1, q2, h2, q3, s3, h3

    compiled = torch.compile(step, fullgraph=True)
    for seed in range(3):
        x = _case(rank, seed, n=1)[0]
        g = torch.Generator(device="cuda")
        g.manual_seed(seed)                             # weight and scale: the same on all ranks
        w = (torch.rand(x.shape[1], generator=g, device="cuda") + 0.5).to(torch.bfloat16)
        scale = torch.rand((), generator=g, device="cuda") * 0.01 + 0.001
        want = step(x, w, scale)
        got = compiled(x, w, scale)
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), \
                (seed, i)
    comm.check()
    comm.close()


def test_compiled_fused_norms_match_eager():
    run_distributed(_fused_body, 2, backend="nccl", timeout=300)

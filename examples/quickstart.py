"""Quickstart: every Communicator op and one MoE dispatch / combine, checked against plain math.

    python examples/quickstart.py            # 2 local processes (GPUs if there are two, else CPU)
    torchrun --nproc-per-node 2 examples/quickstart.py
"""
import torch
import torch.distributed as dist

import llcomm
from _launch import device, launch


def main():
    rank, ws = dist.get_rank(), dist.get_world_size()
    dev = device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32

    comm = llcomm.Communicator(max_bytes=1 << 20)     # a collective: every rank, once
    if rank == 0:
        print(f"backend={comm.backend} ({comm.backend_reason})")

    x = torch.full((4, 256), float(rank + 1), dtype=dtype, device=dev)
    y = comm.all_reduce(x)                                    # sum over ranks
    assert torch.all(y == ws * (ws + 1) / 2)
    g = comm.all_gather(x)                                    # [ws * 4, 256], rank order
    assert torch.all(g[4 * (ws - 1):] == ws)
    t = comm.all_gather_2d(x)                                 # [4, ws * 256], token-major
    assert torch.all(t[:, 256:512] == 2)
    s = comm.reduce_scatter(torch.ones(ws * 4, 256, dtype=dtype, device=dev))
    assert s.shape == (4, 256) and torch.all(s == ws)
    comm.broadcast(x, src=0)                                  # rank 0's x, everywhere, in place
    assert torch.all(x == 1)
    comm.check()                                              # raise what a kernel reported

    # MoE: 4 experts per rank, top-2 routing, 8 tokens per rank at most.
    hidden, experts = 128, 4 * ws
    buf = llcomm.EPBuffer(num_experts=experts, hidden=hidden, num_max_dispatch_tokens_per_rank=8,
                          dtype=dtype)
    tokens = torch.randn(6, hidden, device=dev).to(dtype)
    topk_idx = torch.stack([torch.arange(6, device=dev) % experts,
                            (torch.arange(6, device=dev) + 1) % experts], 1)
    topk_weights = torch.full((6, 2), 0.5, device=dev)
    recv_x, recv_count, handle = buf.dispatch(tokens, topk_idx)
    expert_out = recv_x * 2                                   # every expert doubles its tokens
    out = buf.combine(expert_out, topk_idx, topk_weights, handle)
    torch.testing.assert_close(out, tokens * 2)               # 0.5 * 2x + 0.5 * 2x
    buf.check()
    buf.close()
    comm.close()
    if rank == 0:
        print("quickstart: ok")


if __name__ == "__main__":
    launch(main)

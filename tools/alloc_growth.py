"""Which step of a create / destroy cycle grows torch's allocated device bytes (2+ GPUs).

    python tools/alloc_growth.py [--cycles 200]

tests/test_faults_gpu.py's leak test saw ``torch.cuda.memory_allocated()`` grow by about 1 KiB
per Communicator or EPBuffer cycle while the driver's used memory, the open file descriptors and
the Python-visible CUDA tensors stayed flat. This repeats each ingredient of a cycle on its own,
``--cycles`` times, and prints the growth per cycle: torch.distributed's barrier and object
exchange (which the constructors call), torch's symmetric-memory allocation + rendezvous alone
(the workspace's), then Communicator and EPBuffer create + close without an op, then with one.
"""
import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llcomm.bench import common as C  # noqa: E402


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _steps():
    import llcomm
    from llcomm.ep import EPBuffer

    def comm(op: bool):
        c = llcomm.Communicator(max_bytes=64 << 10, backend="peer")
        if op:
            c.all_reduce(torch.ones(1024, device="cuda", dtype=torch.bfloat16))
            c.check()
        c.close()

    def ep(op: bool):
        b = EPBuffer(num_experts=8, hidden=256, num_max_dispatch_tokens_per_rank=8,
                     backend="peer")
        if op:
            x = torch.ones(4, 256, dtype=torch.bfloat16, device="cuda")
            idx = torch.tensor([[0, 7], [1, 2], [3, 4], [5, 6]], device="cuda")
            rx, _, h = b.dispatch(x, idx)
            b.combine(rx, idx, torch.ones(4, 2, device="cuda"), h)
            b.check()
        b.close()

    def symm():
        import torch.distributed._symmetric_memory as symm_mem
        buf = symm_mem.empty(1 << 16, dtype=torch.uint8, device="cuda")
        symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
        torch.cuda.synchronize()
        dist.barrier()

    return {"dist.barrier": lambda: dist.barrier(),
            "symm_mem.empty+rendezvous (torch alone)": symm,
            "dist.all_gather_object": lambda: dist.all_gather_object([None] * dist.get_world_size(),
                                                                     ("x", 1)),
            "Communicator create+close": lambda: comm(False),
            "Communicator create+op+close": lambda: comm(True),
            "EPBuffer create+close": lambda: ep(False),
            "EPBuffer create+dispatch+combine+close": lambda: ep(True)}


def rank_main(rank: int, world: int, cycles: int) -> dict:
    out = {}
    for name, step in _steps().items():
        step()                              # first use: lazy initialisation, not growth
        before = _allocated()
        for _ in range(cycles):
            step()
        out[name] = (_allocated() - before) / cycles
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=200)
    a = ap.parse_args()
    if C.plan()[1] != "nccl":
        print("needs two or more GPUs")
        return 2
    got = C.launch(rank_main, a.cycles)
    print(f"# torch.cuda.memory_allocated() growth per cycle, rank 0, {a.cycles} cycles")
    for name, per in got.items():
        print(f"{name:42s} {per:10.1f} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())

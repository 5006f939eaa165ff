"""``EPBuffer`` on the ``"shmem"`` backend, on CPU: what the buffer hands ``HostsPeerEP``.

The two-level kernels need GPUs and NVSHMEM (``tools/shmem_check.py`` runs them); their logic is
checked in the interpreter (``test_ep_hosts_kernels_cpu.py``). What is left is the glue: that
every ``EPBuffer`` call reaches ``HostsPeerEP`` with the kernels' runtime arguments in their
order, shapes and types, the handle's state passed from the dispatch to the combine, the right
stages for the split halves, and the carried weights. Here ``HostsPeerEP`` runs without a
heap, its launcher recording each launch instead of running it, on two gloo ranks declared as
two hosts.
"""
from __future__ import annotations

import torch

from _dist import run_distributed

E, T, H, K = 8, 6, 256, 2


def _glue_body(rank, world):
    import llcomm
    from llcomm.ep import api
    from llcomm.ep.hosts import layout as hosts_layout
    from llcomm.ep.hosts import peer as hosts_peer
    from llcomm.ep.hosts.kernels import combine as HC
    from llcomm.ep.hosts.kernels import dispatch as HD
    from llcomm.ep.layout import ERR_MASK, HANDLE_SLOTS, MAX_TOPK
    from llcomm.runtime import protocol as P
    from llcomm.runtime.hosts import Hosts

    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __call__(self, grid, args, consts):
            launches.append((self.kernel, grid, args, consts))

    def fake_init(self, buf, num_blocks=None):
        self.HD, self.HC = HD, HC
        self.rank, self.W = buf.rank, buf.num_ranks
        self.N, self.R = buf.hosts.num_hosts, buf.hosts.ranks_per_host
        self.device = torch.device("cpu")
        self.nb = 4
        self.buf = buf
        self.layout = hosts_peer.make_layout(buf.max_tokens, buf.hidden, self.N, self.R,
                                             buf.dtype.itemsize, buf.fp8, buf.num_experts,
                                             self.nb)
        self.tab = torch.zeros(self.W, dtype=torch.int64)
        self.timeout_us = buf.timeout_ms * P.US_PER_MS
        self.ctrl = torch.zeros((2, self.nb), dtype=torch.int64)
        self.ledger = torch.zeros((2, self.nb, self.N, 3), dtype=torch.int64)
        self.shmem = 1
        self._host_np = torch.zeros(2, dtype=torch.int64).numpy()
        self.err = torch.zeros(hosts_layout.ERR_WORDS, dtype=torch.int64)
        self.masks = int(buf.enable_masks)
        self._failure = P.FailureLatch(self.rank, "EPBuffer")
        L = buf.num_local_experts
        self.slots = [dict(row_of=torch.zeros(self.W * T * MAX_TOPK, dtype=torch.int32),
                           src_info=torch.zeros((L, self.W * T), dtype=torch.int32),
                           recv_count=torch.zeros(L, dtype=torch.int32),
                           ntok=torch.zeros(self.W, dtype=torch.int32),
                           fwd_ids=torch.zeros(self.N * T * MAX_TOPK, dtype=torch.int32),
                           fwd_ntok=torch.zeros(self.N, dtype=torch.int32),
                           w_of=torch.zeros(self.W * T * MAX_TOPK, dtype=torch.float32))
                      for _ in range(HANDLE_SLOTS)]
        self._dispatch = Recorder(HD.hosts_dispatch_kernel)
        self._combine = Recorder(HC.hosts_combine_kernel)
        self._consts = {}
        self._last = 0

    hosts_peer.HostsPeerEP.__init__ = fake_init
    api.choose_backend_hosts = lambda group, backend, what, agreed, rph: (
        "shmem", "faked: two hosts", Hosts(2, 1, "declared"))
    buf = llcomm.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T)
    assert buf.backend == "shmem" and isinstance(buf._impl, hosts_peer.HostsPeerEP)
    x = torch.randn(T - rank, H).to(torch.bfloat16)
    idx = torch.randint(0, E, (T - rank, K))
    w = torch.rand(T - rank, K)
    problems = []

    def check(launch, stages, fp8=0, masks=0):
        kernel, grid, args, consts = launch
        if consts.get("MASKS") != masks:
            problems.append(f"{kernel.fn.__name__}: MASKS={consts.get('MASKS')}, expected "
                            f"{masks}")
        names = [n for n, p in zip(kernel.arg_names, kernel.params)
                 if not p.is_constexpr and n not in consts]
        if len(args) != len(names):
            problems.append(f"{kernel.fn.__name__}: {len(args)} arguments for {names}")
            return {}
        got = dict(zip(names, args), **{n: consts[n] for n in ("wts", "w_of") if n in consts})
        if consts.get("STAGES") != stages or consts.get("SHMEM") != 1 or grid != (4,):
            problems.append(f"{kernel.fn.__name__}: stages {consts.get('STAGES')}, SHMEM "
                            f"{consts.get('SHMEM')}, grid {grid}")
        if kernel is HD.hosts_dispatch_kernel and consts.get("FP8") != fp8:
            problems.append(f"dispatch FP8={consts.get('FP8')}, expected {fp8}")
        return got

    recv_x, cnt, handle = buf.dispatch(x, idx)
    got = check(launches[-1], HD.HOSTS_DISPATCH_ALL)
    if got:
        if not (got["x"].data_ptr() == x.data_ptr() and got["topk"] is idx
                and got["n_tok"] == x.shape[0] and got["recv_x"] is recv_x
                and got["recv_count"] is cnt and got["rank"] == rank
                and tuple(got["row_of"].shape) == (world, T, K)
                and tuple(got["fwd_ids"].shape) == (2, T, K)):
            problems.append("dispatch arguments")
    out = buf.combine(recv_x, idx, w, handle)
    got = check(launches[-1], HC.HOSTS_COMBINE_ALL)
    d = dict(zip([n for n, p in zip(HD.hosts_dispatch_kernel.arg_names,
                                     HD.hosts_dispatch_kernel.params) if not p.is_constexpr],
                 launches[-2][2]))
    if got and not (got["eo"] is recv_x and got["wts"] is w and got["out"] is out
                    and got["row_of"] is d["row_of"] and got["ntok_in"] is d["ntok_out"]
                    and got["fwd_ids"] is d["fwd_ids"] and got["fwd_ntok"] is d["fwd_ntok"]):
        problems.append("combine arguments: not the dispatch's handle state")
    # FP8 with a hook, then a combine with the weights the dispatch carried, split too
    (q, scales), cnt, handle, hook = buf.dispatch(x, idx, use_fp8=True, return_recv_hook=True,
                                                 topk_weights=w)
    sent = check(launches[-1], HD.HOSTS_DISPATCH_SEND_HALF, fp8=1)
    if sent and not (launches[-1][3].get("CARRY") == 1 and sent["wts"] is w
                     and tuple(sent["w_of"].shape) == (world, T, K)):
        problems.append("dispatch: the weights were not carried (CARRY, wts, w_of)")
    hook()
    got = check(launches[-1], HD.HOSTS_DISPATCH_RECV_HALF, fp8=1)
    if got and not (got["recv_x"].dtype == torch.uint8 and got["recv_scales"] is scales):
        problems.append("FP8 dispatch arguments")
    eo = buf.get_combine_input(handle)
    out, hook = buf.combine(eo, idx, None, handle, return_recv_hook=True)
    got = check(launches[-1], HC.HOSTS_COMBINE_SEND_HALF)
    if got and not (launches[-1][3].get("CARRIED") == 1 and sent
                    and got["w_of"] is sent["w_of"]):
        problems.append("combine: not told the dispatch carried the weights (CARRIED, w_of)")
    hook()
    check(launches[-1], HC.HOSTS_COMBINE_RECV_HALF)
    # rank masks: the kernels get MASKS=1; the mask methods change err[ERR_MASK] only
    mbuf = llcomm.EPBuffer(num_experts=E, hidden=H, num_max_dispatch_tokens_per_rank=T,
                           enable_masks=True)
    recv_x, cnt, handle = mbuf.dispatch(x, idx)
    check(launches[-1], HD.HOSTS_DISPATCH_ALL, masks=1)
    mbuf.combine(recv_x, idx, w, handle)
    check(launches[-1], HC.HOSTS_COMBINE_ALL, masks=1)
    mbuf.set_mask(1 - rank, True)
    if mbuf.query_mask().tolist() != [int(q != rank) for q in range(world)]:
        problems.append(f"query_mask after set_mask({1 - rank}): {mbuf.query_mask().tolist()}")
    before = mbuf._impl.err.clone()
    mbuf.clean_mask()
    changed = (mbuf._impl.err != before).nonzero().flatten().tolist()
    if mbuf.query_mask().tolist() != [0] * world or changed != [ERR_MASK]:
        problems.append(f"clean_mask: mask {mbuf.query_mask().tolist()}, words changed "
                        f"{changed}")
    return problems, len(launches)


def test_epbuffer_hands_the_two_level_kernels_their_arguments():
    for problems, n in run_distributed(_glue_body, 2):
        assert not problems, problems
        assert n == 8


def test_shmem_launcher_initialises_each_new_module_once_and_raises_its_first_bound():
    """``ShmemLauncher``: SHMEM is initialised in a compiled kernel's module before its first
    launch, only where the module links NVSHMEM's device state and only once; the first launch
    of each compiled kernel runs with the long wait bound (a peer may be compiling), later ones
    with the caller's; every launch links the device library."""
    import types

    from llcomm.runtime.launch import FIRST_LAUNCH_TIMEOUT_US
    from llcomm.runtime.shmem import ShmemLauncher

    variants = {1: types.SimpleNamespace(asm={"ptx": "ld nvshmemi_device_state_d"}, module="m1",
                                         _init_handles=lambda: None),
                2: types.SimpleNamespace(asm={"ptx": "no shmem here"}, module="m2",
                                         _init_handles=lambda: None)}
    launched, initialised = [], []

    class FakeKernel:
        arg_names = ["x", "timeout_us", "STAGES"]

        def warmup(self, *args, grid, extern_libs, **consts):
            assert extern_libs == {"libnvshmem_device": "lib.bc"}
            return variants[consts["STAGES"]]

        def __getitem__(self, grid):
            return lambda *args, extern_libs, **consts: launched.append((args, consts))

    launch = ShmemLauncher(FakeKernel(), module_init=initialised.append,
                           libs={"libnvshmem_device": "lib.bc"})
    for stages in (1, 1, 2, 2, 1):
        launch((4,), ("x", 1000), {"STAGES": stages})
    assert initialised == ["m1"]
    assert [a[1] for a, _ in launched] == [FIRST_LAUNCH_TIMEOUT_US, 1000,
                                           FIRST_LAUNCH_TIMEOUT_US, 1000, 1000]

"""The peer backend's launch plans and the launcher's planned path, on the CPU.

``PeerBackend.all_reduce`` / ``reduce_scatter`` keep one launch plan per (algorithm, size, dtype)
so that a call only wraps its two tensors (docs/design.md, "Launch path"). A plan that put an
argument in the wrong place, or reused one size's tag for another, would launch a kernel that
waits for the wrong thing: these tests map every launched argument to the kernel's parameter
name and check it, for every algorithm, dtype and a spread of sizes, on a backend shell whose
launcher records instead of launching. ``Launcher.run`` is checked with stand-in kernels:
one compile per key, the cached kernel for later calls, a new key when an operand's alignment
changes, and every pointer handed to the cached kernel as the int address of the right tensor.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from llcomm.runtime import launch
from llcomm.tp import peer
from llcomm.runtime import protocol as P
from llcomm.runtime.kernels.lamport import ALL_STAGES
from llcomm.tp.kernels import all_reduce as K, lamport_all_reduce as LK, reduce_scatter as RS
from llcomm.tp.kernels import fused_norm as F

@triton.jit
def _add_kernel(x, out, n, add, timeout_us, BLOCK: tl.constexpr):
    """out = x + add (``timeout_us`` unused: the launcher's first-launch bound has a place)."""
    offs = tl.arange(0, BLOCK)
    tl.store(out + offs, tl.load(x + offs, mask=offs < n) + add, mask=offs < n)


DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SIZES = (1, 7, 4096, 65536 + 3, 1 << 20, (4 << 20) + 5)
W, NB, RANK, TIMEOUT_US = 2, 128, 1, 123_000


class Recorder:
    """Stands in for ``Launcher``: keeps each planned launch, with x and out as the kernel
    reads them (the plan's view)."""

    def __init__(self):
        self.calls = []

    def run(self, plan, *ts):
        ts = [t if v is None else t.view(v) for t, v in zip(ts, plan.views, strict=True)]
        self.calls.append((plan.fn, plan.grid, (*ts, *plan.tail), plan.num_warps,
                           dict(plan.consts), plan))


def _backend(launcher):
    """A PeerBackend with CPU stand-ins for its device tables (no GPU, no workspace)."""
    import triton.language as tl
    pb = object.__new__(peer.PeerBackend)
    pb.nb, pb.world_size, pb.WP, pb.rank = NB, W, 2, RANK
    pb.max_bytes = pb.cap_bytes = 16 << 20
    pb.lamport_bytes = pb.rs_lamport_bytes = 32 << 20    # above every size below
    pb.timeout_us = TIMEOUT_US
    pb.tabs = {k: torch.full((W,), i, dtype=torch.int64) for i, k in enumerate(
        ("flags", "stage", "gather", "lamport", "lamport_tags"))}
    pb.ctrl, pb.err, pb.flags = (torch.zeros(NB, dtype=torch.int64),
                                 torch.zeros(2, dtype=torch.int64),
                                 torch.zeros(8, dtype=torch.int64))
    pb._err_np = [0]
    pb._failure = P.FailureLatch(RANK, "communicator")
    pb._tl_float = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                    torch.float32: tl.float32}
    pb._k_ar = K
    pb._k_lam = LK
    pb._k_rs = RS
    pb._plans = {}
    pb._launch = launcher
    return pb


def _named(fn, args, consts):
    """Every parameter of ``fn`` by name: the positional arguments, then the constexprs."""
    names = fn.arg_names
    assert len(args) + len(consts) <= len(names)
    got = dict(zip(names, args))
    assert not set(consts) & set(got), "a constexpr also passed positionally"
    assert set(consts) <= set(names[len(args):]), "a constexpr the kernel does not have"
    got.update(consts)
    return got


def _expect(pb, algo, n, dtype):
    """What the launch of ``algo`` on n elements of dtype must carry (independent of _plan):
    an all_reduce algorithm, or "rs_lamport" / "rs_flag", a reduce_scatter into n elements."""
    isz = dtype.itemsize
    name = str(dtype).removeprefix("torch.")
    if algo in ("lamport", "rs_lamport"):
        op = P.OP_LAMPORT if algo == "lamport" else P.OP_LAMPORT_REDUCE_SCATTER
        fn = LK.lamport_kernel if algo == "lamport" else RS.lamport_reduce_scatter_kernel
        block, warps = peer._launch_shape(n, isz, NB, peer.LAMPORT_CHUNK_BYTES)
        return fn, warps, dict(
            n=n, lam_tab=pb.tabs["lamport"], tag_tab=pb.tabs["lamport_tags"], ctrl=pb.ctrl,
            err=pb.err, rank=RANK, tag=P.lamport_tag(op, n, name), timeout_us=TIMEOUT_US,
            cap=pb.lamport_bytes // isz, BLOCK=block, LAG=int(n > NB * block),
            SENTINEL=peer.SENTINEL16 if isz == 2 else peer.SENTINEL32)
    if algo == "rs_flag":
        block, warps = peer._launch_shape(n, isz, NB)
        return RS.reduce_scatter_kernel, warps, dict(
            m_out=n, stage_tab=pb.tabs["stage"], flag_tab=pb.tabs["flags"], flags=pb.flags,
            ctrl=pb.ctrl, err=pb.err, rank=RANK, tag=P.size_tag(P.OP_REDUCE_SCATTER, n, name),
            timeout_us=TIMEOUT_US, cap=pb.cap_bytes // isz, BLOCK=block, NUM_BLOCKS=NB, WORLD=W)
    if algo == "one_shot":
        block, warps = peer._launch_shape(n, isz, NB)
        return K.one_shot_kernel, warps, dict(
            n=n, stage_tab=pb.tabs["stage"], flag_tab=pb.tabs["flags"], flags=pb.flags,
            ctrl=pb.ctrl, err=pb.err, rank=RANK, tag=P.size_tag(P.OP_ONE_SHOT, n, name),
            timeout_us=TIMEOUT_US, cap=pb.cap_bytes // isz, BLOCK=block, NUM_BLOCKS=NB, WORLD=W)
    shard = -(-(-(-n // W)) // peer.SHARD_ALIGN) * peer.SHARD_ALIGN
    block, warps = peer._launch_shape(shard, isz, NB)
    return K.two_shot_kernel, warps, dict(
        n=n, shard=shard, stage_tab=pb.tabs["stage"], gather_tab=pb.tabs["gather"],
        flag_tab=pb.tabs["flags"], flags=pb.flags, ctrl=pb.ctrl, err=pb.err, rank=RANK,
        tag=P.size_tag(P.OP_TWO_SHOT, n, name), timeout_us=TIMEOUT_US,
        cap=pb.cap_bytes // isz, BLOCK=block, NUM_BLOCKS=NB, WORLD=W)


@pytest.mark.parametrize("algo", ["lamport", "one_shot", "two_shot", "rs_lamport", "rs_flag"])
def test_every_planned_argument_is_the_right_one(algo):
    """One backend for every dtype and size, twice over (the second pass takes kept plans):
    a plan kept under too coarse a key would show as another size's or dtype's arguments.
    reduce_scatter: the Lamport kernel up to the Lamport slot, the flag kernel above."""
    rec = Recorder()
    pb = _backend(rec)
    if algo == "rs_flag":
        pb.rs_lamport_bytes = 0
    cases = [(n, dtype) for n in SIZES for dtype in DTYPES]
    for n, dtype in cases + cases[::-1]:
        x = torch.randn(n * (W if algo.startswith("rs_") else 1)).to(dtype)
        out = torch.empty(n, dtype=dtype)
        if algo.startswith("rs_"):
            pb.reduce_scatter(x, out)
        else:
            pb.all_reduce(x, out, algo)
        fn, grid, args, warps, consts, plan = rec.calls[-1]
        want_fn, want_warps, want = _expect(pb, algo, n, dtype)
        assert (fn, grid, warps) == (want_fn, NB, want_warps), (algo, n)
        got = _named(fn, args, consts)
        for name, value in want.items():
            same = got[name] is value if isinstance(value, torch.Tensor) else got[name] == value
            assert same, (algo, n, dtype, name, got[name], value)
        view = (torch.int16 if dtype.itemsize == 2 else torch.int32) if "lamport" in algo \
            else dtype
        assert got["x"].dtype == got["out"].dtype == view
        assert got["x"].data_ptr() == x.data_ptr() and got["out"].data_ptr() == out.data_ptr()
        tail = args[len(plan.views):]
        assert plan.key == launch.static_key(fn, warps, tail, consts)
        # what the cached kernel is handed: each tensor of the tail as its address
        assert plan.raw_tail == tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a
                                      for a in tail)
        assert any(isinstance(a, torch.Tensor) for a in tail)
    assert len(pb._plans) == len(cases)


#: Per fused variant (the Communicator method): RESIDUAL, OUT, the Lamport and one-shot op codes.
FUSED = {
    "all_reduce_residual_rmsnorm": (1, F.PLAIN, P.OP_FUSED_LAMPORT, P.OP_FUSED_ONE_SHOT),
    "all_reduce_rmsnorm": (0, F.PLAIN, P.OP_NORM_LAMPORT, P.OP_NORM_ONE_SHOT),
    "all_reduce_residual_rmsnorm_fp8": (1, F.FP8_STATIC, P.OP_FP8_LAMPORT, P.OP_FP8_ONE_SHOT),
    "all_reduce_residual_rmsnorm_fp8_per_group": (1, F.FP8_GROUP, P.OP_FP8_GROUP_LAMPORT,
                                                  P.OP_FP8_GROUP_ONE_SHOT),
}


def _expect_fused(pb, variant, algo, tokens, hidden, dtype, eps, round_scale):
    """What the fused kernel's launch must carry (independent of _fused_plan)."""
    isz = dtype.itemsize
    name = str(dtype).removeprefix("torch.")
    rows = tokens * hidden * peer.GATHER_TAG_MIX + hidden
    block, warps = peer._row_shape(hidden)
    residual, out_mode, op_lamport, op_one_shot = FUSED[variant]
    common = dict(tokens=tokens, hidden=hidden, eps=eps, ctrl=pb.ctrl, err=pb.err, rank=RANK,
                  timeout_us=TIMEOUT_US, FLOAT=pb._tl_float[dtype], WORLD=W, WORLD_POW2=2,
                  NUM_BLOCKS=NB, BLOCK=block, STAGES=ALL_STAGES, RESIDUAL=residual, OUT=out_mode,
                  ROUND=int(round_scale))
    if algo == "lamport":
        return F.lamport_norm_kernel, warps, dict(
            common, lam_tab=pb.tabs["lamport"], tag_tab=pb.tabs["lamport_tags"],
            tag=P.lamport_tag(op_lamport, rows, name), cap=pb.lamport_bytes // isz,
            SENTINEL=peer.SENTINEL16 if isz == 2 else peer.SENTINEL32, OP=op_lamport)
    return F.one_shot_norm_kernel, warps, dict(
        common, stage_tab=pb.tabs["stage"], flag_tab=pb.tabs["flags"], flags=pb.flags,
        tag=P.size_tag(op_one_shot, rows, name), cap=pb.cap_bytes // isz, OP=op_one_shot)


@pytest.mark.parametrize("variant", sorted(FUSED))
@pytest.mark.parametrize("algo", ["lamport", "one_shot"])
def test_every_fused_planned_argument_is_the_right_one(algo, variant):
    """The fused kernels' plans, as above: per variant and (tokens, hidden, dtype, weight
    dtype, eps, round_scale). The tensors land where the kernel reads them: x as ints, an FP8
    out as bytes, qscale the scale / scales tensor (None for plain outputs), and without a
    residual the unread residual pointer is x."""
    rec = Recorder()
    pb = _backend(rec)
    pb._k_fn = F
    residual_read, out_mode = FUSED[variant][:2]
    fp8 = out_mode != F.PLAIN
    cases = [(t, h, dt, wdt, eps, rs) for t in (1, 3, 128) for h in (128, 1024, 8192)
             for dt in DTYPES for wdt in (torch.float32, torch.bfloat16) for eps in (1e-6, 1e-5)
             for rs in ((False, True) if out_mode == F.FP8_GROUP else (False,))]
    for t, h, dt, wdt, eps, rs in cases + cases[::-1]:
        x, res = torch.randn(t, h).to(dt), torch.randn(t, h).to(dt)
        w, res_out = torch.rand(h).to(wdt), torch.empty(t, h, dtype=dt)
        out = torch.empty(t, h, dtype=torch.float8_e4m3fn if fp8 else dt)
        qscale = (torch.ones(1) if out_mode == F.FP8_STATIC else
                  torch.empty(t, h // 128) if out_mode == F.FP8_GROUP else None)
        pb.fused_call(variant, algo, t, h, dt, wdt, eps, rs)(
            x, res if residual_read else None, w, out, res_out, qscale)
        fn, grid, args, warps, consts, plan = rec.calls[-1]
        want_fn, want_warps, want = _expect_fused(pb, variant, algo, t, h, dt, eps, rs)
        assert (fn, grid, warps) == (want_fn, NB, want_warps), (algo, t, h)
        got = _named(fn, args, consts)
        for name, value in want.items():
            same = got[name] is value if isinstance(value, torch.Tensor) else got[name] == value
            assert same, (variant, algo, t, h, dt, wdt, eps, name, got[name], value)
        assert got["x"].dtype == (torch.int16 if dt.itemsize == 2 else torch.int32)
        assert got["x"].data_ptr() == x.data_ptr()
        assert got["out"].dtype == (torch.uint8 if fp8 else dt)
        assert got["out"].data_ptr() == out.data_ptr()
        assert got["residual"] is (res if residual_read else x)
        for name, tensor in (("weight", w), ("res_out", res_out), ("qscale", qscale)):
            assert got[name] is tensor, name
        assert plan.raw_tail == tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a
                                      for a in args[len(plan.views):])
    assert len(pb._plans) == len(cases)


def test_reduce_scatter_kernel_by_output_bytes():
    """The Lamport reduce_scatter up to the Lamport slot of output, the flag one above; its
    plans are its own, never an all_reduce's."""
    rec = Recorder()
    pb = _backend(rec)
    pb.rs_lamport_bytes = 8192
    for n, dtype, fn in ((4096, torch.bfloat16, RS.lamport_reduce_scatter_kernel),
                         (4097, torch.bfloat16, RS.reduce_scatter_kernel),
                         (2048, torch.float32, RS.lamport_reduce_scatter_kernel),
                         (2049, torch.float32, RS.reduce_scatter_kernel)):
        pb.reduce_scatter(torch.randn(W * n).to(dtype), torch.empty(n, dtype=dtype))
        assert rec.calls[-1][0] is fn, (n, dtype)
    pb.all_reduce(torch.randn(4096).bfloat16(), torch.empty(4096, dtype=torch.bfloat16),
                  "lamport")
    assert rec.calls[-1][0] is LK.lamport_kernel
    assert sorted(k[0] for k in pb._plans) == ["lamport"] + ["reduce_scatter"] * 4


def test_plans_are_kept_per_size_and_bounded(monkeypatch):
    rec = Recorder()
    pb = _backend(rec)
    x, out = torch.randn(4096).bfloat16(), torch.empty(4096, dtype=torch.bfloat16)
    pb.all_reduce(x, out, "lamport")
    plan = pb._plans[("lamport", 4096, torch.bfloat16)]
    pb.all_reduce(x, out, "lamport")
    assert pb._plans[("lamport", 4096, torch.bfloat16)] is plan and len(rec.calls) == 2
    monkeypatch.setattr(peer, "PLAN_CACHE_MAX", 3)
    for n in range(1, 8):
        pb.all_reduce(x[:n], out[:n], "one_shot")
    assert len(pb._plans) <= 3


class _StandIn:
    """A kernel stand-in: ``fn[grid](...)`` 'compiles' (counted) and returns a kernel whose
    ``run`` records the arguments it was given. ``kernel_class``: what it returns (``Kernel``
    takes what Triton's launcher takes; a test may hand one that does not)."""

    def __init__(self, arg_names):
        self.arg_names = arg_names
        self.compiles, self.runs, self.fail = 0, [], False
        self.on_launch = lambda: None
        outer = self

        class Kernel:
            function = packed_metadata = None

            def run(self, gridX, gridY, gridZ, stream, function, kernel_metadata,
                    launch_metadata, launch_enter_hook, launch_exit_hook, *args):
                if outer.fail:
                    raise TypeError("run() takes other arguments")
                outer.on_launch()
                outer.runs.append(args)
        self.kernel_class = Kernel

    def __getitem__(self, grid):
        def compile_and_launch(*args, num_warps, **consts):
            self.compiles += 1
            self.on_launch()
            self.args, self.consts = args, consts
            return self.kernel_class()
        return compile_and_launch


def test_launcher_planned_path_compiles_once_per_key(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    fn = _StandIn(["x", "out", "n", "tab", "timeout_us", "BLOCK"])
    lau = launch.Launcher(torch.device("cpu"))
    consts = {"BLOCK": 64}
    tab = torch.arange(4, dtype=torch.int64)
    plan = launch.Plan(fn, 8, (10, tab, 5), 4, consts, (torch.int16, torch.int16))
    buf = torch.zeros(64, dtype=torch.bfloat16)
    a, b = buf[:16], buf[16:32]             # both 16-byte aligned
    lau.run(plan, a, b)
    assert fn.compiles == 1 and fn.runs == []           # the first call goes through Triton,
    x, out, n, t, timeout = fn.args                     # with the plan's view of the operands
    assert x.dtype == out.dtype == torch.int16 and x.data_ptr() == a.data_ptr()
    assert out.data_ptr() == b.data_ptr() and t is tab and n == 10
    assert timeout == launch.FIRST_LAUNCH_TIMEOUT_US    # and the first launch's long bound
    lau.run(plan, b, a)
    assert fn.compiles == 1 and len(fn.runs) == 1       # then the cached kernel, new tensors,
    assert fn.runs[-1] == (b.data_ptr(), a.data_ptr(), 10, tab.data_ptr(), 5, 64)  # as ints
    lau.run(plan, buf[1:17], b)
    assert fn.compiles == 2                             # misaligned operand: another key
    lau.run(plan, buf[1:17], a)
    assert fn.compiles == 2 and fn.runs[-1][:2] == (buf[1:17].data_ptr(), a.data_ptr())
    other = launch.Plan(fn, 8, (10, tab, 5), 4, consts, (torch.int16, torch.int16))
    lau.run(other, a, b)                                # a new plan of the same launch finds
    assert fn.compiles == 2 and len(fn.runs) == 3       # the launcher's compiled kernel
    lau(fn, 8, (a, b, 10, tab, 5), 4, **consts)         # the unplanned path keys differently
    assert fn.compiles == 3
    lau(fn, 8, (a, b, 10, tab, 5), 4, **consts)
    assert fn.compiles == 3 and fn.runs[-1][0] is a and fn.runs[-1][3] is tab


def test_launcher_falls_back_to_triton_when_the_direct_launch_fails(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    fn = _StandIn(["x", "out", "n", "BLOCK"])
    lau = launch.Launcher(torch.device("cpu"))
    plan = launch.Plan(fn, 8, (10,), 4, {"BLOCK": 64}, (None, None))
    a = torch.zeros(16, dtype=torch.int16)
    lau.run(plan, a, a)
    fn.fail = True                      # the cached kernel's run raises (another Triton)
    lau.run(plan, a, a)
    assert lau.direct is False and fn.compiles == 2     # Triton's own launch, tensors given
    lau.run(plan, a, a)
    assert fn.compiles == 3 and fn.args[0] is a


class _ChangedLauncher:
    """A compiled kernel of another Triton: its launcher takes one more parameter before the
    kernel's arguments. Called directly, it would read every argument one place off, without
    a word: ``calls`` keeps what it was handed."""
    function = packed_metadata = None
    calls: list = []

    def run(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
            launch_enter_hook, launch_exit_hook, cooperative, *args):
        self.calls.append(args)


class _NoLauncher:
    """A compiled kernel of another Triton without the private launcher at all."""
    function = None


@pytest.mark.parametrize("kernel_class", [_ChangedLauncher, _NoLauncher])
def test_launcher_uses_tritons_launch_where_the_private_one_differs(monkeypatch, kernel_class):
    """A compiled kernel whose launcher is missing or takes other parameters is never called
    directly: every launch, planned or not, goes through ``fn[grid](...)`` with the tensors and
    the launch's own values, and the launcher says so once."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    fn = _StandIn(["x", "out", "n", "BLOCK"])
    fn.kernel_class = kernel_class
    lau = launch.Launcher(torch.device("cpu"))
    plan = launch.Plan(fn, 8, (10,), 4, {"BLOCK": 64}, (None, None))
    a, b = torch.zeros(16, dtype=torch.int16), torch.ones(16, dtype=torch.int16)
    for i, (x, out) in enumerate(((a, b), (b, a), (a, a))):
        lau.run(plan, x, out)
        assert fn.compiles == 2 * i + 1 and fn.args == (x, out, 10)
        assert fn.consts == {"BLOCK": 64, "enable_fp_fusion": launch.FP_FUSION}
        lau(fn, 8, (out, x, 11 + i), 4, BLOCK=32)
        assert fn.compiles == 2 * i + 2 and fn.args == (out, x, 11 + i)
    assert lau.direct is False and fn.runs == [] and _ChangedLauncher.calls == []


@pytest.mark.parametrize("backend", ["nvidia", "amd"])
def test_this_tritons_launchers_take_what_the_direct_launch_hands(backend):
    """The launcher classes of the installed Triton (no GPU needed to read their signature)
    pass ``direct_unavailable``: the direct launch is not lost on the releases it serves."""
    import importlib
    driver = importlib.import_module(f"triton.backends.{backend}.driver")
    cls = next(v for k, v in vars(driver).items() if k.endswith("Launcher") and isinstance(v, type))

    class Compiled:                         # what fn[grid](...) returns, but for the launcher
        function = packed_metadata = None
        run = object.__new__(cls)
    assert launch.direct_unavailable(Compiled()) is None


def test_direct_launch_only_on_the_checked_triton_releases(monkeypatch):
    lo, hi = launch.DIRECT_TRITON
    assert launch.triton_unchecked(f"{lo[0]}.{lo[1]}.0") is None
    assert launch.triton_unchecked(f"{hi[0]}.{hi[1]}.1+git0123") is None
    for other in (f"{hi[0]}.{hi[1] + 1}.0", f"{lo[0]}.{lo[1] - 1}.1", f"{hi[0] + 1}.0.0", "dev"):
        assert launch.triton_unchecked(other) is not None, other
    import triton
    assert launch.triton_unchecked() == launch.triton_unchecked(triton.__version__)
    monkeypatch.setattr(launch, "triton_unchecked", lambda: "Triton 9.9.0 is outside ...")
    assert launch.Launcher(torch.device("cpu")).direct is False


def launch_in_interpreter(rounds: int) -> dict:
    """Inside ``TRITON_INTERPRET=1`` (where ``fn[grid](...)`` returns no compiled kernel at
    all): a real kernel through ``Launcher``, planned and not, ``rounds`` times on fresh
    inputs. Returns whether every result was right and whether the direct path stayed on."""
    torch.cuda.is_current_stream_capturing = lambda: False     # a CPU torch has no CUDA
    lau = launch.Launcher(torch.device("cpu"))
    plan = launch.Plan(_add_kernel, 1, (64, 5, TIMEOUT_US), 1, {"BLOCK": 64}, (None, None))
    right = []
    for i in range(rounds):
        x = torch.arange(64, dtype=torch.int32) * (i + 1)
        out = torch.zeros_like(x)
        lau.run(plan, x, out)
        right.append(torch.equal(out, x + 5))
        lau(_add_kernel, 1, (x, out, 64, -i, TIMEOUT_US), 1, BLOCK=64)
        right.append(torch.equal(out, x - i))
    return {"right": right, "direct": lau.direct}


def test_launcher_results_through_tritons_launch_in_the_interpreter():
    from _interp import run_in_interpreter
    got = run_in_interpreter("test_launch_plans", "launch_in_interpreter", 3)
    assert got == {"right": [True] * 6, "direct": False}


def test_launcher_switches_to_its_device(monkeypatch):
    """A launch made while another GPU is current runs under ``torch.cuda.device`` of the
    launcher's own (its compiled kernels belong to that device's context), and only then."""
    current = [1]
    entered = []

    class _Device:                          # stands in for torch.cuda.device
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)
            self.prev, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.prev

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current[0], raising=False)
    monkeypatch.setattr(torch.cuda, "device", _Device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(launch, "pdl_enabled", lambda device, wanted: False)
    lau = launch.Launcher(torch.device("cuda", 0))
    fn = _StandIn(["x", "out", "n", "BLOCK"])
    a = torch.zeros(16, dtype=torch.int16)
    seen = []
    fn.on_launch = lambda: seen.append(current[0])
    plan = launch.Plan(fn, 8, (10,), 4, {"BLOCK": 64}, (None, None))
    for _ in range(2):                      # the compiling launch, then the cached one
        lau.run(plan, a, a)
    lau(fn, 8, (a, a, 10), 4, BLOCK=64)
    assert seen == [0, 0, 0] and entered == [0, 0, 0] and current == [1]
    current[0] = 0                          # this launcher's device is current: no switch
    lau.run(plan, a, a)
    assert seen[-1] == 0 and len(entered) == 3


@pytest.mark.parametrize("pdl", [0, 1])
def test_launcher_sets_pdl_where_the_kernel_takes_it(monkeypatch, pdl):
    """A kernel with a PDL constexpr is compiled with it set to the launcher's choice (and with
    Triton's launch_pdl option where PDL is on, only there: an older Triton has no such
    option), and the cached launch passes the same value; a kernel without one gets neither.
    Every compile states Triton's fp fusion (the launcher's FP_FUSION unless the launch says
    otherwise)."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    lau = launch.Launcher(torch.device("cpu"))
    assert lau.pdl is False                 # never on a device without PDL
    lau.pdl = bool(pdl)
    a = torch.zeros(16, dtype=torch.int16)
    fn = _StandIn(["x", "out", "BLOCK", "PDL"])
    for _ in range(2):
        lau(fn, 8, (a, a), 4, BLOCK=64)
    fusion = {"enable_fp_fusion": launch.FP_FUSION}
    assert fn.consts == ({"BLOCK": 64, "PDL": 1, "launch_pdl": True, **fusion} if pdl
                         else {"BLOCK": 64, "PDL": 0, **fusion})
    assert fn.runs[-1][2:] == (64, pdl)
    plain = _StandIn(["x", "out", "BLOCK"])
    lau(plain, 8, (a, a), 4, BLOCK=64)
    assert plain.consts == {"BLOCK": 64, **fusion}
    exact = _StandIn(["x", "out", "BLOCK"])        # a kernel that must not contract says so
    lau(exact, 8, (a, a), 4, BLOCK=64, enable_fp_fusion=False)
    assert exact.consts == {"BLOCK": 64, "enable_fp_fusion": False}


def test_pdl_setting_is_validated(monkeypatch):
    from llcomm.runtime.settings import EPSettings, TPSettings
    monkeypatch.setenv("LLCOMM_PDL", "yes")
    for read in (lambda: TPSettings.read(2), EPSettings.read):
        with pytest.raises(ValueError, match="LLCOMM_PDL='yes': expected 0 or 1"):
            read()


def test_only_a_first_launch_gets_the_long_bound_through_tritons_launcher(monkeypatch):
    """After a fall back to Triton's own launcher every launch goes through ``fn[grid]``; only a
    key's first gets FIRST_LAUNCH_TIMEOUT_US, later ones their own bound."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    fn = _StandIn(["x", "timeout_us", "BLOCK"])
    lau = launch.Launcher(torch.device("cpu"))
    lau.direct = False
    a = torch.zeros(16, dtype=torch.int16)
    bounds = []
    for _ in range(3):
        lau(fn, 8, (a, TIMEOUT_US), 4, BLOCK=64)
        bounds.append(fn.args[1])                       # what Triton's launch was given
    assert fn.compiles == 3
    assert bounds == [launch.FIRST_LAUNCH_TIMEOUT_US, TIMEOUT_US, TIMEOUT_US]


def test_every_kernel_the_library_launches_waits_for_its_peers():
    """Only a waiting kernel's first launch, the one that compiles, gets the long bound. A
    kernel that waited for nobody (a layout conversion after a dispatch, say) would compile
    between two calls' waits: a peer still compiling it would keep this rank's next call,
    already compiled, waiting under the short bound (docs/failures.md, "Compiles and the wait
    bound"). So every kernel of the library's op families takes ``timeout_us``."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import llcomm
    kernels = []
    for m in pkgutil.walk_packages(llcomm.__path__, "llcomm."):
        if not any(m.name.startswith(f"llcomm.{p}.") for p in ("tp", "ep", "deep_ep", "runtime")):
            continue
        mod = importlib.import_module(m.name)
        kernels += [(m.name, k, v) for k, v in vars(mod).items()
                    if isinstance(v, JITFunction) and k.endswith("_kernel")
                    and v.__module__ == m.name and k != "after_previous_kernel"]
    assert len(kernels) >= 10, kernels
    no_wait = [f"{mod}.{name}" for mod, name, fn in kernels
               if launch.TIMEOUT_ARG not in fn.arg_names]
    assert not no_wait, f"kernels that wait for nobody: {no_wait}"


def test_a_constexpr_left_to_its_default_reaches_the_direct_launch(monkeypatch):
    """A launch may leave out a constexpr that has a default (EPBuffer's dispatch leaves out
    DEEP_EP): Triton compiles with the default, and the cached kernel's direct launch is handed
    it too, as every parameter must be."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def kernel(x, BLOCK, MODE=7):
        pass
    fn = _StandIn(["x", "BLOCK", "MODE"])
    fn.fn = kernel
    lau = launch.Launcher(torch.device("cpu"))
    a = torch.zeros(16, dtype=torch.int16)
    lau(fn, 4, (a,), 4, BLOCK=8)
    lau(fn, 4, (a,), 4, BLOCK=8)
    assert fn.compiles == 1 and fn.runs == [(a, 8, 7)]

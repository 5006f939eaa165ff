"""llcomm works under any ``torch.set_default_device`` / ``torch.set_default_dtype``.

Inference engines (and DeepEP's own tests) often run with ``set_default_device("cuda")`` and
``set_default_dtype(torch.bfloat16)``; a library tensor made without ``device=`` then lands on
the GPU (a pinned host buffer even raises), one made without ``dtype=`` gets bf16.

- Statically: every call of a torch factory in ``llcomm/`` names both ``device=`` and ``dtype=``
  (``*_like`` and ``Tensor.new_*`` inherit them from their source and are fine).
- At run time, on two gloo ranks: the public API (every ``Communicator`` op and fused join,
  ``EPBuffer`` dispatch / combine in bf16 and FP8 with and without hooks, ``llcomm.deep_ep``'s
  low-latency calls, the ``llcomm.ops`` custom ops and their fake implementations) run first
  under ``set_default_device("meta")`` and ``set_default_dtype(torch.bfloat16)``, with llcomm
  imported only then, and again under torch's own defaults: the outputs must be CPU tensors with
  the same bits. The meta device makes any allocation that forgets its device visible: mixing it
  with a CPU tensor raises, or the result is a meta tensor with no bits to compare. (Inside a
  custom op's implementation torch applies the default dtype but not the default device: there
  the static scan is what guards the device.)
"""
from __future__ import annotations

import ast
from pathlib import Path

import torch

from _dist import run_distributed

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "llcomm"

#: torch functions that make a tensor from nothing: without ``device=`` / ``dtype=`` they take
#: the process's defaults.
FACTORIES = frozenset({
    "arange", "as_tensor", "asarray", "empty", "empty_strided", "eye", "full", "linspace",
    "logspace", "normal", "ones", "rand", "randint", "randn", "randperm", "range",
    "scalar_tensor", "sparse_coo_tensor", "tensor", "tril_indices", "triu_indices", "zeros"})
#: Objects that live on a device and take no dtype: without ``device=`` they take the default.
DEVICE_ONLY = frozenset({"Generator"})
#: Legacy constructors: they always take the default device, so they are refused outright.
LEGACY = frozenset({"Tensor", "FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor",
                    "ByteTensor", "CharTensor", "ShortTensor", "IntTensor", "LongTensor",
                    "BoolTensor"})
#: Fewest factory calls the scan must see in the package (it sees over a hundred): a scan that
#: matches nothing would pass everything.
MIN_FACTORY_CALLS = 80


# -- the static scan --------------------------------------------------------------------------
def _torch_names(tree: ast.AST) -> set[str]:
    """The names the module binds ``torch`` to (``import torch``, ``import torch as th``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name == "torch"}
    return names


def scan(source: str, where: str) -> tuple[int, list[str]]:
    """``(factory calls seen, problems)`` of one module; a problem reads ``where:line: why``."""
    tree = ast.parse(source)
    torch_names = _torch_names(tree)
    seen, bad = 0, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "torch":
            for a in node.names:
                if a.name in FACTORIES | LEGACY:
                    bad.append(f"{where}:{node.lineno}: from torch import {a.name} (call it as "
                               f"torch.{a.name} with device= and dtype=)")
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id in torch_names):
            continue
        name = node.func.attr
        if name in LEGACY:
            bad.append(f"{where}:{node.lineno}: torch.{name}(...) is a legacy constructor "
                       "(default device)")
        elif name in FACTORIES | DEVICE_ONLY:
            seen += 1
            given = {k.arg for k in node.keywords}
            wanted = ("device",) if name in DEVICE_ONLY else ("device", "dtype")
            missing = [k for k in wanted if k not in given]
            if None in given:
                bad.append(f"{where}:{node.lineno}: torch.{name}(**...) may leave device or "
                           "dtype to the defaults: name both")
            elif missing:
                bad.append(f"{where}:{node.lineno}: torch.{name}(...) names no "
                           + " and no ".join(missing))
    return seen, bad


def test_every_factory_call_names_device_and_dtype():
    seen, bad = 0, []
    for path in sorted(PKG.rglob("*.py")):
        n, problems = scan(path.read_text(), str(path.relative_to(ROOT)))
        seen, bad = seen + n, bad + problems
    assert seen >= MIN_FACTORY_CALLS, f"the scan saw only {seen} factory calls in llcomm/"
    assert bad == [], "calls that take torch's default device or dtype:\n" + "\n".join(bad)


def test_the_scan_catches_what_it_is_for():
    where = "llcomm/ep/peer.py"
    peer = (ROOT / where).read_text()
    fixed = 'torch.zeros(2, dtype=torch.int64, device="cpu", pin_memory=True)'
    assert peer.count(fixed) == 1
    line = peer[:peer.index(fixed)].count("\n") + 1
    broken = peer.replace(fixed, "torch.zeros(2, dtype=torch.int64, pin_memory=True)")
    assert scan(broken, where)[1] == [f"{where}:{line}: torch.zeros(...) names no device"]
    assert scan(peer, where)[1] == []
    snippets = {
        "import torch as th\nth.arange(3, device='cpu')": ["x:2: torch.arange(...) names no "
                                                             "dtype"],
        "import torch\ntorch.randn(2)": ["x:2: torch.randn(...) names no device and no dtype"],
        "import torch\ntorch.full((2,), 1, **kw)": ["x:2: torch.full(**...) may leave device or "
                                                    "dtype to the defaults: name both"],
        "import torch\ntorch.LongTensor([1])": ["x:2: torch.LongTensor(...) is a legacy "
                                                "constructor (default device)"],
        "from torch import empty": ["x:1: from torch import empty (call it as torch.empty with "
                                    "device= and dtype=)"],
        "import torch\ntorch.Generator()": ["x:2: torch.Generator(...) names no device"],
        # inherited from the source tensor: fine
        "import torch\ntorch.zeros_like(x)\nx.new_empty(3)\ntorch.empty_like(x, device='cpu')": [],
    }
    for src, want in snippets.items():
        assert scan(src, "x")[1] == want, src


# -- the run-time check -----------------------------------------------------------------------
CPU = "cpu"
#: Small shapes (two CPU ranks share few cores): tokens, hidden (four FP8 groups of 128, one
#: int32 word of UE8M0 scales).
TOKENS, HIDDEN = 3, 512
#: EP: experts, max tokens per rank, top-k.
EXPERTS, MAX_TOKENS, TOPK = 4, 4, 2
SEED = 1234
#: Outputs ``_api_results`` returns (62 today): fewer means calls went missing.
MIN_OUTPUTS = 60


def _randn(g: torch.Generator, *shape: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape, generator=g, device=CPU, dtype=torch.float32).to(dtype)


def _filled(rows: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The received rows of each local expert (the rest of the buffer is never written)."""
    return torch.cat([rows[e, :int(c)] for e, c in enumerate(count.tolist())])


def _routing(g: torch.Generator, n: int):
    """``(topk_idx, topk_weights)``: distinct experts per token, one entry masked to -1."""
    scores = torch.rand(n, EXPERTS, generator=g, device=CPU, dtype=torch.float32)
    idx = scores.topk(TOPK, dim=1).indices
    idx[0, -1] = -1
    w = torch.rand(n, TOPK, generator=g, device=CPU, dtype=torch.float32) + 0.1
    return idx.contiguous(), w.contiguous()


def _tp_results(rank: int, ws: int, out: dict) -> None:
    import llcomm
    import llcomm.ops as ops
    from torch.library import opcheck

    mine = torch.Generator(device=CPU).manual_seed(SEED + rank)
    same = torch.Generator(device=CPU).manual_seed(SEED)       # the same on every rank
    comm = llcomm.Communicator(backend="reference", max_bytes=1 << 20)
    assert comm.device == torch.device(CPU)
    x = _randn(mine, TOKENS, HIDDEN)
    res, w = _randn(same, TOKENS, HIDDEN), _randn(same, HIDDEN) + 1
    scale = torch.full((), 0.01, device=CPU, dtype=torch.float32)
    out["all_reduce"] = comm.all_reduce(x)
    out["all_reduce fp32"] = comm.all_reduce(x.float())
    b = x.clone()
    out["broadcast"] = comm.broadcast(b, 1)
    out["all_gather"] = comm.all_gather(x)
    out["all_gather_2d"] = comm.all_gather_2d(x)
    out["reduce_scatter"] = comm.reduce_scatter(_randn(mine, ws * TOKENS, HIDDEN))
    out["residual_rmsnorm"] = comm.all_reduce_residual_rmsnorm(x, res, w, 1e-5)
    out["rmsnorm"] = comm.all_reduce_rmsnorm(x, w)
    out["fp8"] = comm.all_reduce_residual_rmsnorm_fp8(x, res, w, scale=scale)
    out["fp8_per_group"] = comm.all_reduce_residual_rmsnorm_fp8_per_group(x, res, w,
                                                                          round_scale=True)
    out["ops.all_reduce"] = ops.all_reduce(comm, x)
    out["ops.broadcast"] = ops.broadcast(comm, x.clone(), 0)
    out["ops.all_gather"] = ops.all_gather(comm, x)
    out["ops.all_gather_2d"] = ops.all_gather_2d(comm, x)
    out["ops.reduce_scatter"] = ops.reduce_scatter(comm, _randn(mine, ws * TOKENS, HIDDEN))
    out["ops.residual_rmsnorm"] = ops.all_reduce_residual_rmsnorm(comm, x, res, w, 1e-5)
    out["ops.rmsnorm"] = ops.all_reduce_rmsnorm(comm, x, w)
    out["ops.fp8"] = ops.all_reduce_residual_rmsnorm_fp8(comm, x, res, w, scale=scale)
    out["ops.fp8_per_group"] = ops.all_reduce_residual_rmsnorm_fp8_per_group(comm, x, res, w)
    # the fake implementations: each output's shape, dtype and device as the real op's
    L, c = torch.ops.llcomm, comm.op_handle
    for op, args in ((L.all_reduce, (c, x, "auto")), (L.all_gather, (c, x)),
                     (L.all_gather_2d, (c, x)), (L.reduce_scatter, (c, x[:2].contiguous())),
                     (L.all_reduce_residual_rmsnorm, (c, x, res, w, 1e-5, "auto")),
                     (L.all_reduce_rmsnorm, (c, x, w, 1e-5, "auto")),
                     (L.all_reduce_residual_rmsnorm_fp8, (c, x, res, w, 1e-5, scale, "auto")),
                     (L.all_reduce_residual_rmsnorm_fp8_per_group,
                      (c, x, res, w, 1e-5, False, "auto"))):
        opcheck(op.default, args, test_utils="test_faketensor")
    comm.close()


def _ep_results(rank: int, ws: int, out: dict) -> None:
    import llcomm
    import llcomm.ops as ops
    from llcomm.runtime.fp8_format import dequantize
    from torch.library import opcheck

    g = torch.Generator(device=CPU).manual_seed(SEED + 7 * rank)
    buf = llcomm.EPBuffer(num_experts=EXPERTS, hidden=HIDDEN,
                          num_max_dispatch_tokens_per_rank=MAX_TOKENS, backend="reference")
    assert buf.device == torch.device(CPU) and buf.dtype == torch.bfloat16
    x = _randn(g, MAX_TOKENS - 1, HIDDEN)
    idx, w = _routing(g, x.shape[0])
    rx, cnt, h = buf.dispatch(x, idx)
    out["ep dispatch"] = (_filled(rx, cnt), cnt.clone(), _filled(h.src_info, cnt))
    expert_out = rx * 2 - 1
    out["ep combine"] = buf.combine(expert_out, idx, w, h)
    rx2, cnt2, h2, hook = buf.dispatch(x, idx, return_recv_hook=True)
    hook()
    y2, chook = buf.combine(rx2 * 2 - 1, idx, w, h2, return_recv_hook=True)
    chook()
    out["ep hooks"] = (_filled(rx2, cnt2), cnt2.clone(), y2)
    (q, sc), cnt3, h3 = buf.dispatch(x, idx, use_fp8=True, round_scale=True)
    out["ep fp8 dispatch"] = (_filled(q, cnt3), _filled(sc, cnt3), cnt3.clone())
    out["ep fp8 combine"] = buf.combine(dequantize(q, sc, torch.bfloat16), idx, w, h3)
    (q4, sc4), cnt4, h4, hook = buf.dispatch(x, idx, use_fp8=True, return_recv_hook=True)
    hook()
    out["ep fp8 hook"] = (_filled(q4, cnt4), _filled(sc4, cnt4), cnt4.clone())
    orx, ocnt, ticket = ops.ep_dispatch(buf, x, idx)
    assert ticket.device == torch.device(CPU) and ticket.dtype == torch.int64
    out["ops.ep_dispatch"] = (_filled(orx, ocnt), ocnt, _filled(ops.ep_src_info(buf, ticket),
                                                                ocnt))
    out["ops.ep_combine"] = ops.ep_combine(buf, orx * 2 - 1, idx, w, ticket)
    (oq, osc), ocnt8, ticket8 = ops.ep_dispatch(buf, x, idx, use_fp8=True)
    out["ops.ep_dispatch fp8"] = (_filled(oq, ocnt8), _filled(osc, ocnt8), ocnt8)
    L, b = torch.ops.llcomm, buf.op_handle
    opcheck(L.ep_dispatch.default, (b, x, idx), test_utils="test_faketensor")
    opcheck(L.ep_dispatch_fp8.default, (b, x, idx, False), test_utils="test_faketensor")
    orx, _, ticket = L.ep_dispatch(b, x, idx)
    opcheck(L.ep_combine.default, (b, orx, idx, w, ticket), test_utils="test_faketensor")
    opcheck(L.ep_src_info.default, (b, ticket), test_utils="test_faketensor")
    buf.close()


def _deep_ep_results(rank: int, ws: int, out: dict) -> None:
    import llcomm.deep_ep as deep_ep

    g = torch.Generator(device=CPU).manual_seed(SEED + 11 * rank)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN, ws, EXPERTS)
    buf = deep_ep.Buffer(None, num_rdma_bytes=hint, low_latency_mode=True,
                         num_qps_per_rank=EXPERTS // ws, backend="reference")
    stats = torch.zeros(EXPERTS // ws, device=CPU, dtype=torch.int32)
    x = _randn(g, MAX_TOKENS, HIDDEN)
    idx, w = _routing(g, x.shape[0])
    for fp8, hooked in ((False, False), (True, True), (True, False)):
        tag = f"deep_ep fp8={fp8} hook={hooked}"
        rx, cnt, handle, _, hook = buf.low_latency_dispatch(
            x, idx, MAX_TOKENS, EXPERTS, cumulative_local_expert_recv_stats=stats,
            use_fp8=fp8, round_scale=fp8, use_ue8m0=fp8, return_recv_hook=hooked)
        if hooked:
            hook()
        if fp8:
            q, scales = rx
            out[f"{tag} dispatch"] = (_filled(q, cnt), _filled(scales, cnt), cnt.clone())
            rows = q.to(torch.bfloat16)
        else:
            out[f"{tag} dispatch"] = (_filled(rx, cnt), cnt.clone())
            rows = rx
        expert_out = rows * 2 - 1
        y, _, hook = buf.low_latency_combine(expert_out, idx, w, handle,
                                             return_recv_hook=hooked)
        if hooked:
            hook()
        out[f"{tag} combine"] = y
    out["deep_ep stats"] = stats.clone()
    buf.destroy()


def _api_results(rank: int, ws: int) -> dict:
    """Every public call on CPU tensors that name their device and dtype: name -> output(s)."""
    out = {}
    _tp_results(rank, ws, out)
    _ep_results(rank, ws, out)
    _deep_ep_results(rank, ws, out)
    return out


def _flat(out: dict) -> dict[str, torch.Tensor]:
    flat = {}
    for name, v in out.items():
        parts = v if isinstance(v, (tuple, list)) else (v,)
        for i, t in enumerate(parts):
            flat[f"{name}[{i}]" if len(parts) > 1 else name] = t
    return flat


def _under_defaults_body(rank: int, ws: int) -> list[str]:
    # llcomm is already imported here (the process launcher is llcomm.multiproc): what its import
    # allocates is checked by test_import_under_default_device_meta_and_bf16
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("meta")
    try:
        got = _flat(_api_results(rank, ws))
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)
    assert torch.empty(1).device.type == CPU and torch.empty(1).dtype == torch.float32
    want = _flat(_api_results(rank, ws))
    fails = []
    assert got.keys() == want.keys() and len(want) >= MIN_OUTPUTS, len(want)
    for name, w in want.items():
        t = got[name]
        if not isinstance(t, torch.Tensor) or t.device != torch.device(CPU):
            fails.append(f"rank {rank}: {name}: got {getattr(t, 'device', type(t).__name__)}")
        elif (t.dtype, t.shape) != (w.dtype, w.shape):
            fails.append(f"rank {rank}: {name}: {t.dtype} {tuple(t.shape)}, expected "
                         f"{w.dtype} {tuple(w.shape)}")
        elif not torch.equal(t.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)):
            fails.append(f"rank {rank}: {name}: other bits than under torch's own defaults")
    return fails


def test_public_api_under_default_device_meta_and_bf16():
    fails = [f for r in run_distributed(_under_defaults_body, 2) for f in r]
    assert not fails, "\n".join(fails)


#: Imports every llcomm module under a meta default device and bf16, then names each module-level
#: tensor that took a default (meta, where llcomm's own tensors live on the CPU or a GPU).
_IMPORT_PROBE = """
import importlib, pkgutil, torch
torch.set_default_device("meta")
torch.set_default_dtype(torch.bfloat16)
import llcomm
bad, n = [], 0
for m in pkgutil.walk_packages(llcomm.__path__, "llcomm."):
    mod = importlib.import_module(m.name)
    for name, v in vars(mod).items():
        if isinstance(v, torch.Tensor):
            n += 1
            if v.device.type == "meta":
                bad.append(m.name + "." + name)
print("modules checked; module-level tensors:", n)
assert not bad, bad
"""


def test_import_under_default_device_meta_and_bf16():
    """Importing llcomm under a default device and dtype that are not torch's allocates nothing
    on them (an engine may set both before it imports llcomm)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "modules checked" in r.stdout

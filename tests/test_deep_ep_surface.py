"""``llcomm.deep_ep`` beyond the low-latency calls, on the reference backend (gloo, CPU; the
bodies take a device and a backend, and tests/test_deep_ep_gpu.py runs them on the peer one):

- the local buffer (``get_local_buffer_tensor``): a view of the zero-copy combine's memory, not
  a copy; zeroed between two rounds (an engine's reset after a fault), the next rounds still
  match the oracle, and what is written through it is what the zero-copy combine reads;
- ``topk_idx`` in int32 (DeepEP builds with 32-bit top-k indices) gives bitwise the results
  of int64, in every format, with and without hooks;
- ``comm=`` (an mpi4py communicator; a stand-in object here, mpi4py is not needed): the world
  group where it names the world, errors naming ``comm`` and ``group=`` where not;
- ``get_comm_stream``, ``set_num_sms``, ``deep_ep.utils`` and the events;
- every public name of DeepEP's ``Buffer`` and ``Config`` exists here, and either works or
  raises NotImplementedError naming itself and docs/deep_ep.md.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from _deep_ep_case import (VARIANTS, Quant, case, check_combine, check_dispatch,
                           combine_oracle, expert_outputs)
from _dist import run_distributed
from test_deep_ep import H, K, L, T, _round
from test_ep_reference import _expect  # a call must raise exc naming words

ROOT = Path(__file__).resolve().parents[1]

#: DeepEP's ``Buffer``: its public methods and static methods (its legacy buffer module at
#: DeepEP dd758ca; the buffer module before DeepEP 2 has the same ones), and its documented
#: attributes.
DEEPEP_BUFFER = (
    "destroy", "is_sm90_compiled", "set_num_sms", "capture", "get_low_latency_rdma_size_hint",
    "get_comm_stream", "get_local_buffer_tensor", "get_dispatch_config", "get_combine_config",
    "get_dispatch_layout", "dispatch", "combine", "internode_dispatch", "internode_combine",
    "clean_low_latency_buffer", "low_latency_dispatch", "low_latency_combine",
    "low_latency_update_mask_buffer", "low_latency_query_mask_buffer",
    "low_latency_clean_mask_buffer", "get_next_low_latency_combine_buffer")
DEEPEP_BUFFER_ATTRS = ("num_sms", "rank", "group", "group_size", "num_nvl_bytes",
                       "num_rdma_bytes", "low_latency_mode", "explicitly_destroy",
                       "enable_shrink")
#: DeepEP's ``Config``: its constructor and methods.
DEEPEP_CONFIG = ("__init__", "get_nvl_buffer_size_hint", "get_rdma_buffer_size_hint")
#: The names that raise NotImplementedError (none: the normal mode works too,
#: tests/test_deep_ep_normal.py checks its results).
NOT_IMPLEMENTED: set[str] = set()
DOC_SECTION = "## DeepEP's names"


class FakeComm:
    """What ``Buffer`` reads of an ``mpi4py.MPI.Comm``."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size


# -- the local buffer ---------------------------------------------------------------------------
def _local_body(rank, W, device="cpu", backend="auto"):
    import llcomm.deep_ep as deep_ep
    E, quant, fails = L * W, Quant(), []
    buf = deep_ep.Buffer(None, backend=backend)
    for rdma in (True, False):                  # nothing yet / no NVLink buffer: empty, as DeepEP
        if buf.get_local_buffer_tensor(torch.int8, use_rdma_buffer=rdma).numel():
            fails.append(f"use_rdma_buffer={rdma}: not empty before the first call")
    stats = torch.zeros(L, dtype=torch.int32, device=device)
    fails += _round(buf, rank, W, 300, VARIANTS[0], False, stats, quant, device)[0]
    stream = buf.get_comm_stream()              # no stream of its own: the current one
    if stream != (torch.cuda.current_stream() if device != "cpu" else None):
        fails.append(f"get_comm_stream() is {stream}")
    local = buf.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True)
    slot_bytes = L * W * T * H * 2                            # bf16 combine input per slot
    slots = buf.ep_buffer.handle_slots                        # 4: two sends in flight
    if (local.dtype, local.numel(), local.device.type) != (torch.int8, slots * slot_bytes,
                                                           torch.device(device).type):
        fails.append(f"local buffer {local.dtype} [{local.numel()}] on {local.device}")

    # round 2: its dispatch, then the engine's reset, then a zero-copy combine written through
    # a typed view of the local buffer at its byte offset
    inputs = case(W, E, T, H, K, 301)
    x, idx, w = (t.to(device) for t in inputs[rank])
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    more, rows_in = check_dispatch("[local round 2]", rank, inputs, recv_x, recv_count, handle,
                                   VARIANTS[0], quant, 301, W, E, T, H)
    if more:
        return fails + more
    combine_in = buf.get_next_low_latency_combine_buffer(handle)
    combine_in.fill_(1.0)
    local.zero_()                                            # what engines do after a fault
    if combine_in.count_nonzero().item():
        fails.append("zeroing get_local_buffer_tensor did not clear the combine buffer: "
                     "it returned a copy, not a view")
    slot = handle.ep_handle.index % slots
    typed = buf.get_local_buffer_tensor(torch.bfloat16, torch.Size((L, W * T, H)),
                                        offset=slot * slot_bytes, use_rdma_buffer=True)
    if typed.data_ptr() != combine_in.data_ptr() or typed.shape != combine_in.shape:
        fails.append("the local buffer at the slot's offset is not the combine buffer")
    typed.copy_(expert_outputs(rows_in, rank, L, W, T, H, torch.bfloat16, device))
    y, _, _ = buf.low_latency_combine(torch.full_like(typed, float("nan")), idx, w, handle,
                                      zero_copy=True)
    fails += check_combine("[local round 2, written through the local buffer]", y,
                           *combine_oracle(inputs, rank, VARIANTS[0], quant, 301, E,
                                           torch.bfloat16))
    # zeroed again, in every dtype DeepEP's callers use: later rounds still match the oracle
    for dtype in (torch.int8, torch.int32, torch.bfloat16):
        buf.get_local_buffer_tensor(dtype, use_rdma_buffer=True).zero_()
    for seed, variant in zip(range(310, 320), VARIANTS):
        for hook_on in (False, True):
            fails += _round(buf, rank, W, seed, variant, hook_on, stats, quant, device)[0]
    buf.destroy()
    return fails


def test_local_buffer_zeroed_between_rounds():
    fails = [f for r in run_distributed(_local_body, 2) for f in r]
    assert not fails, "\n".join(fails[:20])


def _local_args_body(rank, W):
    import llcomm.deep_ep as deep_ep
    from llcomm.errors import CommClosedError
    errors = []
    buf = deep_ep.Buffer(None)
    buf.clean_low_latency_buffer(T, H, L * W)
    get = buf.get_local_buffer_tensor
    total = get(torch.uint8, use_rdma_buffer=True).numel()
    whole = get(torch.float32, offset=16, use_rdma_buffer=True)
    if whole.numel() != (total - 16) // 4:
        errors.append(f"float32 from byte 16: {whole.numel()} elements of {total} bytes")
    for what, exc, words, call in (
            ("dtype", TypeError, ["dtype='int8'"], lambda: get("int8", use_rdma_buffer=True)),
            ("offset type", TypeError, ["offset=1.0"],
             lambda: get(torch.int8, offset=1.0, use_rdma_buffer=True)),
            ("offset misaligned", ValueError, ["offset=2", "4 bytes"],
             lambda: get(torch.int32, offset=2, use_rdma_buffer=True)),
            ("offset past the end", ValueError, [f"offset={total + 4}"],
             lambda: get(torch.int8, offset=total + 4, use_rdma_buffer=True)),
            ("size too large", ValueError, ["size=", f"{total}"],
             lambda: get(torch.int8, (total + 1,), use_rdma_buffer=True)),
            ("size type", TypeError, ["size="], lambda: get(torch.int8, 3, use_rdma_buffer=True)),
            ("flag type", TypeError, ["use_rdma_buffer=1"], lambda: get(torch.int8, None, 0, 1)),
            ("NVLink buffer", NotImplementedError, ["use_rdma_buffer=False", "num_nvl_bytes"],
             lambda: deep_ep.Buffer(None, num_nvl_bytes=1 << 20).get_local_buffer_tensor(
                 torch.int8))):
        _expect(errors, what, exc, words, call)
    buf.destroy()
    _expect(errors, "after destroy", CommClosedError, ["closed"],
            lambda: get(torch.int8, use_rdma_buffer=True))
    return errors


def test_local_buffer_arguments():
    errors = [e for r in run_distributed(_local_args_body, 2) for e in r]
    assert not errors, "\n".join(errors)


# -- int32 top-k indices ------------------------------------------------------------------------
def _valid(recv_x, recv_count, handle, fp8):
    """What a dispatch defines: its rows up to recv_count, the counts and layout ranges (CPU)."""
    counts = recv_count.cpu().tolist()
    q, sc = recv_x if fp8 else (recv_x, None)
    out = [recv_count.cpu(), handle[1].cpu()]
    for e, c in enumerate(counts):
        out += [q[e, :c].cpu().view(torch.uint8), handle[0][e, :c].cpu()]
        if sc is not None:
            out.append(sc[e, :c].cpu())
    return out


def _topk_int32_body(rank, W, device="cpu", backend="auto"):
    import llcomm.deep_ep as deep_ep
    E, fails = L * W, []
    quant = Quant()
    buf = deep_ep.Buffer(None, backend=backend)
    for seed, variant in zip(range(400, 410), VARIANTS):
        inputs = case(W, E, T, H, K, seed)
        x, idx, w = (t.to(device) for t in inputs[rank])
        for hook_on in (False, True):
            seen = []
            for dtype in (torch.int64, torch.int32):
                tag = f"[topk_idx {dtype} {variant} hook={hook_on}]"
                i = idx.to(dtype)
                recv_x, recv_count, handle, _, hook = buf.low_latency_dispatch(
                    x, i, T, E, use_fp8=variant[0], round_scale=variant[1],
                    use_ue8m0=variant[2], return_recv_hook=hook_on)
                if hook_on:
                    hook()
                more, rows_in = check_dispatch(tag, rank, inputs, recv_x, recv_count, handle,
                                               variant, quant, seed, W, E, T, H)
                if more:
                    return fails + more
                eo = expert_outputs(rows_in, rank, L, W, T, H, torch.bfloat16, device)
                y, _, hook = buf.low_latency_combine(eo, i, w, handle, return_recv_hook=hook_on)
                if hook_on:
                    hook()
                fails += check_combine(tag, y, *combine_oracle(inputs, rank, variant, quant,
                                                               seed, E, torch.bfloat16))
                seen.append(_valid(recv_x, recv_count, handle, variant[0]) + [y.cpu()])
            if any(not torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                                   b.view(torch.uint8) if b.dtype == torch.bfloat16 else b)
                   for a, b in zip(*seen)):
                fails.append(f"[{variant} hook={hook_on}] int32 topk_idx differs from int64")
    inputs = case(W, E, T, H, K, 3)
    x, idx, w = (t.to(device) for t in inputs[rank])
    errors = []
    _expect(errors, "int16 dispatch", TypeError, ["topk_idx", "torch.int16", "torch.int32"],
            lambda: buf.low_latency_dispatch(x, idx.to(torch.int16), T, E))
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx.to(torch.int32), T, E,
                                                       use_fp8=False)
    _expect(errors, "int16 combine", TypeError, ["topk_idx", "torch.int16"],
            lambda: buf.low_latency_combine(recv_x, idx.to(torch.int16), w, handle))
    buf.low_latency_combine(recv_x, idx.to(torch.int32), w, handle)    # still usable
    buf.destroy()
    return fails + errors


def test_topk_int32_matches_int64():
    fails = [f for r in run_distributed(_topk_int32_body, 2) for f in r]
    assert not fails, "\n".join(fails[:20])


def test_int64_topk_is_not_copied():
    from llcomm.deep_ep.checks import topk_int64
    idx = torch.zeros(3, 2, dtype=torch.int64)
    assert topk_int64(idx) is idx
    assert topk_int64(idx.int()).dtype == torch.int64


# -- comm= --------------------------------------------------------------------------------------
def _comm_body(rank, W):
    import torch.distributed as dist

    import llcomm.deep_ep as deep_ep
    errors = []
    B = deep_ep.Buffer
    buf = B(None, comm=FakeComm(rank, W))                   # TensorRT-LLM's form
    if buf.group is not dist.group.WORLD or (buf.rank, buf.group_size) != (rank, W):
        errors.append(f"comm of the world: group {buf.group}, rank {buf.rank}")
    inputs = case(W, L * W, T, H, K, 6)
    x, idx, w = inputs[rank]
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, L * W, use_fp8=False)
    buf.low_latency_combine(recv_x, idx, w, handle)
    buf.destroy()
    for what, comm in (("other rank numbers", FakeComm((rank + 1) % W, W)),
                       ("another size", FakeComm(rank, W + 1))):
        _expect(errors, what, ValueError, ["comm=", "group="], lambda comm=comm: B(None, comm=comm))
    if B(dist.group.WORLD, comm=object()).group is not dist.group.WORLD:   # group wins, as DeepEP
        errors.append("group= and comm=: the group was not used")
    return errors


def test_comm_maps_to_the_world_group():
    errors = [e for r in run_distributed(_comm_body, 2) for e in r]
    assert not errors, "\n".join(errors)


def test_comm_without_torch_distributed(monkeypatch):
    import torch.distributed as dist

    import llcomm.deep_ep as deep_ep
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"comm=.*init_process_group.*group="):
        deep_ep.Buffer(None, comm=FakeComm(0, 1))


# -- streams, SMs, events -----------------------------------------------------------------------
def test_num_sms_and_events():
    import llcomm.deep_ep as deep_ep
    from llcomm.deep_ep.utils import EventHandle, EventOverlap
    from llcomm.deep_ep.utils.event import EventOverlap as V2EventOverlap
    B = deep_ep.Buffer
    assert EventOverlap is deep_ep.EventOverlap is V2EventOverlap
    assert EventHandle is deep_ep.EventHandle
    before = B.num_sms
    try:
        B.set_num_sms(24)
        assert B.num_sms == 24
    finally:
        B.set_num_sms(before)
    for bad, exc in ((True, TypeError), (2.0, TypeError), (0, ValueError), (-2, ValueError)):
        with pytest.raises(exc, match="new_num_sms"):
            B.set_num_sms(bad)
    assert B.is_sm90_compiled() is True
    handle = EventHandle()                         # on CPU: complete, nothing to wait for
    assert (handle.event is not None) == torch.cuda.is_available()
    handle.current_stream_wait()
    ran = []
    event = EventOverlap(handle, (torch.zeros(1),))
    event.register_hook_after_wait(lambda: ran.append(1))
    with pytest.raises(ValueError, match="already registered"):
        event.register_hook_after_wait(lambda: None)
    with pytest.raises(TypeError, match="not callable"):
        EventOverlap().register_hook_after_wait(3)
    with event(release_handle=True):
        pass
    assert ran == [1] and event.event is None and event.extra_tensors is not None
    event.current_stream_wait()                    # the hook ran once
    assert ran == [1]


def _stream_body(rank, W):
    import llcomm.deep_ep as deep_ep
    buf = deep_ep.Buffer(None)
    streams = [buf.get_comm_stream()]
    buf.clean_low_latency_buffer(T, H, L * W)
    streams.append(buf.get_comm_stream())
    buf.destroy()
    return [] if streams == [None, None] else [f"get_comm_stream on CPU: {streams}"]


def test_comm_stream_on_cpu_is_none():
    errors = [e for r in run_distributed(_stream_body, 2) for e in r]
    assert not errors, "\n".join(errors)


# -- DeepEP's names -----------------------------------------------------------------------------
def _names_body(rank, W):
    import llcomm.deep_ep as deep_ep
    B, E, errors = deep_ep.Buffer, L * W, []
    buf = B(None)
    inputs = case(W, E, T, H, K, 6)
    x, idx, w = inputs[rank]
    early = B(None)
    early.enable_shrink = True      # the masks' path before the EPBuffer exists (gloo: no masks)
    state = {}

    def dispatch():
        state["d"] = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)

    works = {
        "destroy": lambda: B(None).destroy(),
        "is_sm90_compiled": B.is_sm90_compiled,
        "set_num_sms": lambda: B.set_num_sms(B.num_sms),
        "capture": B.capture,
        "get_low_latency_rdma_size_hint": lambda: B.get_low_latency_rdma_size_hint(T, H, W, E),
        "get_comm_stream": buf.get_comm_stream,
        "clean_low_latency_buffer": lambda: buf.clean_low_latency_buffer(T, H, E),
        "get_local_buffer_tensor": lambda: buf.get_local_buffer_tensor(torch.int8,
                                                                        use_rdma_buffer=True),
        "low_latency_dispatch": dispatch,
        "get_next_low_latency_combine_buffer": lambda: buf.get_next_low_latency_combine_buffer(
            state["d"][2]),
        "low_latency_combine": lambda: buf.low_latency_combine(state["d"][0], idx, w,
                                                               state["d"][2]),
        "low_latency_update_mask_buffer": lambda: early.low_latency_update_mask_buffer(0, True),
        "low_latency_query_mask_buffer": lambda: early.low_latency_query_mask_buffer(
            torch.zeros(W, dtype=torch.int32)),
        "low_latency_clean_mask_buffer": early.low_latency_clean_mask_buffer,
        "get_dispatch_config": lambda: B.get_dispatch_config(W),
        "get_combine_config": lambda: B.get_combine_config(W),
        "get_dispatch_layout": lambda: state.update(lay=buf.get_dispatch_layout(idx, E)),
        "dispatch": lambda: state.update(nd=buf.dispatch(
            x, num_tokens_per_rank=state["lay"][0], is_token_in_rank=state["lay"][3],
            num_tokens_per_expert=state["lay"][2], topk_idx=idx, topk_weights=w)),
        "combine": lambda: buf.combine(state["nd"][0], state["nd"][4]),
        "internode_dispatch": lambda: buf.internode_dispatch(x, handle=state["nd"][4]),
        "internode_combine": lambda: buf.internode_combine(state["nd"][0], state["nd"][4]),
    }
    for name in DEEPEP_BUFFER:
        if not callable(getattr(B, name, None)):
            errors.append(f"Buffer.{name} is missing")
        elif name in NOT_IMPLEMENTED:
            _expect(errors, name, NotImplementedError, [f"Buffer.{name}", "docs/deep_ep.md"],
                    lambda name=name: getattr(buf, name)(W))
        else:
            try:
                works[name]()
            except Exception as e:  # noqa: BLE001  (the finding, recorded)
                errors.append(f"Buffer.{name} raised {type(e).__name__}: {e}")
    errors += [f"Buffer().{a} is missing" for a in DEEPEP_BUFFER_ATTRS if not hasattr(buf, a)]
    config = deep_ep.Config(20, 6, 256, 6, 128)
    for name in DEEPEP_CONFIG[1:]:
        if getattr(config, name)(7168 * 2, W) != 0:
            errors.append(f"Config.{name} is not 0 (llcomm's normal mode keeps no buffer)")
    _expect(errors, "Config(send >= recv)", ValueError, ["num_max_nvl_chunked_send_tokens"],
            lambda: deep_ep.Config(20, 256, 256))
    buf.destroy()
    return errors


def test_every_deepep_name_works_or_says_not_implemented():
    errors = [e for r in run_distributed(_names_body, 2) for e in r]
    assert not errors, "\n".join(errors)


def test_docs_list_every_deepep_name():
    """docs/deep_ep.md's table names each of DeepEP's names with its status."""
    text = (ROOT / "docs" / "deep_ep.md").read_text()
    section = text.split(DOC_SECTION, 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w.]+)`[^|]*\| ([^|]+)\|",
                                                        section, re.M)}
    for name in DEEPEP_BUFFER + tuple(f"Config.{n}" for n in DEEPEP_CONFIG[1:]) + ("Config",):
        assert name in rows, f"docs/deep_ep.md, {DOC_SECTION!r}, does not list {name}"
        raises = name in NOT_IMPLEMENTED
        assert rows[name].strip() == ("NotImplementedError" if raises else "works"), \
            (name, rows[name])

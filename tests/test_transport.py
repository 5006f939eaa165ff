"""Which remote transport NVSHMEM will use (``llcomm/ep/hosts/transport.py``), on fake /sys and
/proc trees: facts read from files, the verdict, the line for ``backend_reason`` and the
``llcomm doctor`` section. No GPU, no NVSHMEM start."""
import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llcomm.ep.hosts import transport as T

IB, ROCE = "InfiniBand", "Ethernet"
MLX5 = "mlx5_core"
#: an open-module driver's version line, as /proc/driver/nvidia/version starts
OPEN_DRIVER = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build"
PROPRIETARY_DRIVER = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Release Build"
ALL_PLUGINS = ("ibrc", "ibgda", "ucx", "libfabric")
#: Seconds one run of tools/shmem_check.py may take before it refuses.
TOOL_TIMEOUT_S = 120


def fake_machine(root, ports=(), modules=(), kernel="6.8.0-45-generic", driver=None,
                 gdrapi=False, plugins=ALL_PLUGINS):
    """A filesystem root with RDMA ports ``(device, port, state, link_layer, driver)``, loaded
    ``modules``, a kernel release, the NVIDIA driver's version line, and an NVSHMEM lib folder
    with ``plugins``; returns (root, nvshmem) for ``gather``."""
    for dev, port, state, link, drv in ports:
        d = root / T.SYS_INFINIBAND / dev
        p = d / "ports" / str(port)
        p.mkdir(parents=True)
        (p / "state").write_text(f"{ {'ACTIVE': 4, 'DOWN': 1}.get(state, 2) }: {state}\n")
        (p / "link_layer").write_text(link + "\n")
        target = root / "sys/bus/pci/drivers" / drv
        target.mkdir(parents=True, exist_ok=True)
        (d / "device").mkdir(exist_ok=True)
        if not (d / "device" / "driver").exists():
            os.symlink(target, d / "device" / "driver")
    proc = root / "proc"
    (proc / "sys/kernel").mkdir(parents=True)
    (proc / "modules").write_text("".join(f"{m} 16384 0 - Live 0x0\n" for m in modules))
    (proc / "sys/kernel/osrelease").write_text(kernel + "\n")
    if driver is not None:
        (proc / "driver/nvidia").mkdir(parents=True)
        (proc / "driver/nvidia/version").write_text(driver + "\n")
    if gdrapi:
        lib = root / T.GDRAPI_DIRS[0]
        lib.mkdir(parents=True)
        (lib / "libgdrapi.so.2").write_text("")
    lib = root / "site-packages" / T.NVSHMEM_LIB
    lib.mkdir(parents=True)
    for name in plugins:
        (lib / f"nvshmem_transport_{name}.so.3").write_text("")
    return root, ("nvidia-nvshmem-cu12 3.3.20", lib)


def facts_of(tmp_path, env=None, machine="x86_64", **kw):
    root, nvshmem = fake_machine(tmp_path, **kw)
    facts = T.gather(root, env or {}, nvshmem=nvshmem)
    return dataclasses.replace(facts, machine=machine)


IB_PORT = ("mlx5_0", 1, "ACTIVE", IB, MLX5)
PEERMEM = ("nvidia", "nvidia_peermem", "mlx5_ib")


def test_gather_reads_ports_modules_and_settings(tmp_path):
    env = {"NVSHMEM_IB_ENABLE_IBGDA": "1", "NVSHMEM_SYMMETRIC_SIZE": "1G"}
    f = facts_of(tmp_path, env, ports=[IB_PORT, ("mlx5_1", 1, "DOWN", ROCE, MLX5)],
                 modules=PEERMEM + ("gdrdrv",), driver=PROPRIETARY_DRIVER, gdrapi=True,
                 plugins=("ibrc", "ibgda"))
    assert f.ports == (T.RdmaPort("mlx5_0", 1, "ACTIVE", IB, MLX5),
                       T.RdmaPort("mlx5_1", 1, "DOWN", ROCE, MLX5))
    assert f.ports[1].fabric == "RoCE" and not f.ports[1].active
    assert f.nvshmem == "nvidia-nvshmem-cu12 3.3.20" and f.plugins == ("ibrc", "ibgda")
    assert f.peermem == "nvidia_peermem" and f.gpudirect is True
    assert f.open_module is False and f.dmabuf is False
    assert f.gdrdrv and f.gdrapi.endswith("libgdrapi.so.2") and f.gdrcopy
    assert f.settings == (("NVSHMEM_IB_ENABLE_IBGDA", "1"),)     # only transport settings


def test_ibgda_when_enabled_on_mlx5_with_peermem(tmp_path):
    f = facts_of(tmp_path, {"NVSHMEM_IB_ENABLE_IBGDA": "1"}, ports=[IB_PORT], modules=PEERMEM)
    v = T.predict(f)
    assert v.transport == T.IBGDA and v.port.name == "mlx5_0:1"
    assert not v.needs_consistency_step
    assert T.verdict_line(v, f) == "remote transport: IBGDA over mlx5_0:1 (InfiniBand, ACTIVE)"


def test_ibrc_by_default_with_the_consistency_step_and_ibgda_advice(tmp_path):
    f = facts_of(tmp_path, ports=[IB_PORT], modules=PEERMEM)
    v = T.predict(f)
    assert v.transport == T.IBRC and v.port.name == "mlx5_0:1"
    assert v.needs_consistency_step
    assert T.verdict_line(v, f) == ("remote transport: IBRC proxy over mlx5_0:1 (InfiniBand, "
                                    "ACTIVE); GDRCopy no: waits run NVSHMEM's consistency step")
    assert any(a.startswith("NVSHMEM_IB_ENABLE_IBGDA=1") for a in v.advice)
    assert any("GDRCopy" in a for a in v.advice)


def test_gdrcopy_removes_the_consistency_step_on_x86_only(tmp_path):
    f = facts_of(tmp_path, ports=[IB_PORT], modules=PEERMEM + ("gdrdrv",), gdrapi=True)
    v = T.predict(f)
    assert v.transport == T.IBRC and not v.needs_consistency_step
    assert T.verdict_line(v, f).endswith("; GDRCopy yes: no consistency step")
    off = dataclasses.replace(f, settings=(("NVSHMEM_DISABLE_GDRCOPY", "1"),))
    assert T.predict(off).needs_consistency_step
    assert T.predict(dataclasses.replace(f, machine="aarch64")).needs_consistency_step


def test_roce_port_runs_ibrc_and_names_the_gid_settings(tmp_path):
    f = facts_of(tmp_path, ports=[("mlx5_2", 1, "ACTIVE", ROCE, MLX5)], modules=PEERMEM)
    v = T.predict(f)
    assert v.transport == T.IBRC and str(v.port) == "mlx5_2:1 (RoCE, ACTIVE)"
    assert any("NVSHMEM_IB_GID_INDEX" in a for a in v.advice)
    gid = dataclasses.replace(f, settings=(("NVSHMEM_IB_GID_INDEX", "3"),))
    assert not any("NVSHMEM_IB_GID_INDEX" in a for a in T.predict(gid).advice)


def test_down_port_means_peer_only(tmp_path):
    f = facts_of(tmp_path, {"NVSHMEM_IB_ENABLE_IBGDA": "1"},
                 ports=[("mlx5_0", 1, "DOWN", IB, MLX5)], modules=PEERMEM)
    v = T.predict(f)
    assert v.transport == T.NONE and v.port is None
    assert any("no active RDMA port" in r and "DOWN" in r for r in v.reasons)
    assert "out of reach" in T.verdict_line(v, f)


def test_no_devices_means_peer_only(tmp_path):
    f = facts_of(tmp_path, modules=PEERMEM)
    v = T.predict(f)
    assert f.ports == () and v.transport == T.NONE and not v.needs_consistency_step
    assert any("no RDMA device" in r for r in v.reasons)


def test_remote_transport_setting_chooses_ucx_libfabric_none(tmp_path):
    f = facts_of(tmp_path, ports=[IB_PORT], modules=PEERMEM)
    for value, name in (("ucx", T.UCX), ("UCX", T.UCX), ("libfabric", T.LIBFABRIC),
                        ("none", T.NONE), ("bogus", T.NONE)):
        v = T.predict(dataclasses.replace(f, settings=(("NVSHMEM_REMOTE_TRANSPORT", value),)))
        assert v.transport == name, value
        assert not v.needs_consistency_step
        if value == "none":
            assert v.port is None and v.reasons == ("NVSHMEM_REMOTE_TRANSPORT=none",)
        elif value == "bogus":
            assert v.port is None and "names no transport" in v.reasons[0]
        else:
            assert v.reasons[0] == f"NVSHMEM_REMOTE_TRANSPORT={value.lower()}"


def test_ibgda_needs_mlx5_and_gpudirect(tmp_path):
    on = {"NVSHMEM_IB_ENABLE_IBGDA": "1"}
    # no peermem, an old kernel: no GPUDirect RDMA at all
    f = facts_of(tmp_path / "a", on, ports=[IB_PORT], kernel="5.4.0", driver=OPEN_DRIVER)
    v = T.predict(f)
    assert f.gpudirect is False and v.transport == T.IBRC
    assert any("IBGDA does not start" in r for r in v.reasons)
    assert any("nvidia_peermem" in a for a in v.advice)
    # dma-buf: a new kernel and the open module stand in for peermem
    f = facts_of(tmp_path / "b", on, ports=[IB_PORT], kernel="6.8.0", driver=OPEN_DRIVER)
    assert f.dmabuf is True and T.predict(f).transport == T.IBGDA
    # a RoCE NIC of another vendor: IB verbs, not IBGDA
    f = facts_of(tmp_path / "c", on, ports=[("bnxt_re0", 1, "ACTIVE", ROCE, "bnxt_en")],
                 modules=PEERMEM)
    assert T.predict(f).transport == T.IBRC
    # the wheel without its IBGDA plugin
    f = facts_of(tmp_path / "d", on, ports=[IB_PORT], modules=PEERMEM, plugins=("ibrc",))
    assert T.predict(f).transport == T.IBRC


def test_hca_list_selects_and_excludes_ports(tmp_path):
    f = facts_of(tmp_path, ports=[("mlx5_0", 1, "DOWN", IB, MLX5), ("mlx5_1", 1, "ACTIVE", IB,
                                                                      MLX5)], modules=PEERMEM)
    pick = dataclasses.replace(f, settings=(("NVSHMEM_HCA_LIST", "mlx5_0:1"),))
    assert T.predict(pick).transport == T.NONE
    skip = dataclasses.replace(f, settings=(("NVSHMEM_HCA_LIST", "^mlx5_0"),
                                            ("NVSHMEM_ENABLE_NIC_PE_MAPPING", "1")))
    v = T.predict(skip)
    assert v.transport == T.IBRC and v.port.name == "mlx5_1:1"
    assert not any("NVSHMEM_ENABLE_NIC_PE_MAPPING" in a for a in v.advice)


def test_efa_like_device_advises_libfabric(tmp_path):
    f = facts_of(tmp_path, ports=[("efa_0", 1, "ACTIVE", "Unspecified", "efa")])
    v = T.predict(f)
    assert v.transport == T.NONE
    assert any("NVSHMEM_REMOTE_TRANSPORT=libfabric" in a for a in v.advice)


def test_without_nvshmem(tmp_path):
    root, _ = fake_machine(tmp_path, ports=[IB_PORT], modules=PEERMEM)
    f = T.gather(root, {}, nvshmem=None)
    v = T.predict(f)
    assert f.nvshmem is None and f.plugins == () and v.transport == T.NOT_FOUND
    text = "\n".join(T.report_lines(f))
    assert "NVSHMEM: not installed" in text and "mlx5_0:1 (InfiniBand, ACTIVE) mlx5_core" in text


def test_report_lines_give_facts_verdict_and_advice(tmp_path):
    f = facts_of(tmp_path, {"NVSHMEM_DISABLE_P2P": "1"}, ports=[IB_PORT], modules=PEERMEM)
    lines = T.report_lines(f)
    assert lines[0] == "Across hosts (NVSHMEM):"
    text = "\n".join(lines)
    for part in ("NVSHMEM: nvidia-nvshmem-cu12 3.3.20, transport plugins: ibrc, ibgda",
                 "peer-memory module nvidia_peermem", "settings: NVSHMEM_DISABLE_P2P=1",
                 "remote transport: IBRC proxy over mlx5_0:1", "because ",
                 "advice: NVSHMEM_IB_ENABLE_IBGDA=1"):
        assert part in text, part


def test_bad_input_and_failures(tmp_path, monkeypatch):
    with pytest.raises(TypeError, match="TransportFacts"):
        T.predict({"ports": ()})
    with pytest.raises(TypeError, match="nvshmem must be"):
        T.gather(tmp_path, {}, nvshmem="3.3")

    def broken(*a, **k):
        raise OSError("unreadable")
    monkeypatch.setattr(T, "gather", broken)
    assert T.describe() == "remote transport: not determined (OSError: unreadable)"
    assert T.report_lines()[1] == "  not determined (OSError: unreadable)"


def test_describe_on_this_machine():
    line = T.describe()
    assert line.startswith("remote transport: ") and "\n" not in line


# -- tools/shmem_check.py --remote: its settings and its refusals -------------------------------
TOOL = Path(__file__).resolve().parents[1] / "tools" / "shmem_check.py"


def _tool(*args):
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          timeout=TOOL_TIMEOUT_S)


def test_shmem_check_remote_env(tmp_path):
    spec = importlib.util.spec_from_file_location("shmem_check_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    env = tool.remote_env("ibgda", "mlx5_0:1", env={})
    assert env["NVSHMEM_DISABLE_P2P"] == "1" and env["NVSHMEM_REMOTE_TRANSPORT"] == "ibrc"
    assert env["NVSHMEM_HCA_LIST"] == "mlx5_0:1" and env["NVSHMEM_IB_ENABLE_IBGDA"] == "1"
    assert env["NVSHMEM_INFO"] == "1" and env["NVSHMEM_DEBUG"] == "INFO"
    ibrc = tool.remote_env("ibrc", "mlx5_0:1", env={"NVSHMEM_DEBUG": "WARN"})
    assert "NVSHMEM_IB_ENABLE_IBGDA" not in ibrc and "NVSHMEM_DEBUG" not in ibrc
    # what predict() expects under the forced settings, on an mlx5 port with peermem
    f = facts_of(tmp_path, env, ports=[IB_PORT], modules=PEERMEM)
    assert T.predict(f).transport == T.IBGDA
    v = T.predict(dataclasses.replace(f, settings=tuple(ibrc.items())))
    assert v.transport == T.IBRC and v.port.name == "mlx5_0:1"


def test_shmem_check_remote_refuses_several_ranks_per_host():
    p = _tool("--remote", "ibrc", "--pes", "4", "--ranks-per-host", "2")
    assert p.returncode == 2 and "needs --ranks-per-host 1, got 2" in p.stderr


@pytest.mark.skipif(any(p.active for p in T.gather().ports),
                    reason="this machine has an active RDMA port")
def test_shmem_check_remote_without_rdma_exits_2():
    p = _tool("--remote", "ibgda")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Across hosts (NVSHMEM):" in p.stdout
    assert "no RDMA device: cannot force the remote transport" in p.stderr

"""Which remote transport NVSHMEM will use between hosts on this machine, read from files alone:
NVSHMEM is not started, no GPU or process group is needed.

- ``gather(root, env)``: the facts (``TransportFacts``): the NVSHMEM wheel and its transport
  plugins, the RDMA ports under ``/sys/class/infiniband``, GPUDirect RDMA (``nvidia_peermem``,
  or dma-buf), GDRCopy, and the ``NVSHMEM_*`` settings that choose a transport;
- ``predict(facts)``: pure, the transport NVSHMEM's device-side puts and waits will take, whether
  its waits run the proxy's consistency step, and what to set for the fast path
  (``TransportVerdict``);
- ``describe()``: one line, appended to ``EPBuffer.backend_reason`` on the shmem backend;
  ``report_lines()``: the ``llcomm doctor`` section.

A prediction: NVSHMEM decides when it starts (``NVSHMEM_INFO=1`` prints its settings, and
``NVSHMEM_DEBUG=INFO`` the transport it initialised). What it follows in NVSHMEM 3.x: the remote
transport is ``NVSHMEM_REMOTE_TRANSPORT`` (``ibrc`` by default; ``none`` loads none); with
``NVSHMEM_IB_ENABLE_IBGDA=1`` the IBGDA plugin is loaded as well and serves device-side
operations, where an mlx5 NIC and GPUDirect RDMA let it start; IBRC without GDRCopy (or on a
CPU other than x86-64) registers a "consistency at target" step that a wait runs through the
proxy thread before it returns. Imports nothing from llcomm and nothing heavy.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import platform
import re
from pathlib import Path

#: Where the kernel lists RDMA devices (relative to the filesystem root).
SYS_INFINIBAND = "sys/class/infiniband"
SYS_MODULE = "sys/module"
PROC_MODULES = "proc/modules"
PROC_OSRELEASE = "proc/sys/kernel/osrelease"
#: The NVIDIA driver's version file; its first line names the open kernel module as such.
PROC_NVIDIA_VERSION = "proc/driver/nvidia/version"
OPEN_MODULE_MARK = "Open Kernel Module"
#: GPUDirect RDMA's kernel modules: the current one and its legacy predecessor.
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")
#: dma-buf registration of GPU memory with the NIC needs this kernel and NVIDIA's open module.
DMABUF_MIN_KERNEL = (5, 12)
GDRCOPY_MODULE = "gdrdrv"
GDRAPI_GLOB = "libgdrapi.so*"
#: Folders (under the root) searched for libgdrapi before asking the dynamic linker.
GDRAPI_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "usr/lib",
               "usr/local/lib", "usr/local/lib64", "opt/gdrcopy/lib", "opt/gdrcopy/lib64")
#: The driver IBGDA needs: the GPU writes the NIC's mlx5 work queues itself.
IBGDA_DRIVER = "mlx5_core"
#: The NVSHMEM wheels (CUDA 13, CUDA 12) and their library folder inside site-packages.
NVSHMEM_DISTS = ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12")
NVSHMEM_LIB = "nvidia/nvshmem/lib"
#: Transport plugins of the wheel, ``nvshmem_transport_<name>.so.<major>``.
PLUGINS = ("ibrc", "ibgda", "ucx", "libfabric", "ibdevx")
#: The settings that choose the transport, shown by ``llcomm doctor``.
SETTINGS = ("NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_IB_ENABLE_IBGDA", "NVSHMEM_DISABLE_P2P",
            "NVSHMEM_HCA_LIST", "NVSHMEM_ENABLE_NIC_PE_MAPPING", "NVSHMEM_DISABLE_GDRCOPY",
            "NVSHMEM_IBGDA_NIC_HANDLER", "NVSHMEM_IB_GID_INDEX", "NVSHMEM_IB_TRAFFIC_CLASS",
            "NVSHMEM_LIBFABRIC_PROVIDER")
DEFAULT_REMOTE = "ibrc"
TRUE_WORDS = ("1", "y", "yes", "t", "true", "on")
#: CPUs where NVSHMEM's IBRC keeps the consistency step even with GDRCopy.
ALWAYS_CST_MACHINES = ("aarch64", "arm64", "ppc64le")

#: Verdict names.
IBGDA = "IBGDA"
IBRC = "IBRC proxy"
UCX = "UCX"
LIBFABRIC = "libfabric"
IBDEVX = "IBDEVX proxy"
NONE = "none: peer only"
NOT_FOUND = "unknown: no NVSHMEM wheel"
#: NVSHMEM_REMOTE_TRANSPORT value -> verdict name.
REMOTE_NAMES = {"ibrc": IBRC, "ucx": UCX, "libfabric": LIBFABRIC, "ibdevx": IBDEVX, "none": NONE}
#: Link layers the IB verbs transports (IBRC, IBGDA) run over.
VERBS_LINKS = ("InfiniBand", "Ethernet")


@dataclasses.dataclass(frozen=True)
class RdmaPort:
    """One port of an RDMA device, as sysfs shows it."""
    device: str             # mlx5_0
    port: int
    state: str              # ACTIVE, DOWN, INIT, ... (sysfs writes "4: ACTIVE")
    link_layer: str         # InfiniBand, Ethernet (RoCE), or what the driver says
    driver: str | None      # the kernel driver of the device, mlx5_core for ConnectX

    @property
    def name(self) -> str:
        return f"{self.device}:{self.port}"

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def fabric(self) -> str:
        return "RoCE" if self.link_layer == "Ethernet" else self.link_layer

    def __str__(self) -> str:
        return f"{self.name} ({self.fabric}, {self.state})"


@dataclasses.dataclass(frozen=True)
class TransportFacts:
    """What ``gather`` read. ``None`` where a fact could not be read (not the same as no)."""
    nvshmem: str | None             # "nvidia-nvshmem-cu13 3.8.0"; None: no wheel
    plugins: tuple[str, ...]        # transport plugins in the wheel's lib folder
    ports: tuple[RdmaPort, ...]
    peermem: str | None             # the GPUDirect RDMA module loaded, if any
    kernel: str | None              # kernel release
    open_module: bool | None        # NVIDIA's open kernel module; None: no driver file
    gdrdrv: bool                    # GDRCopy's kernel module loaded
    gdrapi: str | None              # GDRCopy's library, where found
    settings: tuple[tuple[str, str], ...]   # the SETTINGS that are set
    machine: str                    # platform.machine()

    def setting(self, name: str) -> str | None:
        return dict(self.settings).get(name)

    def flag(self, name: str) -> bool:
        return (self.setting(name) or "").strip().lower() in TRUE_WORDS

    @property
    def dmabuf(self) -> bool | None:
        """dma-buf registration possible: kernel new enough and the open module (None:
        unknown)."""
        m = re.match(r"(\d+)\.(\d+)", self.kernel or "")
        if m is None:
            return None
        if (int(m[1]), int(m[2])) < DMABUF_MIN_KERNEL:
            return False
        return self.open_module

    @property
    def gpudirect(self) -> bool | None:
        """GPUDirect RDMA: the peer-memory module, or dma-buf (None: unknown)."""
        return True if self.peermem else self.dmabuf

    @property
    def gdrcopy(self) -> bool:
        return self.gdrdrv and self.gdrapi is not None and not self.flag(
            "NVSHMEM_DISABLE_GDRCOPY")


@dataclasses.dataclass(frozen=True)
class TransportVerdict:
    """``predict``'s answer: the transport, the port it would use, whether waits run the
    proxy's consistency step, why, and what to set for the fast path."""
    transport: str
    port: RdmaPort | None
    needs_consistency_step: bool
    reasons: tuple[str, ...]
    advice: tuple[str, ...]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _modules(root: Path) -> set[str]:
    """Loaded kernel modules: /proc/modules, and /sys/module (built-in ones too)."""
    names = {line.split()[0] for line in (_read(root / PROC_MODULES) or "").splitlines()
             if line.strip()}
    try:
        names |= {p.name for p in (root / SYS_MODULE).iterdir()}
    except OSError:
        pass
    return names


def _ports(root: Path) -> tuple[RdmaPort, ...]:
    out = []
    base = root / SYS_INFINIBAND
    try:
        devices = sorted(base.iterdir())
    except OSError:
        return ()
    for dev in devices:
        try:
            driver = os.path.basename(os.readlink(dev / "device" / "driver"))
        except OSError:
            driver = None
        try:
            ports = sorted((p for p in (dev / "ports").iterdir() if p.name.isdigit()),
                           key=lambda p: int(p.name))
        except OSError:
            continue
        for p in ports:
            state = (_read(p / "state") or "unknown").split(":")[-1].strip()
            out.append(RdmaPort(dev.name, int(p.name), state,
                                _read(p / "link_layer") or "unknown", driver))
    return tuple(out)


def find_nvshmem() -> tuple[str, Path] | None:
    """The installed NVSHMEM wheel: ("name version", its lib folder), or None."""
    from importlib import metadata
    for name in NVSHMEM_DISTS:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        return f"{name} {dist.version}", Path(str(dist.locate_file(NVSHMEM_LIB)))
    return None


def _gdrapi(root: Path, env) -> str | None:
    dirs = [root / d for d in GDRAPI_DIRS]
    dirs += [root / d.lstrip("/") for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
    for d in dirs:
        hits = sorted(glob.glob(str(d / GDRAPI_GLOB)))
        if hits:
            return hits[0]
    if root == Path("/"):   # the dynamic linker's cache knows this machine only
        import ctypes.util
        return ctypes.util.find_library("gdrapi")
    return None


_FIND = object()


def gather(root: str | os.PathLike = "/", env=None, nvshmem=_FIND) -> TransportFacts:
    """Read the facts under the filesystem ``root`` with the settings of ``env`` (default
    ``os.environ``). ``nvshmem``: ("name version", lib folder) of an NVSHMEM install, None for
    none; by default the installed wheel (``find_nvshmem``)."""
    root = Path(root)
    env = os.environ if env is None else env
    if nvshmem is _FIND:
        nvshmem = find_nvshmem()
    if nvshmem is not None and not (isinstance(nvshmem, tuple) and len(nvshmem) == 2):
        raise TypeError(f"gather: nvshmem must be (name, lib folder) or None, got {nvshmem!r}")
    plugins = ()
    if nvshmem is not None:
        lib = Path(nvshmem[1])
        plugins = tuple(n for n in PLUGINS if glob.glob(str(lib / f"nvshmem_transport_{n}.so*")))
    modules = _modules(root)
    kernel = _read(root / PROC_OSRELEASE)
    if kernel is None and root == Path("/"):
        kernel = platform.release()
    version = _read(root / PROC_NVIDIA_VERSION)
    return TransportFacts(
        nvshmem=None if nvshmem is None else nvshmem[0], plugins=plugins, ports=_ports(root),
        peermem=next((m for m in PEERMEM_MODULES if m in modules), None), kernel=kernel,
        open_module=None if version is None else OPEN_MODULE_MARK in version,
        gdrdrv=GDRCOPY_MODULE in modules, gdrapi=_gdrapi(root, env),
        settings=tuple((k, env[k]) for k in SETTINGS if k in env), machine=platform.machine())


def _hca_filter(ports, hca_list: str | None):
    """The ports NVSHMEM_HCA_LIST admits: ``name[:port]`` entries, all excluded with a leading
    ``^``."""
    if not hca_list:
        return list(ports)
    exclude = hca_list.startswith("^")
    wanted = []
    for entry in hca_list.lstrip("^").split(","):
        name, _, port = entry.strip().partition(":")
        wanted.append((name, int(port) if port.isdigit() else None))

    def listed(p):
        return any(p.device == n and k in (None, p.port) for n, k in wanted)
    return [p for p in ports if listed(p) != exclude]


def predict(facts: TransportFacts) -> TransportVerdict:
    """The remote transport NVSHMEM will use with these facts (module doc)."""
    if not isinstance(facts, TransportFacts):
        raise TypeError(f"predict: expected TransportFacts, got {type(facts).__name__}")
    reasons, advice = [], []
    if facts.nvshmem is None:
        return TransportVerdict(NOT_FOUND, None, False, (
            f"no {' or '.join(NVSHMEM_DISTS)} wheel in this environment",), (
            "install the NVSHMEM wheel matching torch's CUDA (pip install nvidia-nvshmem-cu12 "
            "or -cu13) for the shmem backend",))
    remote = (facts.setting("NVSHMEM_REMOTE_TRANSPORT") or DEFAULT_REMOTE).strip().lower()
    if remote not in REMOTE_NAMES:
        reasons.append(f"NVSHMEM_REMOTE_TRANSPORT={remote!r} names no transport "
                       f"({', '.join(REMOTE_NAMES)}): NVSHMEM loads none")
    elif remote == "none":
        reasons.append("NVSHMEM_REMOTE_TRANSPORT=none")
    hca_list = facts.setting("NVSHMEM_HCA_LIST")
    if hca_list and not facts.flag("NVSHMEM_ENABLE_NIC_PE_MAPPING"):
        advice.append("recent NVSHMEM releases read NVSHMEM_HCA_LIST only with "
                      "NVSHMEM_ENABLE_NIC_PE_MAPPING=1")
    active = [p for p in _hca_filter(facts.ports, hca_list) if p.active]
    verbs = [p for p in active if p.link_layer in VERBS_LINKS]
    mlx5 = [p for p in verbs if p.driver == IBGDA_DRIVER]
    if not facts.ports:
        reasons.append(f"no RDMA device under /{SYS_INFINIBAND}")
    elif not active:
        reasons.append("no active RDMA port" + (" in NVSHMEM_HCA_LIST" if hca_list else "") + ": "
                       + ", ".join(map(str, facts.ports)))
    if facts.flag("NVSHMEM_DISABLE_P2P"):
        reasons.append("NVSHMEM_DISABLE_P2P: PEs of one host also go through the remote "
                       "transport")
    if facts.gpudirect is False:
        advice.append("GPUDirect RDMA: load nvidia_peermem (modprobe nvidia_peermem), or run a "
                      "kernel >= 5.12 with NVIDIA's open kernel module (dma-buf)")

    ibgda_on = facts.flag("NVSHMEM_IB_ENABLE_IBGDA")
    ibgda_ready = bool(mlx5) and facts.gpudirect is not False and "ibgda" in facts.plugins
    if ibgda_on and ibgda_ready:
        port = mlx5[0]
        reasons.append(f"NVSHMEM_IB_ENABLE_IBGDA=1, {port.device} is driven by {IBGDA_DRIVER}, "
                       f"GPUDirect RDMA {_gpudirect_words(facts)}: the GPU posts its own RDMA "
                       "writes, no proxy thread")
        handler = facts.setting("NVSHMEM_IBGDA_NIC_HANDLER")
        if handler and handler.strip().lower() == "cpu":
            reasons.append("NVSHMEM_IBGDA_NIC_HANDLER=cpu: a CPU thread rings the NIC's doorbell")
        return TransportVerdict(IBGDA, port, False, tuple(reasons), tuple(advice))
    if ibgda_on:
        why = ("no active port of an mlx5 device" if not mlx5 else
               "no GPUDirect RDMA" if facts.gpudirect is False else
               "the wheel has no IBGDA plugin")
        reasons.append(f"NVSHMEM_IB_ENABLE_IBGDA=1 but {why}: IBGDA does not start")
    elif ibgda_ready:
        advice.append(f"NVSHMEM_IB_ENABLE_IBGDA=1: {mlx5[0].device} ({IBGDA_DRIVER}) and "
                      "GPUDirect RDMA allow GPU-initiated RDMA (no proxy thread, no consistency "
                      "step)")
    if remote not in REMOTE_NAMES or remote == "none":
        return TransportVerdict(NONE, None, False, tuple(reasons), tuple(advice))
    name = REMOTE_NAMES[remote]
    if remote not in facts.plugins:
        reasons.append(f"the wheel has no {remote} plugin (nvshmem_transport_{remote}.so)")
        return TransportVerdict(NONE, None, False, tuple(reasons), tuple(advice))
    if remote in ("ucx", "libfabric"):
        reasons.insert(0, f"NVSHMEM_REMOTE_TRANSPORT={remote}")
        if remote == "libfabric" and not facts.setting("NVSHMEM_LIBFABRIC_PROVIDER"):
            advice.append("libfabric: NVSHMEM_LIBFABRIC_PROVIDER picks cxi (default), efa or "
                          "verbs")
        return TransportVerdict(name, active[0] if active else None, False, tuple(reasons),
                                tuple(advice))
    if not verbs:       # ibrc, ibdevx: IB verbs over InfiniBand or RoCE
        others = [p for p in active if p not in verbs]
        if others:
            reasons.append("active ports without InfiniBand or RoCE: "
                           + ", ".join(map(str, others)))
            advice.append("a NIC without IB verbs RC (EFA, Slingshot): "
                          "NVSHMEM_REMOTE_TRANSPORT=libfabric")
        return TransportVerdict(NONE, None, False, tuple(reasons), tuple(advice))
    port = verbs[0]
    reasons.insert(0, f"{remote} (NVSHMEM_REMOTE_TRANSPORT "
                   + ("default" if not facts.setting("NVSHMEM_REMOTE_TRANSPORT") else "set")
                   + f") over {port}: a CPU proxy thread posts the GPU's puts")
    if facts.gpudirect is None:
        reasons.append("GPUDirect RDMA unknown (no nvidia_peermem; dma-buf not determinable): "
                       "NVSHMEM must register GPU memory with the NIC")
    elif facts.gpudirect is False:
        reasons.append("no GPUDirect RDMA: registering the GPU heap with the NIC will fail")
    if port.fabric == "RoCE" and not facts.setting("NVSHMEM_IB_GID_INDEX"):
        advice.append("RoCE: set NVSHMEM_IB_GID_INDEX to the port's RoCE v2 GID (show_gids) and "
                      "NVSHMEM_IB_TRAFFIC_CLASS to the fabric's lossless class where releases "
                      "do not pick them")
    cst = False
    if remote == "ibrc":
        cst = not facts.gdrcopy or facts.machine in ALWAYS_CST_MACHINES
        if facts.machine in ALWAYS_CST_MACHINES:
            reasons.append(f"{facts.machine}: NVSHMEM's IBRC runs the consistency step whatever "
                           "GDRCopy")
        elif cst:
            reasons.append(f"GDRCopy {_gdrcopy_words(facts)}: every wait runs NVSHMEM's "
                           "consistency step (an RDMA read through the proxy thread)")
            advice.append("GDRCopy (the gdrdrv module and libgdrapi) removes the proxy's "
                          "consistency step from the waits")
    return TransportVerdict(name, port, cst, tuple(reasons), tuple(advice))


def _gpudirect_words(facts: TransportFacts) -> str:
    if facts.peermem:
        return f"({facts.peermem})"
    dmabuf = {True: "yes", False: "no", None: "unknown"}[facts.dmabuf]
    return f"(dma-buf possible: {dmabuf})"


def _gdrcopy_words(facts: TransportFacts) -> str:
    if facts.gdrcopy:
        return "yes"
    if facts.flag("NVSHMEM_DISABLE_GDRCOPY"):
        return "off (NVSHMEM_DISABLE_GDRCOPY)"
    missing = ([] if facts.gdrdrv else [f"{GDRCOPY_MODULE} not loaded"]) + (
        [] if facts.gdrapi else ["libgdrapi not found"])
    return "no (" + ", ".join(missing) + ")"


def verdict_line(v: TransportVerdict, facts: TransportFacts) -> str:
    """One line for a verdict (``describe``)."""
    head = f"remote transport: {v.transport}"
    if v.port is not None:
        head += f" over {v.port}"
    if v.transport == IBRC:
        if not v.needs_consistency_step:
            head += "; GDRCopy yes: no consistency step"
        elif facts.machine in ALWAYS_CST_MACHINES:
            head += f"; {facts.machine}: waits run NVSHMEM's consistency step"
        else:
            head += "; GDRCopy no: waits run NVSHMEM's consistency step"
    elif v.transport == NONE:
        head += " (" + "; ".join(v.reasons) + "): PEs on other hosts are out of reach"
    elif v.transport == NOT_FOUND:
        head += " (the transport is not predictable here)"
    return head


def describe(root: str | os.PathLike = "/", env=None) -> str:
    """One line naming the transport across hosts, e.g. ``remote transport: IBRC proxy over
    mlx5_0:1 (InfiniBand, ACTIVE); GDRCopy no: waits run NVSHMEM's consistency step``."""
    try:
        facts = gather(root, env)
    except Exception as e:  # noqa: BLE001  (a diagnostic line must not fail its caller)
        return f"remote transport: not determined ({type(e).__name__}: {e})"
    return verdict_line(predict(facts), facts)


def report_lines(facts: TransportFacts | None = None) -> list[str]:
    """The ``llcomm doctor`` section "Across hosts (NVSHMEM)"."""
    if facts is None:
        try:
            facts = gather()
        except Exception as e:  # noqa: BLE001  (the doctor reports, it must not fail)
            return ["Across hosts (NVSHMEM):", f"  not determined ({type(e).__name__}: {e})"]
    v = predict(facts)
    out = ["Across hosts (NVSHMEM):"]
    if facts.nvshmem is None:
        out.append("  NVSHMEM: not installed (no nvidia-nvshmem wheel): the shmem backend "
                   "cannot run here")
    else:
        out.append(f"  NVSHMEM: {facts.nvshmem}, transport plugins: "
                   + (", ".join(facts.plugins) or "none"))
    out.append("  RDMA ports: " + (", ".join(f"{p} {p.driver or 'driver unknown'}"
                                             for p in facts.ports)
                                   or f"none under /{SYS_INFINIBAND}"))
    dmabuf = {True: "yes", False: "no", None: "unknown"}[facts.dmabuf]
    open_mod = {True: "yes", False: "no", None: "unknown"}[facts.open_module]
    out.append(f"  GPUDirect RDMA: peer-memory module {facts.peermem or 'not loaded'}; dma-buf "
               f"possible: {dmabuf} (kernel {facts.kernel or 'unknown'}, open module {open_mod})")
    out.append(f"  GDRCopy: {_gdrcopy_words(facts)}"
               + (f" ({facts.gdrapi})" if facts.gdrcopy else ""))
    out.append("  settings: " + (", ".join(f"{k}={v_}" for k, v_ in facts.settings)
                                 or "no NVSHMEM transport setting set"))
    out.append("  " + verdict_line(v, facts))
    if v.transport != NONE:     # its line already gives the reasons
        out.extend(f"    because {r}" for r in v.reasons)
    out.extend(f"    advice: {a}" for a in v.advice)
    out.append("  (a prediction from files: NVSHMEM decides when it starts; NVSHMEM_DEBUG=INFO "
               "prints the transport it initialised)")
    return out

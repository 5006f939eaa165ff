"""Every setting llcomm reads from the environment, parsed in this one module.

``TPSettings.read(world_size)`` (``Communicator``) and ``EPSettings.read()`` (``EPBuffer``) parse
the environment once, at construction; the rest of the package takes its values from the frozen
object they return and never reads ``os.environ`` itself. Each field declares its variable, its
default, its parser and whether every rank of a group must use the same value (``agree``). A
value that cannot be parsed raises ValueError naming the variable and what it expects.

Settings marked ``agree`` change what crosses between ranks (grid size, slot sizes, which kernel
runs), so ranks that differ would run kernels that never meet. ``agreed()`` lists them; the
backend choice (``runtime/backend.py``) exchanges them among the group at construction and
``check_agreement`` turns any difference into ``UnsupportedConfigError`` on every rank.

docs/settings.md lists every setting; tests/test_settings_doc.py keeps the two in step.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..errors import UnsupportedConfigError
from .protocol import MAX_TIMEOUT_MS


# -- parsers: (variable name, raw string) -> value; ValueError naming the variable -------------
def positive(name: str, raw: str) -> int:
    if not raw.isdigit() or int(raw) == 0:
        raise ValueError(f"{name}={raw!r}: expected a positive integer")
    return int(raw)


def bit(name: str, raw: str) -> int:
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: expected 0 or 1")
    return int(raw)


def pow2(name: str, raw: str) -> int:
    if not raw.isdigit() or int(raw) < 1 or int(raw) & (int(raw) - 1):
        raise ValueError(f"{name}={raw!r}: expected a power of two")
    return int(raw)


def timeout_ms(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 0 < value <= MAX_TIMEOUT_MS:
        raise ValueError(f"{name}={raw!r}: expected a positive integer of milliseconds, "
                         f"at most {MAX_TIMEOUT_MS}")
    return value


def text(name: str, raw: str) -> str | None:
    return raw or None          # set but empty: as if unset


# -- declaring and reading ---------------------------------------------------------------------
def setting(env: str, default: Any, parse: Callable[[str, str], Any], *, agree: bool = False):
    """A settings field: ``default`` when ``env`` is unset, else ``parse(env, raw)``."""
    return field(default=default, metadata={"env": env, "parse": parse, "agree": agree})


class _Settings:
    @classmethod
    def _parse(cls, environ: Mapping[str, str] | None) -> dict:
        environ = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            env, parse = f.metadata["env"], f.metadata["parse"]
            raw = environ.get(env)
            values[f.name] = f.default if raw is None else parse(env, raw)
        return values

    def agreed(self) -> tuple[tuple[str, Any], ...]:
        """(variable, value) of every setting that every rank must share, in field order."""
        return tuple((f.metadata["env"], getattr(self, f.name)) for f in dataclasses.fields(self)
                     if f.metadata["agree"])


@dataclass(frozen=True)
class _Shared(_Settings):
    #: bound of every wait when ``timeout_ms`` is not passed (None: the backend's default)
    timeout_ms: int | None = setting("LLCOMM_TIMEOUT_MS", None, timeout_ms)
    #: launch with programmatic dependent launch where the GPU and Triton have it
    #: (runtime/launch.py; measured in bench/results/ab/2026-11-30-pdl/)
    pdl: int = setting("LLCOMM_PDL", 1, bit)


#: Blocks of every TP kernel (128 / 32 / 16 measured: bench/results/ab/2026-11-30-grid-size/).
NUM_BLOCKS = 128
#: Bytes of a Lamport slot: at world size 2 the pipelined Lamport all-reduce is the fastest
#: algorithm to 8 MiB (bench/results/ab/2026-11-30-lamport-chunk/); elsewhere
#: not measured, so the smaller slot.
LAMPORT_BYTES = 1 << 20
LAMPORT_BYTES_W2 = 16 << 20


@dataclass(frozen=True)
class TPSettings(_Shared):
    """What ``Communicator`` reads (the peer-kernel knobs matter on the peer backend only)."""
    #: the user's all_reduce table (None: ``~/.cache/llcomm/tune-<gpu>-w<W>.json``)
    tune_table: str | None = setting("LLCOMM_TUNE_TABLE", None, text)
    num_blocks: int = setting("LLCOMM_NUM_BLOCKS", NUM_BLOCKS, positive, agree=True)
    #: None until ``read`` resolves it: LAMPORT_BYTES_W2 at world size 2, else LAMPORT_BYTES
    lamport_bytes: int | None = setting("LLCOMM_LAMPORT_BYTES", None, positive, agree=True)

    @classmethod
    def read(cls, world_size: int, environ: Mapping[str, str] | None = None) -> "TPSettings":
        """Parse the environment (or ``environ``); the slot's default, which depends on the
        world size, resolved, so ranks compare the values they will use."""
        s = cls(**cls._parse(environ))
        if s.lamport_bytes is not None:
            return s
        return dataclasses.replace(
            s, lamport_bytes=LAMPORT_BYTES_W2 if world_size == 2 else LAMPORT_BYTES)


@dataclass(frozen=True)
class EPSettings(_Shared):
    """What ``EPBuffer`` reads. None: derived from the buffer and the GPU (llcomm/ep/peer.py)."""
    #: blocks of the dispatch and combine (None: ep/layout.py DEFAULT_NUM_BLOCKS, at most the
    #: GPU's SMs); ``size_hint`` reads it too
    num_blocks: int | None = setting("LLCOMM_EP_NUM_BLOCKS", None, positive, agree=True)
    #: 1: the LL dispatch, 0: the flag dispatch (None: by the buffer's size, ep/peer.py)
    ll: int | None = setting("LLCOMM_EP_LL", None, bit, agree=True)
    #: 1: the kernels stamp each stage's clock (tools/ep_timeline.py)
    profile: int = setting("LLCOMM_EP_PROFILE", 0, bit)
    #: ranks per host, declared (None: detected from the host names; runtime/hosts.py)
    ranks_per_host: int | None = setting("LLCOMM_EP_RANKS_PER_HOST", None, positive, agree=True)

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> "EPSettings":
        return cls(**cls._parse(environ))


@dataclass(frozen=True)
class BenchSettings(_Settings):
    """What the benchmarks read besides the library's own settings."""
    #: the commit recorded in result files, for a copied tree without ``.git``
    commit: str | None = setting("LLCOMM_COMMIT", None, text)

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> "BenchSettings":
        return cls(**cls._parse(environ))


def bit_or_empty(name: str, raw: str) -> int:
    return 0 if raw == "" else bit(name, raw)


@dataclass(frozen=True)
class ImportSettings(_Settings):
    """What every interpreter start reads: the top-level ``llcomm_deep_ep_alias`` module (run by
    the ``.pth`` file llcomm installs) parses it itself, without importing llcomm; declared here
    for the settings page and ``llcomm doctor``, with the same values (tests/test_deep_ep_alias.py
    checks they agree)."""
    #: 1: ``import deep_ep`` gives ``llcomm.deep_ep`` (docs/deep_ep.md)
    deep_ep_alias: int = setting("LLCOMM_DEEP_EP_ALIAS", 0, bit_or_empty)

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> "ImportSettings":
        return cls(**cls._parse(environ))


SETTINGS_CLASSES = (TPSettings, EPSettings, BenchSettings, ImportSettings)


def registry() -> dict[str, dataclasses.Field]:
    """Every setting by variable name (a shared one once)."""
    out = {}
    for cls in SETTINGS_CLASSES:
        for f in dataclasses.fields(cls):
            out.setdefault(f.metadata["env"], f)
    return out


def value(env: str, environ: Mapping[str, str] | None = None) -> Any:
    """One setting by variable name, parsed as its field parses it (``llcomm doctor``)."""
    f = registry()[env]
    raw = (os.environ if environ is None else environ).get(env)
    return f.default if raw is None else f.metadata["parse"](env, raw)


# -- agreement ---------------------------------------------------------------------------------
def _shown(v: Any) -> str:
    return "unset" if v is None else str(v)


def disagreements(per_rank: list[tuple[tuple[str, Any], ...]]) -> list[str]:
    """One line per ranks-agree setting whose value differs between ranks (``per_rank[r]``:
    rank r's ``agreed()``); a setting one rank does not know counts as "not read"."""
    names = list(dict.fromkeys(name for mine in per_rank for name, _ in mine))
    lines = []
    for name in names:
        vals = [dict(mine).get(name, "not read") for mine in per_rank]
        if any(v != vals[0] for v in vals[1:]):
            lines.append(f"{name} differs between ranks: "
                         + ", ".join(f"rank {r}: {_shown(v)}" for r, v in enumerate(vals)))
    return lines


def check_agreement(what: str, per_rank: list[tuple[tuple[str, Any], ...]]) -> None:
    """Raise UnsupportedConfigError naming every ranks-agree setting that differs, with each
    rank's value. Every rank calls it with the same ``per_rank``, so every rank raises."""
    lines = disagreements(per_rank)
    if lines:
        raise UnsupportedConfigError(
            f"llcomm.{what}: " + "; ".join(lines) + "; every rank must use the same value "
            "(LLCOMM_* settings: docs/settings.md)")

"""Integer settings read from the environment (docs/settings.md lists them all).

Each parser returns the default when the variable is unset and refuses anything else it cannot
take with a ValueError that names the variable and what it expects."""
from __future__ import annotations

import os


def env_int(name: str, default: int, *, zero_ok: bool = False) -> int:
    """A positive integer (or 0 too, if ``zero_ok``)."""
    raw = os.environ.get(name, str(default))
    if not raw.isdigit() or (int(raw) == 0 and not zero_ok):
        kind = "non-negative" if zero_ok else "positive"
        raise ValueError(f"{name}={raw!r}: expected a {kind} integer")
    return int(raw)


def env_bit(name: str, default: int) -> int:
    """0 or 1."""
    raw = os.environ.get(name, str(default))
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: expected 0 or 1")
    return int(raw)


def env_pow2(name: str, default: int) -> int:
    """A power of two (``default`` when unset, whatever it is)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or int(raw) < 1 or int(raw) & (int(raw) - 1):
        raise ValueError(f"{name}={raw!r}: expected a power of two")
    return int(raw)

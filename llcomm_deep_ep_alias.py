"""``import deep_ep`` as ``llcomm.deep_ep``, for engines that import DeepEP by its own name.

Opt-in, by the environment: with ``LLCOMM_DEEP_EP_ALIAS=1`` every Python process that starts
with this package's ``llcomm_deep_ep_alias.pth`` in its site-packages (``pip install`` and
``pip install -e`` put it there) installs ``DeepEPAlias`` first on ``sys.meta_path``. Then
``import deep_ep``, ``from deep_ep import Buffer, Config``, ``import deep_ep.utils`` and every
other ``deep_ep.X`` that ``llcomm.deep_ep.X`` exists for resolve to llcomm's modules themselves
(``deep_ep.Buffer is llcomm.deep_ep.Buffer``), and ``importlib.util.find_spec("deep_ep")`` returns
a spec. Processes a job starts inherit the environment (torchrun's workers, multiprocessing's
spawn and forkserver children, engine workers), so the alias holds in all of them.
``llcomm.deep_ep.install_alias()`` does the same from code and sets the variable for the
processes started after it.

**The setting wins**: where a DeepEP package is installed too, ``deep_ep`` is still llcomm's,
and the first ``import deep_ep`` warns (UserWarning) naming the DeepEP it shadows. Unset the
variable (or ``=0``) to import DeepEP itself. Any other value leaves ``deep_ep`` alone and says so
on stderr once per process (the library's own check, ``llcomm doctor``, raises on it).

This module is top-level and imports nothing but the standard library: the ``.pth`` line runs
at every interpreter start, before anything else, and must stay cheap (it imports this module
only when the variable is set). ``llcomm.deep_ep`` itself (and torch) is imported by the first
``import deep_ep``. docs/deep_ep.md, "Engines that import DeepEP by name", says how to use it.
"""
from __future__ import annotations

import os
import sys
from importlib.machinery import ModuleSpec, PathFinder

#: The environment variable (docs/settings.md; llcomm/runtime/settings.py declares it too).
ENV = "LLCOMM_DEEP_EP_ALIAS"
#: The name engines import, and what it stands for.
NAME = "deep_ep"
TARGET = "llcomm.deep_ep"
#: The file pip installs at the top of site-packages, whose one line calls
#: ``install_from_environment`` where ENV is set.
PTH = "llcomm_deep_ep_alias.pth"


def parse(raw: str | None) -> bool | None:
    """ENV's value: False unset, empty or "0"; True "1"; None for anything else."""
    if raw is None or raw in ("", "0"):
        return False
    return True if raw == "1" else None


def real_deep_ep() -> str | None:
    """Where a DeepEP package (a ``deep_ep`` on sys.path that is not this alias) lives, or None.
    Asks the path finder only: no module is imported."""
    spec = PathFinder.find_spec(NAME)
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    return spec.origin if spec.origin not in (None, "namespace") else \
        (locations[0] if locations else NAME)


class _AliasLoader:
    """Loads ``deep_ep[.X]`` by importing ``llcomm.deep_ep[.X]`` and putting that very module in
    ``sys.modules`` under the alias name (the import system returns what ``sys.modules`` holds
    after ``exec_module``), so classes, ``__name__`` and ``__spec__`` stay llcomm's and
    ``deep_ep.X`` and ``llcomm.deep_ep.X`` are one module."""

    def __init__(self, finder: "DeepEPAlias") -> None:
        self.finder = finder

    def create_module(self, spec: ModuleSpec):
        return None             # the default module: a placeholder that exec_module replaces

    def exec_module(self, module) -> None:
        import importlib

        name = module.__spec__.name
        if name == NAME:
            self.finder.warn_shadowed()
        sys.modules[name] = importlib.import_module(TARGET + name[len(NAME):])


class DeepEPAlias:
    """A ``sys.meta_path`` finder: ``deep_ep`` and ``deep_ep.X`` as ``llcomm.deep_ep[.X]``."""

    def __init__(self) -> None:
        self.loader = _AliasLoader(self)
        self.warned = False

    def __repr__(self) -> str:
        return f"<{__name__}.DeepEPAlias: {NAME} -> {TARGET}>"

    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:
        if fullname == NAME:
            # no import here: find_spec("deep_ep") is how engines ask whether DeepEP is there
            return ModuleSpec(NAME, self.loader, origin=f"alias of {TARGET}", is_package=True)
        if not fullname.startswith(NAME + "."):
            return None
        import importlib.util

        real = importlib.util.find_spec(TARGET + fullname[len(NAME):])    # imports the parents
        if real is None:
            return None         # llcomm has no such module: "No module named 'deep_ep.X'"
        return ModuleSpec(fullname, self.loader, origin=f"alias of {real.name}",
                          is_package=real.submodule_search_locations is not None)

    def warn_shadowed(self) -> None:
        """Once per process: the UserWarning naming a DeepEP that ``deep_ep`` now hides."""
        where = real_deep_ep()
        if where is None or self.warned:
            return
        self.warned = True
        import warnings
        warnings.warn(f"{ENV}=1: 'import {NAME}' gives {TARGET}; the DeepEP package at {where} "
                      f"is shadowed (unset {ENV} to import it)", UserWarning, stacklevel=4)


def installed() -> DeepEPAlias | None:
    """The alias finder on ``sys.meta_path``, or None."""
    for finder in sys.meta_path:
        if type(finder).__name__ == "DeepEPAlias" and \
                type(finder).__module__ == __name__:
            return finder
    return None


def install() -> DeepEPAlias:
    """Put the alias first on ``sys.meta_path`` (once; later calls return the same finder).
    RuntimeError where a ``deep_ep`` other than llcomm's is already imported: the alias cannot
    replace a module that code holds already."""
    have = sys.modules.get(NAME)
    if have is not None and getattr(have, "__name__", None) != TARGET:
        raise RuntimeError(
            f"{__name__}: {NAME} is already imported from "
            f"{getattr(have, '__file__', None) or have!r}; install the alias before anything "
            f"imports {NAME} (set {ENV}=1 in the environment, or call "
            "llcomm.deep_ep.install_alias() first)")
    finder = installed()
    if finder is None:
        finder = DeepEPAlias()
        sys.meta_path.insert(0, finder)
    return finder


def uninstall() -> bool:
    """Remove the alias finder and every ``deep_ep[.X]`` entry it put in ``sys.modules``
    (llcomm's modules stay loaded under their own names). Whether a finder was removed."""
    finder = installed()
    if finder is None:
        return False
    sys.meta_path.remove(finder)
    for name in [n for n in sys.modules if n == NAME or n.startswith(NAME + ".")]:
        if getattr(sys.modules[name], "__name__", "").startswith(TARGET):
            del sys.modules[name]
    return True


def install_from_environment() -> DeepEPAlias | None:
    """What the ``.pth`` line calls: install the alias where ENV is "1"; for a value other than
    "0" or empty, a line on stderr and no alias. Never raises (a ``.pth`` line that raises
    prints a traceback at every interpreter start)."""
    raw = os.environ.get(ENV)
    on = parse(raw)
    if on is None:
        sys.stderr.write(f"{__name__}: {ENV}={raw!r}: expected 0 or 1; deep_ep is not "
                         "aliased to llcomm.deep_ep\n")
        return None
    if not on:
        return None
    try:
        return install()
    except RuntimeError as e:       # a .pth runs before any import: only a test gets here
        sys.stderr.write(f"{e}\n")
        return None


def describe() -> str:
    """One line: whether the alias is active here and what ``import deep_ep`` resolves to (no
    import happens; ``llcomm doctor`` prints it)."""
    raw = os.environ.get(ENV)
    head = f"deep_ep alias ({ENV}={'unset' if raw is None else raw}): "
    where = real_deep_ep()
    if installed() is not None:
        return head + f"active: import {NAME} gives {TARGET}" + (
            f" (the DeepEP package at {where} is shadowed)" if where else "")
    if parse(raw) is None:
        return head + f"not active: the value is neither 0 nor 1; import {NAME} gives " + (
            f"DeepEP at {where}" if where else "nothing (no DeepEP installed)")
    if parse(raw) and not pth_paths():
        return head + (f"not active although set: {PTH} is not in site-packages (reinstall "
                       "llcomm with pip), or this interpreter skipped site (-S)")
    return head + "not active: import " + NAME + " gives " + (
        f"DeepEP at {where}" if where else "nothing (no DeepEP installed)")


def pth_paths() -> list[str]:
    """The ``.pth`` files of this interpreter's site-packages folders (global and user)."""
    import site

    folders = list(getattr(site, "getsitepackages", lambda: [])())
    user = getattr(site, "getusersitepackages", lambda: None)()
    if user:
        folders.append(user)
    return [os.path.join(f, PTH) for f in folders if os.path.isfile(os.path.join(f, PTH))]

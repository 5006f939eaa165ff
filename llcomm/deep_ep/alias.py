"""``install_alias()``: ``import deep_ep`` as ``llcomm.deep_ep`` from code, for the users who
prefer that to the environment setting (``LLCOMM_DEEP_EP_ALIAS=1``, which the ``.pth`` file
llcomm installs reads at every interpreter start). The finder is the top-level module
``llcomm_deep_ep_alias``, which the ``.pth`` line imports without importing llcomm or torch;
docs/deep_ep.md, "Engines that import DeepEP by name"."""
from __future__ import annotations

import os

import llcomm_deep_ep_alias as _hook


def install_alias(*, inherit: bool = True) -> None:
    """Make ``import deep_ep`` (and ``deep_ep.utils``, ``deep_ep.buffer``, ...) give
    ``llcomm.deep_ep`` in this process, whether or not a DeepEP package is installed (the first
    ``import deep_ep`` then warns naming it). Call it before anything imports ``deep_ep``:
    RuntimeError naming the imported one otherwise. Idempotent.

    Args:
        inherit: also set ``LLCOMM_DEEP_EP_ALIAS=1`` in ``os.environ``, so that the processes
            started afterwards (spawned workers, torchrun, subprocesses) get the alias at their
            start, through the ``.pth`` file. False: this process only.
    """
    _hook.install()
    if inherit:
        os.environ[_hook.ENV] = "1"


def remove_alias() -> bool:
    """Undo ``install_alias`` in this process: the finder leaves ``sys.meta_path`` and the
    ``deep_ep`` names leave ``sys.modules`` (code that holds the module keeps it); the
    environment setting, if set, is removed too. Whether an alias was active."""
    os.environ.pop(_hook.ENV, None)
    return _hook.uninstall()


def alias_active() -> bool:
    """Whether ``import deep_ep`` resolves to ``llcomm.deep_ep`` in this process."""
    return _hook.installed() is not None

"""transformers' own models sharded over llcomm (docs/integration.md, "Real model code").

An optional integration: it needs transformers (the ``hf`` extra, ``pip install llcomm[hf]``)
and nothing in the library imports it; ``import llcomm`` never loads it.

- ``llcomm.hf.llama_tp``: tensor parallelism of a Llama (``tensor_parallel(model, comm)``), its
  row-parallel layers joined by any all-reduce (``join=``), and the decoder layer's forward with
  its two joins fused;
- ``llcomm.hf.moe_ep``: expert parallelism of a Qwen3-MoE sparse block (``ExpertParallelMoE``)
  with its tokens moved by an ``EPBuffer`` (``EPBufferTransport``) or by ``llcomm.deep_ep``
  (``DeepEPTransport``), and a capturable variant of
  the local experts (a fixed number of rows per expert).

The sharding itself is plain torch on the modules transformers built; transformers is
imported only where a module of its own is made (``require_transformers``).
"""
from __future__ import annotations

import importlib
import importlib.util

#: How to install what this package needs.
INSTALL_HINT = "pip install 'llcomm[hf]'"


class MissingTransformersError(ImportError):
    """transformers is not installed (the ``hf`` extra)."""


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def require_transformers(what: str = "llcomm.hf"):
    """The ``transformers`` module, or ``MissingTransformersError`` naming the ``hf`` extra."""
    if not transformers_available():
        raise MissingTransformersError(
            f"{what} needs transformers, which is not installed: {INSTALL_HINT} (the hf extra; "
            "scripts/venv.sh installs it)")
    return importlib.import_module("transformers")


__all__ = ["INSTALL_HINT", "MissingTransformersError", "require_transformers",
           "transformers_available"]

"""llcomm: low-latency GPU communication for LLM inference decode.

Tensor-parallel joins (``Communicator``) and MoE dispatch / combine (``EPBuffer``) over NVLink
peer memory with Triton kernels, and a reference backend on torch.distributed (NCCL or gloo)
with the same API. ``llcomm.ops`` holds the same calls as torch.library custom ops.
"""
from .errors import (AlgoTableError, CommBrokenError, CommClosedError, CommMismatchError,
                     CommTimeoutError, LLCommError, UnsupportedConfigError)
from .tp import Communicator
from .ep import EPBuffer, EPHandle
from . import ops  # noqa: F401  (registers the torch.library ops: docs/compile.md)

__version__ = "0.2.0"
__all__ = ["Communicator", "EPBuffer", "EPHandle", "CommTimeoutError", "CommMismatchError",
           "CommBrokenError", "CommClosedError", "LLCommError", "UnsupportedConfigError",
           "AlgoTableError", "__version__"]

"""llcomm: low-latency GPU communication for LLM inference decode.

Tensor-parallel joins (``Communicator``) over NVLink peer memory with Triton kernels, and a
reference backend on torch.distributed (NCCL or gloo) with the same API.
"""
from .errors import (AlgoTableError, CommBrokenError, CommClosedError, CommMismatchError,
                     CommTimeoutError, LLCommError, UnsupportedConfigError)
from .tp import Communicator
from . import ops  # noqa: E402,F401  (torch.library custom ops: llcomm.ops, docs/compile.md)

__version__ = "0.1.0"
__all__ = ["Communicator", "CommTimeoutError", "CommMismatchError", "CommBrokenError",
           "CommClosedError", "LLCommError", "UnsupportedConfigError", "AlgoTableError",
           "__version__"]
from .ep import EPBuffer, EPHandle  # noqa: E402  (EP dispatch / combine, docs/ep.md)
__all__ += ["EPBuffer", "EPHandle"]

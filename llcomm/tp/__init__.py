"""Tensor-parallel joins: ``Communicator`` (``api``), its peer backend (``peer``, kernels in
``kernels/``), its reference backend (``reference``) and the all-reduce algorithm tables
(``algo_table``)."""
from .api import Communicator

__all__ = ["Communicator"]

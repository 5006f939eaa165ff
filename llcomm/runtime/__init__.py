"""Shared runtime below the op families (``llcomm.tp``, ``llcomm.ep``): settings, validation,
the flag protocol and its errors, the symmetric workspace, kernel launches, backend choice and
the op-handle registry. Nothing here imports an op family."""

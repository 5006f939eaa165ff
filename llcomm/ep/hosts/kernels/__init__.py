"""The two-level EP kernels (``llcomm/ep/hosts/__init__.py``)."""

"""Triton kernels, one module per op family. Imported only where kernels run (CUDA machines)."""

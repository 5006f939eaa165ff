"""Triton kernels of EP dispatch and combine."""

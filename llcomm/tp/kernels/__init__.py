"""Triton kernels of the TP joins, one module per algorithm family: flag all-reduce
(``all_reduce``), Lamport all-reduce (``lamport``), reduce-scatter, Lamport and flag
(``reduce_scatter``), flag movement (``movement``), LL gather (``ll``), fused all-reduce +
residual + RMSNorm (``fused_norm``)."""

"""Triton kernels of the TP joins, one module per algorithm family: flag all-reduce
(``all_reduce``), Lamport all-reduce (``lamport_all_reduce``), reduce-scatter, Lamport and flag
(``reduce_scatter``), flag movement (``movement``), LL gather (``ll``), fused all-reduce +
residual + RMSNorm (``fused_norm``); the flag kernels' shared round (``flag_round``)."""

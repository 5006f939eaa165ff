"""Triton device functions every op family's kernels use: flags, bounded waits, error words
(``sync``) and the Lamport poll (``lamport``). Imported only where kernels are compiled."""

"""EP across hosts: the two-level path (docs/multihost.md).

A token crosses to each other host once, on its rail (the rank of the same local index there),
and is forwarded inside that host; the combine reduces inside a host before the one message
back. Here, by role:

- ``layout.py``: the byte layout of the symmetric region and its size;
- ``peer.py``: the host side of the Triton kernels on SHMEM (``HostsPeerEP``);
- ``kernels/``: ``dispatch.py``, ``combine.py``, their rank masks (``masks.py``) and the
  transport they share (``rail.py``: put-with-signal across hosts, stores inside a host);
- ``nic.py``: a simulated heap and a NIC that promises only what SHMEM promises, for running
  the kernels in Triton's interpreter;
- ``transport.py``: which remote transport SHMEM will use on this machine;
- ``reference.py``: the same two levels on torch.distributed (``TwoLevelReferenceEP``).
"""

"""DeepEP's ``Config`` of its normal-mode kernels, as ``llcomm.deep_ep`` takes it: the fields
and size hints engines read, checked as DeepEP checks them (docs/deep_ep.md, "Normal mode")."""
from __future__ import annotations

#: Chunk sizes of the configs ``Buffer.get_dispatch_config`` / ``get_combine_config`` return.
#: llcomm's normal mode moves every row in one collective and uses none of them; they are
#: valid values for code that reads or passes the config on.
DEFAULT_NVL_SEND, DEFAULT_NVL_RECV = 8, 256
DEFAULT_RDMA_SEND, DEFAULT_RDMA_RECV = 8, 128


class Config:
    """DeepEP's ``Config(num_sms, num_max_nvl_chunked_send_tokens,
    num_max_nvl_chunked_recv_tokens, num_max_rdma_chunked_send_tokens=6,
    num_max_rdma_chunked_recv_tokens=256)``.

    llcomm's normal mode reads only ``num_sms``: it sets the channels (``num_sms // 2``) by
    which the handle's channel matrices count, as DeepEP's. The chunk sizes are checked as
    DeepEP checks them (ValueError naming the field) and kept; the RDMA receive chunk is
    rounded up to a multiple of the send chunk, as DeepEP rounds it.
    """

    def __init__(self, num_sms: int, num_max_nvl_chunked_send_tokens: int,
                 num_max_nvl_chunked_recv_tokens: int,
                 num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        values = dict(num_sms=num_sms,
                      num_max_nvl_chunked_send_tokens=num_max_nvl_chunked_send_tokens,
                      num_max_nvl_chunked_recv_tokens=num_max_nvl_chunked_recv_tokens,
                      num_max_rdma_chunked_send_tokens=num_max_rdma_chunked_send_tokens,
                      num_max_rdma_chunked_recv_tokens=num_max_rdma_chunked_recv_tokens)
        for name, v in values.items():
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"llcomm.deep_ep.Config: {name}={v!r}; expected an int")
        rdma_send, rdma_recv = num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens
        if rdma_send > 0:
            rdma_recv = -(-rdma_recv // rdma_send) * rdma_send
        bad = [why for ok, why in (
            (num_sms >= 0, f"num_sms={num_sms}; expected at least 0"),
            (num_max_nvl_chunked_send_tokens > 0,
             f"num_max_nvl_chunked_send_tokens={num_max_nvl_chunked_send_tokens}; expected > 0"),
            (num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens,
             f"num_max_nvl_chunked_send_tokens={num_max_nvl_chunked_send_tokens} must be less "
             f"than num_max_nvl_chunked_recv_tokens={num_max_nvl_chunked_recv_tokens}"),
            (rdma_send > 0, f"num_max_rdma_chunked_send_tokens={rdma_send}; expected > 0"),
            (rdma_send <= rdma_recv // 2,
             f"num_max_rdma_chunked_send_tokens={rdma_send} must be at most half of "
             f"num_max_rdma_chunked_recv_tokens={num_max_rdma_chunked_recv_tokens} (rounded "
             f"up to a multiple of the send chunk: {rdma_recv})"),
        ) if not ok]
        if bad:
            raise ValueError("llcomm.deep_ep.Config: " + "; ".join(bad))
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = rdma_send
        self.num_max_rdma_chunked_recv_tokens = rdma_recv

    @property
    def num_channels(self) -> int:
        """DeepEP's channels: one per two SMs."""
        return self.num_sms // 2

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink buffer the normal mode needs: 0, as llcomm's normal mode keeps no
        buffer of its own (each call's tensors come from torch's allocator). Engines take the
        max of this and their own figure, so 0 leaves their budget as it is."""
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of RDMA buffer the normal mode needs: 0, for the same reason."""
        return 0

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, nvl_send={self.num_max_nvl_chunked_send_tokens}"
                f", nvl_recv={self.num_max_nvl_chunked_recv_tokens}, rdma_send="
                f"{self.num_max_rdma_chunked_send_tokens}, rdma_recv="
                f"{self.num_max_rdma_chunked_recv_tokens})")

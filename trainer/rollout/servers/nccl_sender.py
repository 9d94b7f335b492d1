"""Sender end of vLLM's built-in "nccl" backend, for servers on GPUs (``ServerWeightSender(backend="nccl")``).

UNTESTED: written against vLLM 0.32's ``nccl_common`` / ``nccl_engine`` but never run (no GPU where it
was written). It uses vLLM's own trainer endpoint (``nccl_common.trainer_init``, a PyNccl communicator
over a stateless TCPStore rendezvous) and the unpacked wire mode (one NCCL broadcast per tensor, in the
order of the bucket's update info), so each bucket is self-contained like the gloo one. Imports vLLM.
"""
import socket
from concurrent.futures import Future

import torch
from vllm.distributed.weight_transfer.nccl_common import (NCCLWeightTransferInitInfo, trainer_init,
                                                          worker_init_payload)

from polyfsdp.trainer.rollout.servers.http import wait_all


def _free_port(address: str) -> int:
    # vLLM's rendezvous takes a fixed port (it cannot report one it picked), so pick it here.
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


class NcclSender:
    def __init__(self, master_address: str, master_port: int, world_size: int):
        self.address, self.world_size = master_address, world_size
        self.port = master_port or _free_port(master_address)
        # Read here, on the caller's thread: connect() runs on another, whose current device is 0.
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.group = None

    def worker_init_info(self, rank_offset: int) -> dict:
        return worker_init_payload(NCCLWeightTransferInitInfo(
            master_address=self.address, master_port=self.port, rank_offset=rank_offset,
            world_size=self.world_size, packed=False))

    def connect(self) -> None:
        torch.cuda.set_device(self.device)
        self.group = trainer_init(dict(master_address=self.address, master_port=self.port,
                                       world_size=self.world_size), rank=0)

    def send(self, tensors: list[torch.Tensor], requests: list[Future]) -> int:
        stream = torch.cuda.current_stream()
        sent = 0
        for tensor in tensors:
            # NCCL reads numel elements from data_ptr(): a non-contiguous view would send other bytes.
            data = tensor.detach().to(self.device).contiguous()
            self.group.broadcast(data, src=0, stream=stream)
            sent += data.numel() * data.element_size()
        stream.synchronize()
        wait_all(requests)
        return sent

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None

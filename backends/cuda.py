"""The CUDA backend (NVIDIA GPUs, NCCL)."""
from __future__ import annotations

import importlib.util
import socket

import torch

from .base import Backend

FLASH_ATTN_DTYPES = (torch.bfloat16, torch.float16)


class CUDABackend(Backend):
    """NVIDIA GPUs through torch.cuda."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    # Without flash-attn, or for fp32 compute: polyfsdp's per-sequence SDPA (varlen-equivalent).
    default_attn_implementation = "polyfsdp_varlen_sdpa"
    alloc_conf_variable = "PYTORCH_CUDA_ALLOC_CONF"
    server_devices_variable = "CUDA_VISIBLE_DEVICES"
    # vLLM's own NCCL engine: the weights go GPU to GPU (untested here: no GPU in CI).
    server_weight_transfer = "nccl"

    def availability(self) -> str | None:
        if not torch.cuda.is_available():
            if torch.version.cuda is None:
                return "this torch build has no CUDA support (CPU-only wheel)"
            return "torch has CUDA support but no GPU is visible (check the driver and CUDA_VISIBLE_DEVICES)"
        return None

    def attn_implementation(self, compute_dtype: torch.dtype) -> str:
        # Varlen flash attention where installed, but only for half-precision compute: FA2
        # kernels take fp16/bf16 only, and transformers would hand them fp32 tensors.
        if compute_dtype in FLASH_ATTN_DTYPES and importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
        return self.default_attn_implementation

    def compile_unsupported(self) -> str | None:
        # Inductor turns the compiled code into Triton kernels on NVIDIA GPUs.
        if importlib.util.find_spec("triton") is None:
            return "torch.compile on CUDA needs triton (pip install triton)"
        return None

    def weight_transfer_sender(self, master_address: str, master_port: int, world_size: int):
        return VllmNcclSender(master_address, master_port, world_size)


def _free_port(address: str) -> int:
    # vLLM's rendezvous takes a fixed port (it cannot report one it picked), so pick it here.
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


class VllmNcclSender:
    """The trainer's end of vLLM's built-in "nccl" weight-transfer backend, for rollout servers on
    GPUs (trainer/rollout/servers/weight_sender.py): rank 0 of vLLM's NCCL transfer group, the
    servers' workers the other ranks. UNTESTED: written against vLLM 0.32's ``nccl_common`` but never
    run (no GPU where it was written). vLLM's own trainer endpoint (``nccl_common.trainer_init``, a
    PyNccl communicator over a stateless TCPStore rendezvous) in the unpacked wire mode: one NCCL
    broadcast per tensor, in the order of the bucket's update info."""

    def __init__(self, master_address: str, master_port: int, world_size: int):
        self.address, self.world_size = master_address, world_size
        self.port = master_port or _free_port(master_address)
        # Read here, on the caller's thread: connect() runs on another, whose current device is 0.
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.group = None

    def worker_init_info(self, rank_offset: int) -> dict:
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

        return worker_init_payload(NCCLWeightTransferInitInfo(
            master_address=self.address, master_port=self.port, rank_offset=rank_offset,
            world_size=self.world_size, packed=False))

    def connect(self) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        torch.cuda.set_device(self.device)
        self.group = trainer_init(dict(master_address=self.address, master_port=self.port,
                                       world_size=self.world_size), rank=0)

    def send(self, tensors: list[torch.Tensor], requests: list) -> int:
        """Broadcast ``tensors`` to the workers of the servers' ``requests`` (/update_weights, in
        flight), then wait for those answers (a server's error raises here)."""
        stream = torch.cuda.current_stream()
        sent = 0
        for tensor in tensors:
            # NCCL reads numel elements from data_ptr(): a non-contiguous view would send other bytes.
            data = tensor.detach().to(self.device).contiguous()
            self.group.broadcast(data, src=0, stream=stream)
            sent += data.numel() * data.element_size()
        stream.synchronize()
        for request in requests:
            request.result()
        return sent

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None

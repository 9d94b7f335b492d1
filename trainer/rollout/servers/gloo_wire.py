"""The "polyfsdp_cpu" wire format, shared by the trainer (sender) and the vLLM workers (receivers).

A bucket travels as one uint8 buffer: each tensor's bytes in order, each starting at a multiple of
ALIGN so the receiver can view a slice as any dtype without a copy. Bytes, not typed tensors, because
gloo has no bfloat16 broadcast and one buffer per bucket is one collective instead of one per tensor.
Neither side may import the other's stack (the trainer runs without vLLM, the workers without the
trainer), so this module needs torch only.
"""
from datetime import timedelta

import torch
import torch.distributed as dist

BACKEND = "polyfsdp_cpu"  # the name servers and trainer know this backend by (--weight-transfer-config)
ALIGN = 16  # >= the largest element size (complex128), so every slice is viewable as its dtype


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16 -> "bfloat16"``: the spelling vLLM's update info carries (``getattr(torch, name)``)."""
    return str(dtype).removeprefix("torch.")


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def packed_size(dtype_names: list[str], shapes: list[list[int]]) -> int:
    """Bytes of the buffer that carries tensors of these dtypes and shapes."""
    return sum(_padded(torch.Size(s).numel() * getattr(torch, d).itemsize) for d, s in zip(dtype_names, shapes))


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous CPU uint8 buffer holding every tensor's bytes (layout in the module docstring)."""
    total = sum(_padded(t.numel() * t.element_size()) for t in tensors)
    buffer = torch.zeros(total, dtype=torch.uint8)
    offset = 0
    for t in tensors:
        raw = t.detach().reshape(-1).contiguous().view(torch.uint8)
        buffer[offset:offset + raw.numel()].copy_(raw)  # copy_ also moves a GPU tensor to the CPU
        offset += _padded(raw.numel())
    return buffer


def unpack(buffer: torch.Tensor, dtype_names: list[str], shapes: list[list[int]]) -> list[torch.Tensor]:
    """Views into ``buffer`` (no copies): the tensors ``pack`` put there."""
    out, offset = [], 0
    for name, shape in zip(dtype_names, shapes):
        dtype = getattr(torch, name)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        out.append(buffer[offset:offset + nbytes].view(dtype).view(shape))
        offset += _padded(nbytes)
    if offset != buffer.numel():
        raise ValueError(f"buffer holds {buffer.numel()} bytes, the tensors described take {offset}")
    return out


def master_store(address: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store on the sender; port 0 binds a free port (read it from ``.port``)."""
    return dist.TCPStore(address, port, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_group(store: dist.Store | None, address: str, port: int, rank: int, world_size: int,
               timeout_s: float) -> dist.ProcessGroupGloo:
    """A gloo group of its own (no ``init_process_group``: the trainer and vLLM's workers already have a
    default group). Blocks until all ``world_size`` ranks joined. Ranks other than the sender pass
    ``store=None`` and connect to the sender's store as clients."""
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def broadcast(group: dist.ProcessGroupGloo, buffer: torch.Tensor) -> dist.Work:
    """Start broadcasting ``buffer`` from rank 0 (returns the work to ``wait()`` on)."""
    return group.broadcast(buffer, 0)

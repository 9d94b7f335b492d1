"""Shared pieces of the torchrun workers that send every rank's results back to a test."""
import os

import torch


def full_grads(module):
    """Unsharded copies of every parameter's gradient of an FSDP2 module."""
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in module.named_parameters()}


def save_every_rank(results, path):
    """Gather every rank's ``results`` (picklable) and save the list, in rank order, from rank 0."""
    gathered = [None] * int(os.environ["WORLD_SIZE"])
    torch.distributed.all_gather_object(gathered, results)
    if int(os.environ["RANK"]) == 0:
        torch.save(gathered, path)

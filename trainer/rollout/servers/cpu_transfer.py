"""The vLLM worker side of the "polyfsdp_cpu" weight-transfer backend (vLLM's built-in ones need GPUs).

Loaded inside the vLLM server's worker processes (registered by ``vllm_plugin.register``), so it uses
vLLM, the wire format and the reload the colocated engine runs too (trainer/rollout/vllm_adapter.py),
never the trainer's state. The trainer side is ``weight_sender.ServerWeightSender``.
The classes subclass vLLM's, so they are built at first use (``CpuWeightTransferEngine``, looked up
by vLLM's factory): the module itself imports without vLLM, as every polyfsdp module must.
"""
import logging
from dataclasses import dataclass

import torch

from polyfsdp.trainer.rollout import vllm_adapter
from polyfsdp.trainer.rollout.servers import gloo_wire

logger = logging.getLogger(__name__)

BACKEND = gloo_wire.BACKEND


def __getattr__(name: str):
    if name != "CpuWeightTransferEngine":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    engine = _engine_class()
    globals()[name] = engine
    return engine


def _engine_class():
    from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)

    @dataclass
    class CpuTransferInitInfo(WeightTransferInitInfo):
        """Where the sender's store listens and which ranks this server's workers take in the group."""

        master_address: str
        master_port: int
        rank_offset: int  # the group rank of this server's first worker (the sender is rank 0)
        world_size: int   # the sender plus every worker of every server
        timeout_s: float = 600.0


    @dataclass
    class CpuTransferUpdateInfo(WeightTransferUpdateInfo):
        """One bucket: the tensors, in the order their bytes lie in the broadcast buffer."""

        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]
        # The sync's last message, no tensors: fail naming the layers that got none or part of their
        # weights. Here, not in finish_weight_update: the worker ends an update whose update_weights
        # raised, but one whose finish raised stays open, and the server then refuses every later one.
        check: bool = False

        def __post_init__(self):
            lengths = {len(self.names), len(self.dtype_names), len(self.shapes)}
            if len(lengths) != 1:
                raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                                 f"{len(self.dtype_names)}, {len(self.shapes)}")


    class CpuWeightTransferEngine(WeightTransferEngine[CpuTransferInitInfo, CpuTransferUpdateInfo]):
        """Receives each bucket as one gloo broadcast from rank 0 and loads it in vLLM's checkpoint format
        (``model.load_weights``) inside one layerwise reload for the sync, like vLLM's NCCL engine; the
        sync's check message fails naming the layers left without weights (trainer/rollout/vllm_adapter.py)."""

        init_info_cls = CpuTransferInitInfo
        update_info_cls = CpuTransferUpdateInfo

        def __init__(self, config, vllm_config, device, model) -> None:
            super().__init__(config, vllm_config, device, model)
            self.group = None

        def init_transfer_engine(self, init_info: CpuTransferInitInfo) -> None:
            if self.group is not None:
                self.shutdown()
            # As vLLM's nccl_common does: a rank unique across data-parallel replicas, then offset past the
            # sender and the servers before this one.
            config = self.parallel_config
            worker = config.data_parallel_index * config.world_size + config.rank
            self.group = gloo_wire.join_group(None, init_info.master_address, init_info.master_port,
                                              init_info.rank_offset + worker, init_info.world_size,
                                              init_info.timeout_s)

        def start_weight_update(self) -> None:
            vllm_adapter.begin_reload(self.model)

        def finish_weight_update(self) -> None:
            missing = vllm_adapter.finish_reload(self.model, self.model_config)
            if missing:  # a sender that made no check: the server's log names the layers at least
                logger.warning("polyfsdp_cpu weight update: %s", vllm_adapter.unloaded_message(missing))

        def update_weights(self, update_info: dict) -> None:
            # The base class ends with torch.accelerator.synchronize(), which raises on a machine without
            # an accelerator; gloo's wait() below has already synchronized.
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info: CpuTransferUpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError("polyfsdp_cpu weight transfer is not initialized: "
                                   "POST /init_weight_transfer_engine first")
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

            if update_info.check:
                missing = vllm_adapter.unloaded_layers(self.model)
                if missing:
                    # Serve the previous weights where none came (the reload left those layers empty).
                    vllm_adapter.finish_reload(self.model, self.model_config)
                    raise RuntimeError(vllm_adapter.unloaded_message(missing))
                return
            buffer = torch.empty(gloo_wire.packed_size(update_info.dtype_names, update_info.shapes),
                                 dtype=torch.uint8)
            gloo_wire.broadcast(self.group, buffer).wait()
            tensors = gloo_wire.unpack(buffer, update_info.dtype_names, update_info.shapes)
            # A bucket is part of a model, not a whole checkpoint: skip the draft-layer completeness check.
            with disable_mtp_completeness_check():
                self.model.load_weights(list(zip(update_info.names, tensors)))

        def shutdown(self) -> None:
            if self.group is not None:
                self.group.shutdown()
                self.group = None

    return CpuWeightTransferEngine

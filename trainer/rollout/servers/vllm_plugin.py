"""vLLM general plugin (entry point group ``vllm.general_plugins``, see pyproject.toml): makes the
"polyfsdp_cpu" weight-transfer backend known in every vLLM process, so a server started with
``--weight-transfer-config '{"backend": "polyfsdp_cpu"}'`` finds it, and drops the traceback vLLM
logs at start-up for a chat-template warmup without a tokenizer (the servers run with
``--skip-tokenizer-init``; trainer/rollout/vllm_adapter.py says why it is harmless)."""

from .gloo_wire import BACKEND  # not from cpu_transfer, which would load the engine at start-up


def register() -> None:
    """Idempotent (vLLM may call plugins more than once per process). Registers by module path, so the
    engine module is imported only in a worker that creates the engine."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from ..vllm_adapter import drop_tokenizerless_warmup_failure

    drop_tokenizerless_warmup_failure()

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "polyfsdp.trainer.rollout.servers.cpu_transfer",
                                                    "CpuWeightTransferEngine")

"""vLLM general plugin (entry point group ``vllm.general_plugins``, see pyproject.toml): makes the
"polyfsdp_cpu" weight-transfer backend known in every vLLM process, so a server started with
``--weight-transfer-config '{"backend": "polyfsdp_cpu"}'`` finds it, and drops the traceback vLLM
logs at start-up for a chat-template warmup without a tokenizer (the servers run with
``--skip-tokenizer-init``; trainer/rollout/vllm_adapter.py says why it is harmless), and puts
polyfsdp's classes for the vision-language models it serves in place of vLLM's (vllm_vision.py)."""

from .gloo_wire import BACKEND  # not from cpu_transfer, which would load the engine at start-up

# The vision-language architectures vLLM serves for polyfsdp -> vllm_vision.py's class for each.
VISION_MODELS = {"Qwen2VLForConditionalGeneration": "PolyfsdpQwen2VL",
                 "Qwen2_5_VLForConditionalGeneration": "PolyfsdpQwen2_5VL"}


def register() -> None:
    """Idempotent (vLLM may call plugins more than once per process). Registers by module path, so the
    engine module is imported only in a worker that creates the engine."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from ..vllm_adapter import drop_tokenizerless_warmup_failure

    drop_tokenizerless_warmup_failure()
    register_vision_models()

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "polyfsdp.trainer.rollout.servers.cpu_transfer",
                                                    "CpuWeightTransferEngine")


def register_vision_models() -> None:
    """vllm_vision.py's classes for their architectures, by module path (imported only when one is served)."""
    from vllm import ModelRegistry

    for architecture, name in VISION_MODELS.items():
        ModelRegistry.register_model(architecture, f"polyfsdp.trainer.rollout.servers.vllm_vision:{name}")

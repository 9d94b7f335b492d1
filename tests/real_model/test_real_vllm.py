"""vLLM (``rollout.engine=vllm``) on the real model: its greedy completions of chat prompts with a
system message equal the built-in decoding loop's token for token (fp32, 30 layers, tied
embeddings, ``<|im_end|>`` ending rows); a weight sync (several buckets) lands every parameter and
logs nothing about loading. Runs in CI's vLLM stage (.ci/run); skips without vLLM."""
import pytest
import torch

from polyfsdp.backends.registry import get_backend
from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig
from polyfsdp.trainer.config.sections import RolloutSection
from polyfsdp.trainer.data.tokenizers import load_tokenizer
from polyfsdp.trainer.rollout.build import build_rollout_engine
from polyfsdp.trainer.rollout.engines import PolicyDecoding, SamplingParams
from tests.helpers.vllm_cases import LOAD_WARNINGS, require_vllm, vllm_differences, vllm_log

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
QUESTIONS = ["What is the capital of France?", "Say hello.", "Name three colours.", "What is 2 plus 2?"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def vllm_and_policy(real_model_dir):
    require_vllm()
    policy = FSDPEngine(ModelConfig(path=real_model_dir), EngineConfig()).initialize()
    engine = build_rollout_engine(RolloutSection(engine="vllm"), get_backend())
    yield engine, policy
    engine.close()


def test_greedy_chat_completions_equal_the_builtin_loop(vllm_and_policy, real_model_dir):
    vllm, policy = vllm_and_policy
    tok = load_tokenizer(real_model_dir)
    hf = tok.tok
    assert tok.eos_token_id == hf.convert_tokens_to_ids("<|im_end|>")  # rows stop at the end of the turn
    prompts = [list(hf.apply_chat_template([SYSTEM, {"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)) for q in QUESTIONS]
    params = SamplingParams.for_tokenizer(tok, NEW_TOKENS, greedy=True)
    builtin = PolicyDecoding("builtin")
    builtin.update_weights(policy)
    ours = builtin.generate(prompts, params).token_ids
    vllm.update_weights(policy)
    theirs = vllm.generate(prompts, params).token_ids
    assert theirs == ours, (ours, theirs)


def test_a_sync_lands_every_parameter_without_a_warning(vllm_and_policy):
    """The sync that wrote ~1,290 lines of vLLM's "Failed to load weights" and 8 sets of "weights were
    not loaded" (a reload per 64 MB bucket, each warning about everything outside it), and a
    start-up traceback: now silent, and every parameter vLLM serves with is the policy's."""
    vllm, policy = vllm_and_policy
    with vllm_log() as logged:
        vllm.update_weights(policy)  # the start, unless the test before ran
        with torch.no_grad():
            for param in policy.module.parameters():
                param.mul_(1.01)
        policy.weights_version += 1  # what an optimizer step does
        vllm.update_weights(policy)
    noise = [line for line in logged if any(w in line for w in LOAD_WARNINGS) or "Traceback" in line]
    assert not noise, noise[:3]
    assert not vllm_differences(vllm.llm, policy)

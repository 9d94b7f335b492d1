"""vLLM (``rollout.engine=vllm``) on the real model: its greedy completions of chat prompts with a
system message equal the built-in decoding loop's token for token (fp32, 30 layers, tied
embeddings, ``<|im_end|>`` ending rows). Runs in CI's vLLM stage (.ci/run); skips without vLLM."""
import pytest

from polyfsdp.backends.registry import get_backend
from polyfsdp.engines import EngineConfig, FSDPEngine, ModelConfig
from polyfsdp.trainer.config.job import RolloutSection
from polyfsdp.trainer.data.tokenizers import load_tokenizer
from polyfsdp.trainer.rollout.build import build_rollout_engine
from polyfsdp.trainer.rollout.engines import PolicyDecoding, SamplingParams
from vllm_cases import require_vllm

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

"""``--estimate`` of a multi-turn job (trainer/run/estimate_turns.py): SFT sequences are the
demonstrations' conversations, and sampled conversations are bounded by the prompt,
rollout.max_turns turns of max_new_tokens and the environment's turns, capped by the total
token budget. Expected lengths are counted by hand from the character tokenizer's chat text."""
import json

from tests.helpers import HELPERS
from polyfsdp.trainer.config.job import load_config
from polyfsdp.trainer.run.estimate import estimate_job
from polyfsdp.trainer.data.tokenizers import CharTokenizer

NEW = 80


def _demonstration(a, b):
    call = '<tool_call>{"name":"calculator","arguments":{"expression":"%d*%d"}}</tool_call>' % (a, b)
    return [{"role": "user", "content": f"{a}*{b}"}, {"role": "assistant", "content": call},
            {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": str(a * b)}]


def _estimate(tmp_path, records, *extra):
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    # One training record (the first), one held out; one SFT row, one prompt x 2 completions.
    cfg = load_config(["data=files", f"data.train_files=[{path}]", "data.eval_size=1", "rollout.env=calculator",
                       "rollout.max_turns=2", f"algo.actor.max_new_tokens={NEW}", "trainer.sft_steps=1",
                       "trainer.sft_batch_size=1", "trainer.rl_steps=1", "trainer.prompts_per_step=1",
                       "algo.actor.group_size=2", *extra])
    est = estimate_job(cfg, world_size=1)
    return {(phase, s.name): s for phase, steps in est.steps.items() for s in steps}, est.notes


def _prompt_tokens(a, b):
    return 1 + len(CharTokenizer.chat_text(_demonstration(a, b)[:1]))  # <bos>, "[user] ... [assistant] "


def test_sft_counts_the_demonstration_and_rollouts_count_every_turn(tmp_path):
    steps, notes = _estimate(tmp_path, [{"messages": _demonstration(17, 23)}, {"messages": _demonstration(45, 67)}])
    # The whole conversation's chat text; the spaces after the two assistant turns are their <eos>, plus <bos>.
    sft = len(CharTokenizer.chat_text(_demonstration(17, 23), add_generation_prompt=False)) + 1
    assert (steps["sft", "update micro-batch"].rows, steps["sft", "update micro-batch"].tokens) == (1, sft)
    # The longest environment turn of the demonstrations: 45*67's result and the next generation prompt.
    env_turn = len("[tool] 3015 [assistant] ")
    conversation = _prompt_tokens(17, 23) + 2 * NEW + env_turn
    for name in ("rollout generation (KV cache)", "old/ref log-prob pass (no grad)", "actor update micro-batch"):
        assert (steps["grpo", name].rows, steps["grpo", name].tokens) == (2, 2 * conversation), name
    held_out = steps["grpo", "held-out evaluation (generation)"]
    assert (held_out.rows, held_out.tokens) == (1, _prompt_tokens(45, 67) + 2 * NEW + env_turn)
    assert any(f"1 environment turn(s) of at most {env_turn} tokens" in n for n in notes)


def test_the_total_token_budget_caps_a_conversation(tmp_path):
    records = [{"messages": _demonstration(17, 23)}, {"messages": _demonstration(45, 67)}]
    steps, _ = _estimate(tmp_path, records, "rollout.max_total_tokens=150")
    assert steps["grpo", "rollout generation (KV cache)"].tokens == 2 * 150
    # Without demonstrations an environment turn's length is unknown: the cap bounds the conversation.
    plain = [{"prompt": "17*23", "answer": "391"}, {"prompt": "45*67", "answer": "3015"}]
    steps, notes = _estimate(tmp_path, plain, "rollout.max_total_tokens=300")
    assert steps["grpo", "actor update micro-batch"].tokens == 2 * 300
    assert any("unknown length" in n for n in notes)
    # SFT trains those records on their direct answers after the environment's opening: the
    # prompt as a chat turn, then the answer and <eos>.
    assert steps["sft", "update micro-batch"].tokens == _prompt_tokens(17, 23) + len("391") + 1


def test_an_agents_conversations_are_counted_at_the_token_budget(tmp_path):
    """rollout.agent: the agent writes its prompts and turns, so the cap bounds a conversation;
    SFT is prompt -> answer, as in a single-turn job."""
    import os

    agent = os.path.join(HELPERS, "envs", "agents.py") + ":guess"
    plain = [{"prompt": "17*23", "answer": "391"}, {"prompt": "45*67", "answer": "3015"}]
    steps, notes = _estimate(tmp_path, plain, "rollout.env=null", f"rollout.agent={agent}",
                             "rollout.max_total_tokens=300")
    for name in ("rollout generation (KV cache)", "actor update micro-batch"):
        assert steps["grpo", name].tokens == 2 * 300, name
    assert steps["sft", "update micro-batch"].tokens == 1 + len("17*23") + len("391") + 1  # <bos>, <eos>
    assert any(n.startswith(f"rollout.agent={agent}: the agent writes") and "counted at that cap, 300" in n
               for n in notes), notes

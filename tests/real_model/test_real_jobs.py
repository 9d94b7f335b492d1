"""``polyfsdp-train`` on the real model, named by its GGUF file: one SFT step then one GRPO step
(2 completions of 4 new tokens, chat prompts with a system message), and the export it writes
loads in transformers with the chat template and answers a chat prompt. One run for both: a
real-model step costs about a minute on 2 CPU cores."""
import json
import math
import os
import subprocess

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer in one word."}
QUESTIONS = [("What is the capital of France?", "Paris"), ("What color is the sky on a clear day?", "Blue"),
             ("What is the opposite of hot?", "Cold")]
JOB = ["trainer.sft_steps=1", "trainer.rl_steps=1", "trainer.sft_batch_size=2", "trainer.prompts_per_step=1",
       "algo.actor.group_size=2", "algo.actor.max_new_tokens=4", "data.eval_size=1", "trainer.progress=off",
       "trainer.plot=false",
       "trainer.checkpoint_interval=0"]  # a checkpoint of 135M parameters and their AdamW state is 1.6 GB


def _records(path):
    rows = [{"data_source": "toy", "prompt": [SYSTEM, {"role": "user", "content": q}],
             "reward_model": {"style": "rule", "ground_truth": a}, "extra_info": {"index": i}}
            for i, (q, a) in enumerate(QUESTIONS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def run_dir(real_model_dir, gguf_file, tmp_path_factory):
    """The job's output directory; the GGUF path resolves to the session's converted cache
    (``POLYFSDP_CACHE``, set by ``real_model_dir``), so nothing converts again."""
    tmp = tmp_path_factory.mktemp("real-job")
    data = _records(tmp / "train.jsonl")
    out = tmp / "out"
    done = subprocess.run(["polyfsdp-train", f"model.path={gguf_file}", "data=files", f"data.train_files=[{data}]",
                           "reward.fn=exact_match", f"trainer.output_dir={out}", *JOB],
                          capture_output=True, text=True, env=dict(os.environ), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_one_sft_and_one_grpo_step_run(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    phases = [r["phase"] for r in records]
    assert phases.count("sft") == 1 and phases.count("rl") == 1, phases
    rl = next(r for r in records if r["phase"] == "rl")
    sft = next(r for r in records if r["phase"] == "sft")
    assert math.isfinite(rl["loss"]) and math.isfinite(sft["loss"])


def test_export_loads_keeps_the_chat_template_and_answers(run_dir, real_model_dir):
    final = run_dir / "final"
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.chat_template == AutoTokenizer.from_pretrained(real_model_dir).chat_template
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    ids = tok.apply_chat_template([SYSTEM, {"role": "user", "content": QUESTIONS[0][0]}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer.strip(), answer

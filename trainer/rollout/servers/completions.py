"""Sampling through rollout servers' OpenAI ``/v1/completions`` route, token ids in and out.

One request per row, each with the row's seed, so what a row draws depends on its prompt, its
seed and the weights only, not on which server answers or what else it batches (as far as
vLLM's batch invariance goes). Rows spread over the servers round-robin and run concurrently
(each server batches what is in flight); results come back in row order.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .http import ServerError, ServerHttp


def completion_request(model: str, prompt: list[int], params, seed: int) -> dict:
    """The ``/v1/completions`` body of one row (``params``: the engines' SamplingParams). Stop
    strings are not sent: the servers run without a tokenizer (``--skip-tokenizer-init``, vLLM
    refuses them there), the engine cuts at them (trainer/rollout/controls/stop_strings.py)."""
    return {"model": model, "prompt": list(prompt), "max_tokens": params.max_new_tokens,
            "temperature": 0.0 if params.greedy else float(params.temperature), "top_p": float(params.top_p),
            "top_k": int(params.top_k), "repetition_penalty": float(params.repetition_penalty),
            "seed": int(seed), "stop_token_ids": list(params.stop_token_ids), "skip_special_tokens": False,
            "return_token_ids": True, "logprobs": 0 if params.return_log_probs else None,
            # without a tokenizer on the server, log-probs need their tokens named by id
            "return_tokens_as_token_ids": True}


def parse_completion(answer, want_log_probs: bool, where: str) -> tuple[list[int], list[float] | None]:
    """The new token ids (and their log-probs) of a ``/v1/completions`` answer; ServerError
    naming ``where`` when the answer lacks them or they disagree in length."""
    try:
        choice = answer["choices"][0]
        tokens = [int(t) for t in choice["token_ids"]]
        log_probs = [float(x) for x in choice["logprobs"]["token_logprobs"]] if want_log_probs else None
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ServerError(f"{where}: a completion without token ids or log-probs ({type(exc).__name__}: {exc}); "
                          f"is it a vLLM OpenAI server (>= 0.32) started as docs/rollouts-and-servers.md's "
                          f"rollout-servers section says?") from None
    if log_probs is not None and len(log_probs) != len(tokens):
        raise ServerError(f"{where}: {len(tokens)} token ids but {len(log_probs)} log-probs in one completion")
    return tokens, log_probs


def prompt_log_probs(http: ServerHttp, model: str, ids: list[int]) -> list[float]:
    """``log p(ids[t] | ids[:t])`` for t >= 1 at temperature 1, from the server's prompt log-probs."""
    answer = http.request("/v1/completions", {"model": model, "prompt": list(ids), "max_tokens": 1,
                                              "temperature": 1.0, "seed": 0, "prompt_logprobs": 0,
                                              "return_token_ids": True})
    try:
        steps = answer["choices"][0]["prompt_logprobs"][1:]
        return [float(step[str(tok)]["logprob"]) for step, tok in zip(steps, ids[1:], strict=True)]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ServerError(f"{http.name} ({http.url}): prompt log-probs missing from its answer "
                          f"({type(exc).__name__}: {exc})") from None


def sample_rows(servers: list[ServerHttp], model: str, prompts: list[list[int]], params, seeds: list[int],
                pool: ThreadPoolExecutor, first_server: int = 0):
    """Completions (and log-probs when ``params.return_log_probs``) of every prompt, row ``i``
    on server ``(first_server + i) % len(servers)``."""

    def one(i: int):
        http = servers[(first_server + i) % len(servers)]
        answer = http.request("/v1/completions", completion_request(model, prompts[i], params, seeds[i]))
        return parse_completion(answer, params.return_log_probs, f"{http.name} ({http.url})")

    results = list(pool.map(one, range(len(prompts))))
    tokens = [r[0] for r in results]
    return tokens, ([r[1] for r in results] if params.return_log_probs else None)

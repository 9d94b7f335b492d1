"""Sampling through rollout servers, token ids in and out: text prompts through the OpenAI
``/v1/completions`` route, prompts with images through vLLM's token-in route
``/inference/v1/generate`` (``/v1/completions`` takes no images), which takes the token ids with
the images beside them as PNG data URLs (lossless: the server's processor sees the pixels the
trainer's saw).

One request per row, each with the row's seed, so what a row draws depends on its prompt, its
seed and the weights only, not on which server answers or what else it batches (as far as
vLLM's batch invariance goes). Rows spread over the servers round-robin and run concurrently
(each server batches what is in flight); results come back in row order.
"""
from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

from .http import ServerError, ServerHttp
from .vision_serving import collapse_image_runs

GENERATE_ROUTE = "/inference/v1/generate"


def _sampling(params, seed: int, allowed_token_ids: list[int] | None) -> dict:
    """The sampling fields both routes share (``params``: the engines' SamplingParams)."""
    return {"max_tokens": params.max_new_tokens, "temperature": 0.0 if params.greedy else float(params.temperature),
            "top_p": float(params.top_p), "top_k": int(params.top_k),
            "repetition_penalty": float(params.repetition_penalty), "seed": int(seed),
            "stop_token_ids": list(params.stop_token_ids), "skip_special_tokens": False,
            "logprobs": 0 if params.return_log_probs else None,
            **({} if allowed_token_ids is None else {"allowed_token_ids": list(allowed_token_ids)})}


def completion_request(model: str, prompt: list[int], params, seed: int,
                       allowed_token_ids: list[int] | None = None) -> dict:
    """The ``/v1/completions`` body of one row. Stop strings are not sent: a text model's servers
    run without a tokenizer (``--skip-tokenizer-init``, vLLM refuses them there), the engine cuts
    at them (trainer/rollout/controls/stop_strings.py). ``allowed_token_ids``: the tokens sampling
    may draw (a vision-language policy's: all but its placeholders), None: all."""
    return {"model": model, "prompt": list(prompt), **_sampling(params, seed, allowed_token_ids),
            "return_token_ids": True,
            # without a tokenizer on the server, log-probs need their tokens named by id
            "return_tokens_as_token_ids": True}


def png_data_url(picture) -> str:
    """``picture`` (a PIL image) as the trainer's processor took it (RGB), in a lossless data URL."""
    buffer = io.BytesIO()
    picture.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def image_request(model: str, prompt: list[int], pictures: list, params, seed: int, image_token_id: int,
                  allowed_token_ids: list[int] | None) -> dict:
    """The ``/inference/v1/generate`` body of one row whose prompt holds ``pictures``: each image's
    run of placeholders written once (the server's processor expands it again, and the answer's
    ``prompt_token_ids`` say how: :func:`parse_image_answer` checks them against ``prompt``)."""
    return {"model": model, "token_ids": collapse_image_runs(list(prompt), image_token_id),
            "content_parts": [{"type": "image_url", "url": png_data_url(p)} for p in pictures],
            "sampling_params": {**_sampling(params, seed, allowed_token_ids), "detokenize": False},
            "return_token_ids": True}


def parse_image_answer(answer, prompt: list[int], image_token_id: int, want_log_probs: bool,
                       where: str) -> tuple[list[int], list[float] | None]:
    """The new token ids (and their log-probs) of a ``/inference/v1/generate`` answer; ServerError
    naming ``where`` when they are missing, or when the server's processor made other image tokens
    of the prompt's images than the trainer's (another processor: nothing sampled would match)."""
    try:
        served = [int(t) for t in answer["prompt_token_ids"]]
        choice = answer["choices"][0]
        tokens = [int(t) for t in choice["token_ids"]]
        log_probs = [float(step["logprob"]) for step in choice["logprobs"]["content"]] if want_log_probs else None
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ServerError(f"{where}: an answer without token ids or log-probs ({type(exc).__name__}: {exc}); is it a "
                          f"vLLM server (>= 0.32) started with --enable-scale-out, as docs/rollouts-and-servers.md "
                          f"says for vision-language models?") from None
    if served != list(prompt):
        raise ServerError(f"{where}: the server's processor made {served.count(image_token_id)} image tokens of the "
                          f"prompt's images ({len(served)} prompt tokens), the trainer's {list(prompt).count(image_token_id)} "
                          f"({len(prompt)}): it must serve the run's processor (the directory polyfsdp writes holds it)")
    if log_probs is not None and len(log_probs) != len(tokens):
        raise ServerError(f"{where}: {len(tokens)} token ids but {len(log_probs)} log-probs in one completion")
    return tokens, log_probs


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


def prompt_log_probs(http: ServerHttp, model: str, ids: list[int], picture=None,
                     image_token_id: int | None = None) -> list[float]:
    """``log p(ids[t] | ids[:t])`` for t >= 1 at temperature 1, from the server's prompt log-probs;
    ``picture``: the one image ``ids`` holds (its placeholders ``image_token_id``)."""
    sampling = {"max_tokens": 1, "temperature": 1.0, "seed": 0, "prompt_logprobs": 0}
    if picture is None:
        answer = http.request("/v1/completions", {"model": model, "prompt": list(ids), "return_token_ids": True,
                                                  **sampling})
    else:
        answer = http.request(GENERATE_ROUTE, {"model": model, "token_ids": collapse_image_runs(ids, image_token_id),
                                               "content_parts": [{"type": "image_url", "url": png_data_url(picture)}],
                                               "sampling_params": {**sampling, "detokenize": False},
                                               "return_token_ids": True})
        parse_image_answer(answer, ids, image_token_id, False, f"{http.name} ({http.url})")
    try:
        steps = (answer["choices"][0] if picture is None else answer)["prompt_logprobs"][1:]
        return [float(step[str(tok)]["logprob"]) for step, tok in zip(steps, ids[1:], strict=True)]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ServerError(f"{http.name} ({http.url}): prompt log-probs missing from its answer "
                          f"({type(exc).__name__}: {exc})") from None


def sample_rows(servers: list[ServerHttp], model: str, prompts: list[list[int]], params, seeds: list[int],
                pool: ThreadPoolExecutor, first_server: int = 0, pictures: list | None = None, vision=None):
    """Completions (and log-probs when ``params.return_log_probs``) of every prompt, row ``i``
    on server ``(first_server + i) % len(servers)``; ``pictures``: per prompt its images or None
    (servers/vision_serving.py: prompt_pictures); ``vision``: a vision-language policy's VisionServing."""
    allowed = None if vision is None else vision.allowed_token_ids

    def one(i: int):
        http = servers[(first_server + i) % len(servers)]
        where = f"{http.name} ({http.url})"
        if pictures is not None and pictures[i]:
            answer = http.request(GENERATE_ROUTE, image_request(model, prompts[i], pictures[i], params, seeds[i],
                                                                vision.image_token_id, allowed))
            return parse_image_answer(answer, prompts[i], vision.image_token_id, params.return_log_probs, where)
        answer = http.request("/v1/completions", completion_request(model, prompts[i], params, seeds[i], allowed))
        return parse_completion(answer, params.return_log_probs, where)

    results = list(pool.map(one, range(len(prompts))))
    tokens = [r[0] for r in results]
    return tokens, ([r[1] for r in results] if params.return_log_probs else None)

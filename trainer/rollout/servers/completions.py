"""Sampling through rollout servers, token ids in and out: text prompts through the OpenAI
``/v1/completions`` route, prompts with images through vLLM's token-in route
``/inference/v1/generate`` (``/v1/completions`` takes no images), which takes the token ids with
the images beside them as PNG data URLs (lossless: the server's processor sees the pixels the
trainer's saw).

One request per row, each with the row's seed, so what a row draws depends on its prompt, its
seed and the weights only, not on which server answers or what else it batches (as far as
vLLM's batch invariance goes). Rows spread over the servers round-robin and run concurrently
(each server batches what is in flight) on the engine's daemon pool, the main thread's wait
reading the job's stop flag (trainer/network_waits.py); results come back in row order.

Each answer is read up to :func:`completion_cap` bytes (http.py says why there is a cap): what a
completion of its prompt and ``max_tokens`` can take, with log-probs.
"""
from __future__ import annotations

import base64
import io

from ...network_waits import wait_or_stop
from ..engines import ABORT_REDRAWS, ABORTED, aborted_message
from .http import AnswerCap, ServerError, ServerHttp, servers_named
from .vision_serving import collapse_image_runs, expansion_mismatch

GENERATE_ROUTE = "/inference/v1/generate"

# What one completion's answer may take (completion_cap), per token of its prompt (echoed:
# ``prompt_token_ids``; check_sync's ``prompt_logprobs``) and of its max_tokens. A sampled token
# with log-probs (logprobs=0, tokens named by id) takes ~150 bytes: its id in ``token_ids``, in
# ``tokens`` and as ``top_logprobs``' key ("token_id:151643"), its log-prob twice, its text offset,
# and on the token-in route its bytes as a list of numbers; a server with a tokenizer adds the
# token's text, a few characters (about 4 on average, tens for the longest vocabulary entries), each
# up to 6 bytes once JSON escapes it. A prompt token takes ~8 bytes, ~100 with its log-prob.
# 1 KiB a token is several times the most any of them averages; the envelope (id, model, usage,
# finish_reason, ...) is under 1 KiB on vLLM, and 64 KiB leaves room for servers that add more.
ANSWER_BYTES_PER_TOKEN = 1 << 10
ANSWER_ENVELOPE_BYTES = 64 << 10


def completion_cap(prompt_tokens: int, max_tokens: int) -> AnswerCap:
    """The most bytes read of the answer to one completion request (one row: n=1) of a prompt of
    ``prompt_tokens`` tokens (as the server sees it: image placeholders expanded) and ``max_tokens``."""
    return AnswerCap(ANSWER_ENVELOPE_BYTES + ANSWER_BYTES_PER_TOKEN * (prompt_tokens + max_tokens),
                     f"a {prompt_tokens}-token prompt and max_tokens={max_tokens} ({ANSWER_ENVELOPE_BYTES} + "
                     f"{ANSWER_BYTES_PER_TOKEN} a token)")


def _sampling(params, seed: int, logit_bias: dict[int, float] | None) -> dict:
    """The sampling fields both routes share (``params``: the engines' SamplingParams)."""
    return {"max_tokens": params.max_new_tokens, "temperature": 0.0 if params.greedy else float(params.temperature),
            "top_p": float(params.top_p), "top_k": int(params.top_k),
            "repetition_penalty": float(params.repetition_penalty), "seed": int(seed),
            "stop_token_ids": list(params.stop_token_ids), "skip_special_tokens": False,
            "logprobs": 0 if params.return_log_probs else None,
            **({} if not logit_bias else {"logit_bias": {str(t): b for t, b in logit_bias.items()}})}


def completion_request(model: str, prompt: list[int], params, seed: int,
                       logit_bias: dict[int, float] | None = None) -> dict:
    """The ``/v1/completions`` body of one row. Stop strings are not sent: a text model's servers
    run without a tokenizer (``--skip-tokenizer-init``, vLLM refuses them there), the engine cuts
    at them (trainer/rollout/controls/stop_strings.py). ``logit_bias``: per token a bias (a vision-language
    policy's placeholders: vision_serving.py), None: none."""
    return {"model": model, "prompt": list(prompt), **_sampling(params, seed, logit_bias),
            "return_token_ids": True,
            # without a tokenizer on the server, log-probs need their tokens named by id
            "return_tokens_as_token_ids": True}


def png_data_url(picture) -> str:
    """``picture`` (a PIL image) as the trainer's processor took it (RGB), in a lossless data URL."""
    buffer = io.BytesIO()
    picture.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def image_request(model: str, prompt: list[int], pictures: list, params, seed: int, image_token_id: int,
                  logit_bias: dict[int, float] | None, data_url=png_data_url) -> dict:
    """The ``/inference/v1/generate`` body of one row whose prompt holds ``pictures``: each image's
    run of placeholders written once (the server's processor expands it again, and the answer's
    ``prompt_token_ids`` say how: :func:`parse_image_answer` checks them against ``prompt``)."""
    return {"model": model, "token_ids": collapse_image_runs(list(prompt), image_token_id),
            "content_parts": [{"type": "image_url", "url": data_url(p)} for p in pictures],
            "sampling_params": {**_sampling(params, seed, logit_bias), "detokenize": False},
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
        raise ServerError(f"{where}: an answer without token ids or log-probs ({type(exc).__name__}: {exc}); a "
                          f"vision-language policy's server must be vLLM >= 0.32 started with --enable-scale-out "
                          f"(python -m polyfsdp.trainer.rollout.servers.launch adds it for such a model)") from None
    mismatch = expansion_mismatch(served, prompt, image_token_id)
    if mismatch is not None:
        raise ServerError(f"{where}: {mismatch}")
    if log_probs is not None and len(log_probs) != len(tokens):
        raise ServerError(f"{where}: {len(tokens)} token ids but {len(log_probs)} log-probs in one completion")
    return tokens, log_probs


def finish_reason(answer) -> str | None:
    """The finish_reason of an answer's (either route's) first choice; None where it has none."""
    try:
        return answer["choices"][0].get("finish_reason")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None


def parse_completion(answer, want_log_probs: bool, where: str) -> tuple[list[int], list[float] | None]:
    """The new token ids (and their log-probs) of a ``/v1/completions`` answer; ServerError naming
    ``where`` when the answer lacks them or they disagree in length."""
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
    cap = completion_cap(len(ids), 1)
    if picture is None:
        answer = http.request("/v1/completions", {"model": model, "prompt": list(ids), "return_token_ids": True,
                                                  **sampling}, cap=cap)
    else:
        answer = http.request(GENERATE_ROUTE, {"model": model, "token_ids": collapse_image_runs(ids, image_token_id),
                                               "content_parts": [{"type": "image_url", "url": png_data_url(picture)}],
                                               "sampling_params": {**sampling, "detokenize": False},
                                               "return_token_ids": True}, cap=cap)
        parse_image_answer(answer, ids, image_token_id, False, f"{http.name} ({http.url})")
    try:
        steps = (answer["choices"][0] if picture is None else answer)["prompt_logprobs"][1:]
        return [float(step[str(tok)]["logprob"]) for step, tok in zip(steps, ids[1:], strict=True)]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ServerError(f"{http.name} ({http.url}): prompt log-probs missing from its answer "
                          f"({type(exc).__name__}: {exc})") from None


def sample_rows(servers: list[ServerHttp], model: str, prompts: list[list[int]], params, seeds: list[int],
                pool, first_server: int = 0, pictures: list | None = None, vision=None):
    """Completions (and log-probs when ``params.return_log_probs``) of every prompt, row ``i``
    on server ``(first_server + i) % len(servers)``, its request run on ``pool`` (anything with
    ``submit``: the engine's DaemonPool); ``pictures``: per prompt its images or None
    (servers/vision_serving.py: prompt_pictures); ``vision``: a vision-language policy's VisionServing."""
    bias = None if vision is None else vision.logit_bias
    # A group's rows share their Example's images: each is encoded once (``pictures`` keeps them alive,
    # so an id is not reused during the round).
    urls: dict[int, str] = {}

    def data_url(picture) -> str:
        if id(picture) not in urls:
            urls[id(picture)] = png_data_url(picture)
        return urls[id(picture)]

    def one(i: int):
        http = servers[(first_server + i) % len(servers)]
        where = f"{http.name} ({http.url})"
        with_images = pictures is not None and pictures[i]
        if with_images:
            route, body = GENERATE_ROUTE, image_request(model, prompts[i], pictures[i], params, seeds[i],
                                                        vision.image_token_id, bias, data_url)
        else:
            route, body = "/v1/completions", completion_request(model, prompts[i], params, seeds[i], bias)
        cap = completion_cap(len(prompts[i]), params.max_new_tokens)  # the trainer's prompt: images expanded
        # An aborted request is no sample: asked again (its seed: the sample it would have been).
        for _ in range(ABORT_REDRAWS + 1):
            answer = http.request(route, body, cap=cap)
            if finish_reason(answer) != ABORTED:
                break
        else:
            raise ServerError(aborted_message(where, i, len(prompts)))
        if with_images:
            return parse_image_answer(answer, prompts[i], vision.image_token_id, params.return_log_probs, where)
        return parse_completion(answer, params.return_log_probs, where)

    rows = [pool.submit(one, i) for i in range(len(prompts))]
    try:
        results = wait_or_stop(rows, servers_named(servers))
    finally:
        for row in rows:  # after a failure or a stop: the rows not sent yet are not sent
            row.cancel()
    tokens = [r[0] for r in results]
    return tokens, ([r[1] for r in results] if params.return_log_probs else None)

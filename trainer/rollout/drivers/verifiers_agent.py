"""``rollout.agent=verifiers:ENV_ID``: train on a verifiers environment (the ``verifiers`` package
from Prime Intellect, 0.4's ``verifiers.v1`` API; ``pip install 'polyfsdp[verifiers]'``).

ENV_ID is a verifiers taskset id: an installed package exporting a ``vf.Taskset`` subclass in
``__all__`` (verifiers imports ``owner/name@version`` as module ``name``, dashes as underscores).
``rollout.env_kwargs`` is the rest of the environment's config, as verifiers' ``[env]`` block
(``{taskset: {...its knobs}, agent: {harness: {id: ...}}, id: best-of-n}``); ``vf.load_environment``
builds the environment from it. A taskset that is not installed is one ConfigError: polyfsdp never
downloads one from the Environments Hub.

``data=verifiers`` makes the taskset's tasks the job's data (:func:`verifiers_examples`): one
Example per task, its messages what a chat harness sends (system prompt, prompt), carrying the
task's position in ``extra_info`` so its conversation runs that task.

Each conversation is one verifiers episode (``Env.run_episode``) with the model at the
conversation's base URL: the episode's harness calls verifiers' interception server, which
forwards each model call to polyfsdp's endpoint (agent_server.py), where the trainer samples it
and records the tokens (agent.py). The reward is the episode's trace reward (the weighted sum of
its task's ``@vf.reward`` functions and judges). The environment is served on one event loop of
its own (a thread): verifiers' interception servers belong to the loop that started them.

What the endpoint serves limits the harnesses: it answers whole (non-streamed) chat completions,
so a harness must not stream; verifiers' own ``null`` and ``bash`` harnesses stream and run as
``uv`` scripts (uv fetches their dependencies), so they need the endpoint's streaming first. A
taskset may bundle its own harness (exported next to its Taskset), e.g. one whose chat loop runs
in-process (verifiers' Harness contract allows it: every model call through the interception).
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import threading

from ...config.plugins import first_line
from ...errors import ConfigError
from .agent_server import MODEL_NAME

PREFIX = "verifiers:"
INSTALL = "pip install 'polyfsdp[verifiers]'"
TASK_KEY = "verifiers_task"  # Example.extra_info's key: the task's position in the taskset
KEY_VAR = "POLYFSDP_VERIFIERS_ENDPOINT_KEY"  # unset: verifiers sends "EMPTY"; the endpoint checks no key


def is_verifiers_spec(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def _verifiers(spec: str):
    """``verifiers.v1``, or a one-line ConfigError naming the install."""
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ConfigError(f"rollout.agent={spec} needs the verifiers package (0.4 or later): {INSTALL} "
                          f"({first_line(exc)})") from None
    return vf


def taskset_module(env_id: str) -> str:
    """The module verifiers imports for taskset ``env_id`` (its loaders' naming rule)."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def _installed(module: str) -> bool:
    for name in (f"verifiers.v1.tasksets.{module}", module):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):  # a dotted name whose parent is missing
            continue
    return False


def _merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def env_config(spec: str, env_kwargs: dict | None):
    """The verifiers ``EnvConfig`` of ``spec`` with ``rollout.env_kwargs``, checked (one-line errors)."""
    vf = _verifiers(spec)
    env_id = spec[len(PREFIX):]
    if not env_id:
        raise ConfigError(f"rollout.agent={spec}: name the verifiers environment, e.g. rollout.agent=verifiers:gsm8k")
    module = taskset_module(env_id)
    if not _installed(module):
        raise ConfigError(f"rollout.agent={spec}: no verifiers environment {env_id!r} is installed (no module "
                          f"{module!r}); install its package first (pip install {module.replace('_', '-')}, "
                          f"or prime env install {env_id}); polyfsdp never downloads one")
    kwargs = dict(env_kwargs or {})
    taskset = kwargs.get("taskset") or {}
    if not isinstance(taskset, dict) or taskset.get("id", env_id) != env_id:
        raise ConfigError(f"rollout.env_kwargs.taskset: got {taskset!r}; the taskset is rollout.agent's "
                          f"({env_id}), env_kwargs.taskset holds its knobs")
    data = _merged(kwargs, {"taskset": {**taskset, "id": env_id}})
    try:
        # verifiers' default runtime is a Prime sandbox, which cannot reach the endpoint on this host's
        # loopback: every seat the config leaves unset runs in the local subprocess runtime.
        from verifiers.v1.configs.agent import agent_config_fields

        seats = agent_config_fields(vf.resolve_env_config(json.loads(json.dumps(data))))
        local = {seat: {"runtime": {"type": "subprocess"}} for seat in seats
                 if not (isinstance(kwargs.get(seat), dict) and "runtime" in kwargs[seat])}
        return vf.resolve_env_config(_merged(local, data))
    except Exception as exc:  # noqa: BLE001 - pydantic's, the plugin loaders', the env's own
        where = f" with rollout.env_kwargs={json.dumps(kwargs, default=str)}" if kwargs else ""
        raise ConfigError(f"rollout.agent={spec}{where}: verifiers refused the environment's config: "
                          f"{_reason(exc)}") from None


def _reason(exc: Exception) -> str:
    """One line for ``exc``: a pydantic ValidationError's first error with its field, else the first line."""
    errors = exc.errors() if callable(getattr(exc, "errors", None)) else None
    if errors:
        first = errors[0]
        field = ".".join(str(part) for part in first.get("loc", ()))
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return f"{field}: {first.get('msg')}, got {first.get('input')!r}{more}"
    return f"{type(exc).__name__}: {first_line(exc)}"


class VerifiersEnvironment:
    """One loaded verifiers environment: its tasks, and episodes run on its event loop thread."""

    def __init__(self, spec: str, env_kwargs: dict | None) -> None:
        self.spec = spec
        config = env_config(spec, env_kwargs)
        vf = _verifiers(spec)
        try:
            self.env = vf.load_environment(config)
            if not self.env.taskset.bounded:
                raise ValueError("its taskset is infinite; bound it (e.g. env_kwargs.taskset with a size knob)")
            self.tasks = list(self.env.taskset)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - the environment's own code
            raise ConfigError(f"rollout.agent={spec}: loading the verifiers environment raised "
                              f"{type(exc).__name__}: {first_line(exc)}") from None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def examples(self) -> list:
        """One Example per task, in the taskset's order."""
        from ...data.example import Example

        out = []
        for position, task in enumerate(self.tasks):
            data = task.data
            messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
            if isinstance(data.prompt, str):
                messages.append({"role": "user", "content": data.prompt})
            else:
                messages += [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
                             for m in data.prompt or []]
            answer = getattr(data, "answer", None)
            out.append(Example(prompt="\n".join(str(m.get("content") or "") for m in messages),
                               answer="" if answer is None else str(answer),
                               messages=tuple(messages) or None, data_source=self.spec,
                               extra_info={TASK_KEY: position},
                               where=f"{self.spec} task {data.idx if data.idx is not None else position}"))
        return out

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The environment's loop, started on first use with ``env.serving()`` entered (one
        interception pool for every episode); it lives as long as the process (a daemon)."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, daemon=True, name="verifiers-env").start()
                try:
                    asyncio.run_coroutine_threadsafe(self.env.serving().__aenter__(), loop).result()
                except BaseException:
                    loop.call_soon_threadsafe(loop.stop)
                    raise
                self._loop = loop
        return self._loop

    def agent(self, example, client) -> dict:
        """The ``rollout.agent`` function: one episode of the example's task against ``client``'s
        base URL (its conversation); returns the trace's reward, its reward functions' scores
        (``reward_<name>``) and its metrics."""
        vf = _verifiers(self.spec)
        position = (example.extra_info or {}).get(TASK_KEY)
        if not isinstance(position, int) or not 0 <= position < len(self.tasks):
            raise ValueError(f"the record is not one of {self.spec}'s tasks: train with data=verifiers")
        context = vf.ModelContext(model=MODEL_NAME, client=vf.EvalClientConfig(base_url=str(client.base_url),
                                                                                 api_key_var=KEY_VAR))
        episode = asyncio.run_coroutine_threadsafe(self.env.run_episode(self.tasks[position], context),
                                                   self._running_loop()).result()
        if not episode.ok:
            errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
            error = errors[-1] if errors else None
            raise RuntimeError("the verifiers episode failed" + (f": {error.type}: {first_line(error.message)}"
                                                                 if error else ""))
        if len(episode.traces) != 1:
            raise ValueError(f"the verifiers episode ran {len(episode.traces)} agents; polyfsdp trains one "
                             f"conversation per episode (a single-agent environment)")
        trace = episode.traces[0]
        # Each reward function's score (unweighted) and the task's metrics, logged as agent/<key>.
        scores = {f"reward_{name}": r.score for name, r in (trace.rewards or {}).items() if r is not None}
        return {**scores, **{k: v for k, v in (trace.metrics or {}).items() if v is not None}, "reward": trace.reward}


_LOADED: dict[str, VerifiersEnvironment] = {}


def verifiers_environment(spec: str, env_kwargs: dict | None = None) -> VerifiersEnvironment:
    """The environment of ``spec`` with ``env_kwargs``, loaded once per process (the data source
    and the driver share it, so a record's task position means the same task in both)."""
    key = f"{spec} {json.dumps(env_kwargs or {}, sort_keys=True, default=str)}"
    if key not in _LOADED:
        _LOADED[key] = VerifiersEnvironment(spec, env_kwargs)
    return _LOADED[key]


def verifiers_agent(spec: str, env_kwargs: dict | None = None):
    """The agent function of ``rollout.agent=verifiers:ENV_ID`` (checked before any model is built)."""
    return verifiers_environment(spec, env_kwargs).agent


def verifiers_examples(rollout) -> list:
    """``data=verifiers``: the tasks of ``rollout.agent``'s environment as Examples."""
    agent = getattr(rollout, "agent", None)
    if not is_verifiers_spec(agent):
        raise ConfigError(f"data=verifiers reads the tasks of a verifiers environment: set "
                          f"rollout.agent=verifiers:ENV_ID (got rollout.agent={agent})")
    return verifiers_environment(rollout.agent, rollout.env_kwargs).examples()

"""The reward's sources and their weighted sum: ``reward.fn`` (a function), ``reward.model`` (a
reward model, trainer/rewards/reward_model.py), ``reward.judge`` (a generative judge behind an
OpenAI-compatible server, trainer/rewards/judge.py), built in one place (:func:`build_reward`).

A source is anything with ``name``, ``weight``, ``data_sources`` (None: every record) and
``score_all(examples, texts, responses, group) -> (rewards, extras)`` (row ``i`` answers
``examples[i // group]``; ``extras`` are per-row metrics, logged as ``reward/<key>``). A new kind
of source (an LLM judge, say) is one more branch in :func:`build_reward` and its settings in
``RewardSection``. A source that runs collectives (a sharded model) says ``collective = True``:
:class:`WeightedReward` calls it first, on every rank, whatever the rows, so no rank's own
error (a reward function raising on its record) can leave its peers waiting in a forward.

A job whose reward is ``reward.fn`` alone, weight 1, every record, scores with the function's
:class:`~.reward_fn.Scorer` itself: its records are what they were before sources existed.
"""
from __future__ import annotations

import math
import os

from ..errors import ConfigError, RewardError

# The function source's name in the logs (reward/fn) and in error lines.
FN_SOURCE = "fn"
TEMPLATES = ("auto", "chat", "none")


def _check_routing(where: str, data_sources) -> None:
    if data_sources is not None and (not isinstance(data_sources, (list, tuple)) or not data_sources
                                     or not all(isinstance(d, str) for d in data_sources)):
        raise ConfigError(f"{where}.data_sources: expected null (every record) or a non-empty list of data_source "
                          f"names, got {data_sources!r}")


def validate_sources(r) -> None:
    """One-line ConfigErrors for the sources' settings of RewardSection ``r``, before anything
    is loaded: weights, routing, names, the reward model's directory and template."""
    _check_routing("reward", r.data_sources)
    m = r.model
    has_model = m is not None and m.path is not None
    if r.judge is not None:
        from .judge import JudgeSettings

        judge = JudgeSettings.from_section(r.judge)
        _check_routing("reward.judge", judge.data_sources)
        if judge.checkpoint is not None:
            from .judge_server import check_checkpoint

            check_checkpoint(judge.checkpoint)
        if has_model and judge.name == m.name:
            raise ConfigError(f"reward.judge.name={judge.name}: reward.model has that name too (each source is "
                              f"logged as reward/<name>)")
    if r.fn == "none" and not has_model and r.judge is None:
        raise ConfigError("reward.fn=none: no reward function, no reward.model.path and no reward.judge; the reward "
                          "needs a source")
    if r.fn == "none" and (r.weight != 1.0 or r.data_sources is not None):
        raise ConfigError("reward.weight/reward.data_sources: apply to reward.fn, which is none")
    if not has_model:
        return
    _check_routing("reward.model", m.data_sources)
    if not os.path.isdir(m.path) or not os.path.isfile(os.path.join(m.path, "config.json")):
        raise ConfigError(f"reward.model.path: {m.path!r} is not a Hugging Face checkpoint directory (config.json "
                          f"+ weights; nothing is downloaded)")
    if m.value_head_path is not None and not os.path.isfile(m.value_head_path):
        raise ConfigError(f"reward.model.value_head_path: no such file: {m.value_head_path}")
    if m.template not in TEMPLATES:
        raise ConfigError(f"reward.model.template: got {m.template!r}; allowed values: {', '.join(TEMPLATES)}")
    if not m.name or not m.name.replace("_", "").isalnum() or m.name == FN_SOURCE:
        raise ConfigError(f"reward.model.name: got {m.name!r}; expected letters, digits and _ (not {FN_SOURCE!r}, "
                          f"reward.fn's name)")


class FunctionSource:
    """``reward.fn`` as a source: its Scorer (errors keep naming the function), weighted and routed."""

    name = FN_SOURCE

    def __init__(self, scorer, weight: float, data_sources) -> None:
        self.scorer, self.weight, self.data_sources = scorer, weight, data_sources
        self.title = scorer.name

    def score_all(self, examples, texts, responses, group: int = 1, answers: list | None = None):
        return self.scorer.score_all(examples, texts, responses, group, answers)


class WeightedReward:
    """The reward of each row: the sum over the sources that score its record (routing by
    ``data_source``) of ``weight x score``; each source's raw scores are logged as
    ``reward/<name>`` (over the rows it scored), beside the function's own extras."""

    def __init__(self, sources: list) -> None:
        # Collective sources first: every rank reaches their forwards before any rank's own error.
        self.sources = sorted(sources, key=lambda s: not getattr(s, "collective", False))
        self.name = " + ".join(f"{s.weight:g}*{getattr(s, 'title', s.name)}" for s in sources)  # the first line

    def score_all(self, examples, texts: list[str], responses: list[list[int]], group: int = 1,
                  answers: list | None = None):
        """Rewards of ``texts`` and the extras (a Scorer's interface); ``answers`` come from
        reward.fn (None per row without one)."""
        rows = [examples[i // group] for i in range(len(texts))]
        totals, extras, names = [0.0] * len(texts), {}, {s.name for s in self.sources}
        votes: dict[int, object] = {}
        for source in self.sources:
            chosen = [i for i, ex in enumerate(rows) if source.data_sources is None
                      or ex.data_source in source.data_sources]
            more_args = {"answers": []} if answers is not None and isinstance(source, FunctionSource) else {}
            # Routing is per record, so the chosen rows are whole groups, in order: each source sees
            # them grouped (a judge's on_unparsable=skip fills a row from its group).
            scores, more = source.score_all([rows[i] for i in chosen[::group]], [texts[i] for i in chosen],
                                            [responses[i] for i in chosen], group, **more_args)
            votes.update(zip(chosen, more_args.get("answers", ())))
            for i, score in zip(chosen, scores):
                totals[i] += source.weight * score
            extras[source.name] = list(scores)
            for key, values in more.items():
                if key in names:
                    raise RewardError(f"reward.fn={source.scorer.name}: its metric {key!r} has the name of a reward "
                                      f"source (logged as reward/{key}); rename the key")
                extras.setdefault(key, []).extend(values)
        for i, total in enumerate(totals):
            if not math.isfinite(total):
                raise RewardError(f"reward: the weighted sum {total} is not finite for record "
                                  f"{rows[i].where or rows[i].prompt!r}")
        if answers is not None:
            answers.extend(votes.get(i) for i in range(len(texts)))
        return totals, extras

    def close(self) -> None:
        """End what the sources hold open (a judge's connections and the server polyfsdp started)."""
        for source in self.sources:
            getattr(source, "close", lambda: None)()


def build_reward(reward_section, data, job=None):
    """What scores completions: the reward function's Scorer alone when it is the only source
    (weight 1, every record), else a :class:`WeightedReward` of every configured source.
    ``job = (JobConfig, the policy's tokenizer, backend)`` builds a reward model's engine (an
    entry point without one refuses a configured reward model)."""
    from .reward_fn import build_scorer

    r = reward_section
    has_model = r.model is not None and r.model.path is not None
    sources = []
    if r.fn != "none":
        scorer = build_scorer(r, data)
        if not has_model and r.judge is None and r.weight == 1.0 and r.data_sources is None:
            return scorer
        sources.append(FunctionSource(scorer, r.weight, r.data_sources))
    if has_model:
        if job is None:
            raise ConfigError("reward.model: this entry point does not build reward models")
        from .reward_model import build_reward_model_source

        sources.append(build_reward_model_source(r.model, *job))
    if r.judge is not None:
        from .judge import build_judge

        sources.append(build_judge(r.judge, job[2] if job is not None else None))
    return WeightedReward(sources)

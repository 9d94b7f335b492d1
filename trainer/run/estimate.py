"""``polyfsdp-train ... --estimate``: the per-rank memory of the configured job, phase by phase,
printed before anything is built on a device.

Each phase's batches are the job's own: the data source is read as the job reads it (the same
tokenizer, seed and draws), every step's examples are split over the ranks and into micro-batches
by the engine's planner (``engines/batch/micro.py``), and the largest micro-batch is what is
estimated. What cannot be known before the run is bounded: RL completions are counted at
``algo.actor.max_new_tokens`` (the decoding loop's KV cache is that size anyway); with
``rollout.env`` SFT sequences are the demonstrations' conversations and sampled conversations
are bounded over their turns (trainer/run/estimate_turns.py). The bytes come
from ``engines/memory.py`` (``ModelMemory``): exact parameter, gradient and AdamW shards, the
reference copy of a full fine-tune (none with LoRA: its adapters off), a critic estimator's critic, and each
step's activations, head buffers and KV cache.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from polyfsdp.engines.config import TORCH_DTYPES
from polyfsdp.engines.memory import MIB, ModelMemory, hf_config_of, kv_cache_bytes
from polyfsdp.engines.batch.micro import plan_micro_batches
from polyfsdp.engines.presets import preset_config

from ..config.rollout_check import SEPARATE_SAMPLERS
from ..errors import ConfigError
from ..data.sources import RL_DATA_STREAM

EVAL_CHUNK = 256  # prompts per evaluation generate call (trainer/evaluation/held_out.py: COMPLETIONS_PER_CALL)


@dataclass
class Step:
    """One kind of step of a phase: what it adds on top of the phase's resident state."""

    name: str
    rows: int           # sequences in its largest micro-batch (generation: rows decoding at once)
    tokens: int         # tokens of that micro-batch (generation: rows x (prompt width + new tokens))
    transient: int      # bytes: activations, head buffers, KV cache, gradients alive during it
    resident: int       # bytes of the phase's state on the device meanwhile

    @property
    def peak(self) -> int:
        return self.resident + self.transient


@dataclass
class JobEstimate:
    """The job's per-rank estimate: resident state rows per phase and each phase's steps."""

    header: str
    state: dict[str, dict[str, int]] = field(default_factory=dict)  # phase -> row -> bytes
    steps: dict[str, list[Step]] = field(default_factory=dict)      # phase -> steps
    notes: list[str] = field(default_factory=list)

    def peak(self) -> tuple[int, str]:
        """The largest step peak and ``"phase: step"`` naming it."""
        return max((s.peak, f"{phase}: {s.name}") for phase, steps in self.steps.items() for s in steps)

    def table(self) -> str:
        lines = [self.header]
        for phase, steps in self.steps.items():
            lines.append(f"\n{phase} phase: resident state{'':<25} MiB")
            for name, value in self.state[phase].items():
                lines.append(f"  {name:<48} {value / MIB:>10.2f}")
            lines.append(f"  {'step':<36} {'rows':>6} {'tokens':>8} {'step MiB':>10} {'peak MiB':>10}")
            for s in steps:
                lines.append(f"  {s.name:<36} {s.rows:>6} {s.tokens:>8} {s.transient / MIB:>10.2f} "
                             f"{s.peak / MIB:>10.2f}")
        value, where = self.peak()
        lines.append(f"\npeak over phases: {value / MIB:.2f} MiB ({value / 2 ** 30:.2f} GiB) per rank, at {where}")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


# ---------------------------------------------------------------------- the job's batches
def _micro_batch(lengths: list[int], budget: int | None, packed: bool) -> tuple[int, int]:
    """``(rows, tokens)`` of the largest micro-batch the engine makes of ``lengths``; unpacked
    (use_remove_padding=false) rows are padded to the longest."""
    best = (0, 0)
    for group in plan_micro_batches(lengths, budget):
        sizes = [lengths[i] for i in group]
        tokens = sum(sizes) if packed else len(sizes) * max(sizes, default=0)
        best = max(best, (tokens, len(sizes)))
    return best[1], best[0]


def _largest(batches, budget: int | None, packed: bool) -> tuple[int, int]:
    """The largest ``(rows, tokens)`` micro-batch over ``batches`` (lists of lengths)."""
    best = (0, 0)
    for lengths in batches:
        if lengths:
            rows, tokens = _micro_batch(lengths, budget, packed)
            best = max(best, (tokens, rows))
    return best[1], best[0]


def _replica_shares(examples: list, replicas: int) -> list[list]:
    per = len(examples) // replicas  # Job._shard: a share per data-parallel replica
    return [examples[r * per:(r + 1) * per] for r in range(replicas)]


def _replicas(cfg, world: int) -> int:
    """Data-parallel replicas: the ranks of one sequence-parallel group hold one share."""
    return world // cfg.engine.ulysses_sp_size


class _Lengths:
    """Token counts of the job's prompts and answers, read from its data as the job reads it."""

    def __init__(self, cfg) -> None:
        from ..data.chat import PromptEncoder, example_prompt_tokens
        from ..data.sources import build_source, max_answer_tokens
        from ..data.tokenizers import CharTokenizer, load_tokenizer

        self.note = None
        self.turns = None  # with rollout.env: the multi-turn job's lengths (trainer/run/estimate_turns.py)
        try:
            tokenizer = load_tokenizer(cfg.model.path)
        except ValueError:
            # A config-only directory: characters count as tokens (BPE tokens hold one or more).
            tokenizer = CharTokenizer()
            self.note = (f"model.path={cfg.model.path} has no tokenizer: prompt and answer lengths counted in "
                         f"characters (an upper bound for a BPE tokenizer)")
        encoder = PromptEncoder(tokenizer, cfg.data.apply_chat_template, cfg.data.max_prompt_length,
                                cfg.data.overlong, cfg.model.path,
                                grow_vocabulary=cfg.model.path is None or self.note is not None)
        self.source = build_source(cfg.data, cfg.trainer.seed, encoder)
        self.tokenizer = tokenizer
        self.prompt = lambda ex: len(example_prompt_tokens(tokenizer, ex))  # noqa: E731
        self.answer = lambda ex: len(tokenizer.encode(ex.answer)) + 1  # + <eos> (trainer/algos/sft.py)  # noqa: E731
        self.max_answer = lambda: max_answer_tokens(self.source, tokenizer)  # noqa: E731

    def batches(self, phase: str, steps: int, batch_size: int, replicas: int):
        """Each step's examples, per data-parallel replica."""
        for step in range(steps):
            yield from _replica_shares(self.source.batch(phase, step, batch_size), replicas)


# ---------------------------------------------------------------------- phases
def _state_rows(prefix: str, memory: ModelMemory, host: set[str]) -> dict[str, int]:
    rows = {f"{prefix} parameters": memory.params, f"{prefix} AdamW state": memory.optimizer}
    if "params" in host:
        rows[f"{prefix} parameters"] = 0
    if "optimizer" in host:
        rows[f"{prefix} AdamW state"] = 0
    return rows


def _device_grads(memory: ModelMemory, host: set[str]) -> int:
    return 0 if "grads" in host else memory.grads


def _context(lengths: _Lengths, prompt: int, new_tokens: int) -> int:
    """The longest context a turn is decoded from: the prompt, or a conversation's tokens before its last turn."""
    return prompt if lengths.turns is None else lengths.turns.conversation(prompt) - new_tokens


def _evaluation(cfg, lengths: _Lengths, world: int, memory: ModelMemory, new_tokens: int, resident: int) -> Step:
    """Greedy held-out generation (every phase evaluates): the largest chunk of one rank's prompts."""
    shares = [lengths.source.eval_examples[r::world][:EVAL_CHUNK] for r in range(world)]
    rows, width = max((len(s), max((_context(lengths, lengths.prompt(ex), new_tokens) for ex in s), default=0))
                      for s in shares)
    return Step("held-out evaluation (generation)", rows, rows * (width + new_tokens),
                memory.generation(rows, width, new_tokens), resident)


def _sft_phase(cfg, lengths: _Lengths, world: int, policy: ModelMemory, host_backend: bool, est: JobEstimate,
               eval_tokens: int) -> None:
    host = policy.host_state(host_backend)
    state = _state_rows("policy", policy, host)
    resident = sum(state.values())
    packed = cfg.engine.use_remove_padding
    budget = cfg.engine.max_tokens_per_micro_batch
    shares = lengths.batches("sft", cfg.trainer.sft_steps, cfg.trainer.sft_batch_size, _replicas(cfg, world))
    batches = (lengths.turns.sft(share) if lengths.turns is not None else
               [lengths.prompt(ex) + lengths.answer(ex) for ex in share] for share in shares)
    rows, tokens = _largest(batches, budget, packed)
    grads = _device_grads(policy, host)
    est.state["sft"] = {**state, "policy gradients (during the update)": grads}
    est.steps["sft"] = [
        Step("update micro-batch", rows, tokens, grads + policy.train_step(tokens, entropy=False), resident),
        _evaluation(cfg, lengths, world, policy, eval_tokens, resident),
    ]


def _rl_phase(cfg, lengths: _Lengths, world: int, policy: ModelMemory, critic: ModelMemory | None,
              reference: ModelMemory | None, host_backend: bool, est: JobEstimate) -> None:
    g, t = cfg.algo.actor, cfg.trainer
    n, new = g.group_size, g.max_new_tokens
    packed, budget = cfg.engine.use_remove_padding, cfg.engine.max_tokens_per_micro_batch
    host = policy.host_state(host_backend)
    state = _state_rows("policy", policy, host)
    if reference is not None:
        state["reference parameters (a frozen copy)"] = 0 if "params" in host else reference.params
    if critic is not None:
        state.update(_state_rows("critic", critic, host))
    resident = sum(state.values())
    # The rollout of every step: each rank's prompts x group_size completions at max_new_tokens.
    shares = list(lengths.batches(RL_DATA_STREAM, t.rl_steps, t.prompts_per_step, _replicas(cfg, world)))
    prompt_lengths = [[lengths.prompt(ex) for ex in share for _ in range(n)] for share in shares]
    gen_rows, width = max((len(p), max((_context(lengths, x, new) for x in p), default=0)) for p in prompt_lengths)
    full = [[_context(lengths, p, new) + new for p in ps] for ps in prompt_lengths]
    roll_rows, roll_tokens = _largest(full, budget, packed)
    # Update mini-batches hold whole groups; the longest groups bound the largest one.
    groups_per_rank = t.prompts_per_step // _replicas(cfg, world)
    mini_groups = -(-groups_per_rank // max(1, min(g.mini_batches(t.prompts_per_step), groups_per_rank)))
    longest = [sorted(ps[::n], reverse=True)[:mini_groups] for ps in full]
    update_rows, update_tokens = _largest(([p for p in ps for _ in range(n)] for ps in longest), budget, packed)
    loss = cfg.algo.actor_loss(t.prompts_per_step)
    need_old = cfg.algo.needs_old_log_probs(loss, has_reference=g.kl_coef > 0)
    gathered = policy.gathered if cfg.rollout.unshard is not False else 0
    steps = [Step("rollout generation (KV cache)", gen_rows, gen_rows * (width + new),
                  gathered + policy.generation(gen_rows, width, new), resident)]
    # The reference pass: a second engine, or (LoRA) the policy with its adapters off.
    if need_old or g.kl_coef > 0:
        steps.append(Step("old/ref log-prob pass (no grad)", roll_rows, roll_tokens,
                          policy.inference(roll_tokens), resident))
    if critic is not None:
        steps.append(Step("critic values pass (no grad)", roll_rows, roll_tokens, critic.inference(roll_tokens),
                          resident))
        steps.append(Step("critic update micro-batch", update_rows, update_tokens,
                          _device_grads(critic, host) + critic.train_step(update_tokens, entropy=False), resident))
    grads = _device_grads(policy, host)
    steps.append(Step("actor update micro-batch", update_rows, update_tokens,
                      grads + policy.train_step(update_tokens, entropy=loss.requires_entropy), resident))
    steps.append(_evaluation(cfg, lengths, world, policy, new, resident))
    name = cfg.algo.name
    est.state[name] = {**state, "policy gradients (during the update)": grads}
    if critic is not None:
        est.state[name]["critic gradients (during its update)"] = _device_grads(critic, host)
    est.steps[name] = steps
    if lengths.turns is None:
        est.notes.append(f"{name}: completions counted at algo.actor.max_new_tokens={new} (an upper bound; the KV "
                         f"cache is that size)")
    if gathered:
        est.notes.append(f"{name}: generation holds the whole model gathered ({gathered / MIB:.2f} MiB, "
                         f"rollout.unshard={cfg.rollout.unshard}); rollout.unshard=false gathers one layer at a time")


def _hf_config(cfg, tokenizer):
    if cfg.model.path:
        try:
            return hf_config_of(cfg.model.model_config())
        except ValueError as exc:
            raise ConfigError(f"model.path: {str(exc).removeprefix('ModelConfig.path: ')}") from None
    # The trainer sizes a preset's vocabulary to its tokenizer and resizes it with
    # model.overrides (trainer/run/model_init.py).
    return preset_config(cfg.model.preset, **{**dict(cfg.model.overrides), "vocab_size": tokenizer.vocab_size})


def estimate_job(cfg, world_size: int) -> JobEstimate:
    """The per-rank memory of ``cfg``'s job on ``world_size`` ranks, phase by phase."""
    from ..errors import DataError

    try:
        lengths = _Lengths(cfg)
    except DataError as exc:
        raise ConfigError(str(exc)) from None
    hf_config = _hf_config(cfg, lengths.tokenizer)
    model_config = cfg.model.model_config()
    # Host memory (CPU): offload is a no-op. A named backend is taken at its word (a GPU
    # job may be estimated on a laptop); ``auto`` is what this machine would pick.
    from polyfsdp.backends.registry import backend_memory_is_host

    host_backend = backend_memory_is_host(cfg.backend)
    policy = ModelMemory(model_config, cfg.engine, world_size, hf_config)
    actor = cfg.algo.actor
    lora = model_config.lora.enabled
    est = JobEstimate(
        f"memory estimate per rank: world size {world_size}, master {model_config.dtype}, compute "
        f"{cfg.engine.param_dtype}, LoRA rank {model_config.lora.rank}, offload {cfg.engine.offload}, "
        f"micro-batch budget {cfg.engine.max_tokens_per_micro_batch or 'none (a rank batch each)'}\n"
        f"model: {policy.num_params / 1e6:,.2f}M parameters, {policy.num_trainable / 1e6:,.2f}M trained"
        + ("; CPU: every row is host memory" if host_backend else ""))
    if lengths.note:
        est.notes.append(lengths.note)
    if cfg.engine.ulysses_sp_size > 1:
        est.notes.append(f"engine.ulysses_sp_size={cfg.engine.ulysses_sp_size}: each rank counts its replica's whole "
                         f"sequences; the split of the log-prob and update activations over the SP group is not "
                         f"modelled (an upper bound for those rows)")
    eval_tokens = actor.max_new_tokens if actor is not None else lengths.max_answer() + 2  # Job.eval_tokens
    if cfg.rollout.env is not None:
        from ..data.chat import model_max_positions
        from .estimate_turns import TurnLengths

        source = lengths.source
        lengths.turns = TurnLengths(cfg, lengths.tokenizer, source.eval_examples + getattr(source, "train_examples", []),
                                    model_max_positions(cfg.model), eval_tokens)
        est.notes.append(lengths.turns.note())
    if cfg.trainer.sft_steps > 0 or not cfg.algo.rl:
        _sft_phase(cfg, lengths, world_size, policy, host_backend, est, eval_tokens)
    if cfg.algo.rl:
        reference = ModelMemory(replace(model_config, lora=replace(model_config.lora, rank=0)), cfg.engine,
                                world_size, hf_config) if actor.kl_coef > 0 and not lora else None
        critic = ModelMemory(model_config, cfg.engine, world_size, hf_config, value_head=True) \
            if cfg.algo.estimator.needs_critic else None
        _rl_phase(cfg, lengths, world_size, policy, critic, reference, host_backend, est)
        if lora and actor.kl_coef > 0:
            est.notes.append("LoRA: the KL reference is the policy with its adapters off (no second copy)")
    if cfg.engine.offload != "none" and not host_backend:
        est.notes.append(f"offload={cfg.engine.offload}: the host holds the rows shown as 0 "
                         f"(python -m polyfsdp.engines.memory prints them)")
    est.notes.append("FSDP2 also gathers one layer (and the root) unsharded in param_dtype while it runs")
    return est


def check_fits(cfg, world_size: int) -> None:
    """One ConfigError, before any work, for a job this machine cannot run at all: more
    ``trainer.cpu_threads`` than CPUs this process may use (thousands of threads fail to start or
    crawl), or an RL rollout whose KV cache alone exceeds the memory one process can use. The
    cache is a floor, not the estimate: every completion of a rank's share decodes at once
    (trainer/rollout/decode.py), prompts counted at one token, no weights; it needs no data, so
    ``prompts_per_step=1000000`` answers in a second where ``--estimate`` reads every step's prompts."""
    threads = cfg.trainer.cpu_threads
    if threads is not None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if threads > cpus:
            raise ConfigError(f"trainer.cpu_threads: expected at most {cpus} (the CPUs this process may run on), "
                              f"got {threads}")
    # vLLM pages its cache and admits what fits, so only the built-in samplers hold every row.
    if not cfg.algo.rl or cfg.trainer.rl_steps < 1 or cfg.rollout.engine in SEPARATE_SAMPLERS:
        return
    from polyfsdp.backends import get_backend

    capacity = get_backend(cfg.backend).memory_capacity_bytes()
    if capacity is None:
        return
    g, t = cfg.algo.actor, cfg.trainer
    rows = t.prompts_per_step // _replicas(cfg, world_size) * g.group_size
    hf_config = hf_config_of(cfg.model.model_config()) if cfg.model.path else \
        preset_config(cfg.model.preset, **dict(cfg.model.overrides))
    floor = kv_cache_bytes(hf_config, rows, 1 + g.max_new_tokens, TORCH_DTYPES[cfg.engine.param_dtype].itemsize)
    if floor > capacity:
        raise ConfigError(
            f"trainer.prompts_per_step={t.prompts_per_step} x algo.actor.group_size={g.group_size}: a rank's "
            f"{rows} completions of up to {g.max_new_tokens} tokens need at least {floor / 2 ** 30:.1f} GiB of KV "
            f"cache, more than the {capacity / 2 ** 30:.1f} GiB this machine has per process; lower them or "
            f"algo.actor.max_new_tokens, or add ranks (--estimate prints the whole job's memory)")


def print_estimate(cfg, world_size: int) -> None:
    """Print the per-phase memory table of ``cfg``'s job on ``world_size`` ranks."""
    print(estimate_job(cfg, world_size).table())

"""``polyfsdp-train ... --estimate``: the configured job's per-rank memory, phase by phase, before anything is built.

Each phase's batches are the job's own (the data read as the job reads it, split over the ranks and into
micro-batches by the engine's planner, ``engines/batch/micro.py``), and the largest micro-batch is estimated.
What cannot be known before the run is bounded: RL completions at ``algo.actor.max_new_tokens`` (the KV
cache's size anyway), multi-turn and agent conversations over their turns (trainer/run/estimate_turns.py).
The bytes come from ``engines/memory.py`` (``ModelMemory``): exact parameter, gradient and AdamW shards, the
frozen models (a full fine-tune's reference, none with LoRA; a distillation teacher; a reward model:
trainer/rewards/estimate.py), a critic, each step's activations, head buffers, KV cache, FSDP2's unsharded
copies and AdamW's step, a colocated vLLM engine's weights and KV cache (trainer/rollout/vllm.py). On the
CPU the process's baseline and glibc's heap slack count too: the peak is its resident set.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from polyfsdp.engines.memory import HOST_PROCESS_BYTES, MIB, ModelMemory, hf_config_of, host_heap_slack
from polyfsdp.engines.batch.micro import micro_batch_sizes
from polyfsdp.engines.presets import preset_config

from ..errors import ConfigError
from ..data.sources import RL_DATA_STREAM
from ..algos.distill.teacher import teacher_memory
from ..rewards.estimate import reward_model_rows, reward_model_steps

EVAL_CHUNK = 256  # prompts per evaluation generate call (trainer/evaluation/held_out.py: COMPLETIONS_PER_CALL)
GIB = 2 ** 30
# The peak step's activations above this share of the job's peak: the estimate says what
# engine.gradient_checkpointing=true would make of them.
CHECKPOINTING_ADVICE_SHARE = 0.25


@dataclass
class Step:
    """One kind of step of a phase: what it adds on top of the phase's resident state."""

    name: str
    rows: int           # sequences in its largest micro-batch (generation: rows decoding at once)
    tokens: int         # tokens of that micro-batch (generation: rows x (prompt width + new tokens))
    transient: int      # bytes: activations, head buffers, KV cache, gradients alive during it
    resident: int       # bytes of the phase's state on the device meanwhile
    activations: int = 0            # of ``transient``: activations, head and KV cache (not gradients)
    checkpointed: int | None = None  # an update's activations with engine.gradient_checkpointing=true
    heap: int = 0       # host memory: glibc's heap slack beyond the live bytes (engines/memory.py)

    @property
    def peak(self) -> int:
        return self.resident + self.transient + self.heap


@dataclass
class JobEstimate:
    """The job's per-rank estimate: resident state rows per phase and each phase's steps."""

    header: str
    state: dict[str, dict[str, int]] = field(default_factory=dict)  # phase -> row -> bytes
    steps: dict[str, list[Step]] = field(default_factory=dict)      # phase -> steps
    notes: list[str] = field(default_factory=list)
    process: int = 0    # host memory: the process's baseline, a resident row of every phase

    def peak(self, live: bool = False) -> tuple[int, str]:
        """The largest step peak and ``"phase: step"`` naming it; ``live``: the job's live
        bytes only (no process baseline, no heap slack: what RSS shows with a fixed mmap threshold)."""
        return max((s.resident + s.transient - self.process if live else s.peak, f"{phase}: {s.name}")
                   for phase, steps in self.steps.items() for s in steps)

    def table(self) -> str:
        lines = [self.header]
        for phase, steps in self.steps.items():
            lines.append(f"\n{phase} phase: resident state{'':<25} MiB")
            for name, value in self.state[phase].items():
                lines.append(f"  {name:<48} {value / MIB:>10.2f}")
            lines.append(f"  {'step':<36} {'rows':>6} {'tokens':>8} {'step MiB':>10} "  # heap: host memory only
                         + ("heap MiB " if self.process else "") + f"{'peak MiB':>10}")
            lines += [f"  {s.name:<36} {s.rows:>6} {s.tokens:>8} {s.transient / MIB:>10.2f} "
                      + (f"{s.heap / MIB:>8.2f} " if self.process else "") + f"{s.peak / MIB:>10.2f}" for s in steps]
        value, where = self.peak()
        lines.append(f"\npeak over phases: {value / MIB:.2f} MiB ({value / GIB:.2f} GiB) per rank, at {where}")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


# ---------------------------------------------------------------------- the job's batches
def _largest(batches, budget: int | None, packed: bool, cost=None) -> tuple[int, int, int]:
    """The largest ``(rows, tokens, patches)`` micro-batch the engine makes of ``batches`` (lists of
    ``(tokens, image patches)`` sequences). The planner weighs tokens only, so a micro-batch of fewer
    tokens may hold more patches: where any holds some, ``cost(tokens, patches)`` (its bytes) tells."""
    found = [m for seqs in batches if seqs for m in micro_batch_sizes([t for t, _ in seqs], budget, packed,
                                                                       [p for _, p in seqs])]
    if cost is None or not any(m[2] for m in found):
        return max(found, key=lambda m: (m[1], m[0]), default=(0, 0, 0))  # most tokens, then rows
    return max(found, key=lambda m: (cost(m[1], m[2]), m[1], m[0]))


def _replica_shares(examples: list, replicas: int) -> list[list]:
    per = len(examples) // replicas  # Job._shard: a share per data-parallel replica
    return [examples[r * per:(r + 1) * per] for r in range(replicas)]


def _replicas(cfg, world: int) -> int:
    """Data-parallel replicas: the ranks of one sequence-parallel group hold one share."""
    return world // cfg.engine.ulysses_sp_size


class _Lengths:
    """Token counts of the job's prompts and answers, read from its data as the job reads it."""

    def __init__(self, cfg) -> None:
        from ..data.chat import example_prompt_tokens
        from ..data.sources import build_source, max_answer_tokens
        from ..data.tokenizers import CharTokenizer, load_tokenizer
        from .job_data import job_encoder  # with the job's processor: image tokens count as the job counts them

        self.note = None
        self.turns = None  # with rollout.env: the multi-turn job's lengths (trainer/run/estimate_turns.py)
        try:
            tokenizer = load_tokenizer(cfg.model.path)
        except ValueError:
            # A config-only directory: characters count as tokens (BPE tokens hold one or more).
            tokenizer = CharTokenizer()
            self.note = (f"model.path={cfg.model.path} has no tokenizer: prompt and answer lengths counted in "
                         f"characters (an upper bound for a BPE tokenizer)")
        encoder = job_encoder(cfg, tokenizer, grow_vocabulary=cfg.model.path is None or self.note is not None)
        self.source = build_source(cfg.data, cfg.trainer.seed, encoder, cfg.rollout)
        self.tokenizer = tokenizer
        self.prompt = lambda ex: len(example_prompt_tokens(tokenizer, ex))  # noqa: E731
        self.answer = lambda ex: len(tokenizer.encode(ex.answer)) + 1  # + <eos> (trainer/algos/sft.py)  # noqa: E731
        self.max_answer = lambda: max_answer_tokens(self.source, tokenizer)  # noqa: E731
        # The image patches the tower runs over: t*h*w per image, a pixel row each.
        self.patches = lambda ex: 0 if ex.pixel_values is None else len(ex.pixel_values)  # noqa: E731

    def batches(self, phase: str, steps: int, batch_size: int, replicas: int):
        """Each step's examples, per data-parallel replica."""
        for step in range(steps):
            yield from _replica_shares(self.source.batch(phase, step, batch_size), replicas)


# ---------------------------------------------------------------------- phases
@dataclass
class _Setting:
    """What every phase shares."""
    host: bool                # device memory is host memory (the CPU)
    lora: bool
    rows: dict[str, int]      # resident rows of every phase: the process baseline (host), a colocated vLLM
    sampler: int | None       # a colocated vLLM: the bytes it adds while it samples; None: the built-in decoding
    packed: bool = True       # engine.use_remove_padding (else rows are padded to the longest)


def _state_rows(prefix: str, memory: ModelMemory, host: set[str]) -> dict[str, int]:
    return {f"{prefix} parameters": 0 if "params" in host else memory.params,
            f"{prefix} AdamW state": 0 if "optimizer" in host else memory.optimizer}


def _device_grads(memory: ModelMemory, host: set[str]) -> int:
    return 0 if "grads" in host else memory.grads


def _context(lengths: _Lengths, prompt: int, new_tokens: int) -> int:
    """The longest context a turn is decoded from: the prompt, or a conversation's tokens before its last turn."""
    return prompt if lengths.turns is None else lengths.turns.conversation(prompt) - new_tokens


def _generation(name: str, rows: int, width: int, new_tokens: int, memory: ModelMemory, gathered: int,
                resident: int, setting: _Setting, patches: int = 0) -> Step:
    """Sampling ``rows`` prompts of ``width``: vLLM's share awake, or the decoding loop's KV cache
    and working set beside the gathered model (or FSDP2's per-layer gathers)."""
    if setting.sampler is not None:
        return Step(f"{name} (vLLM)", rows, rows * (width + new_tokens), setting.sampler, resident)
    work = memory.generation(rows, width, new_tokens, patches)
    return Step(f"{name} ({'KV cache' if name.startswith('rollout') else 'generation'})", rows,
                rows * (width + new_tokens), (gathered or memory.fsdp_forward) + work, resident, activations=work)


def _evaluation(cfg, lengths: _Lengths, world: int, memory: ModelMemory, new_tokens: int, resident: int,
                setting: _Setting) -> Step:
    """Greedy held-out generation (every phase evaluates): the largest chunk of one rank's prompts."""
    shares = [lengths.source.eval_examples[r::world][:EVAL_CHUNK] for r in range(world)]
    rows, width, patches = max((len(s), max((_context(lengths, lengths.prompt(ex), new_tokens) for ex in s), default=0),
                                sum(lengths.patches(ex) for ex in s)) for s in shares)
    gathered = memory.gathered if cfg.rollout.unshard is not False else 0
    return _generation("held-out evaluation", rows, width, new_tokens, memory, gathered, resident, setting, patches)


def _update(name: str, batches, memory: ModelMemory, grads: int, entropy: bool, resident: int,
            setting: _Setting) -> Step:
    """The largest training micro-batch of ``batches``: gradients, activations and head (and the
    same with checkpointing), and on the host glibc's heap slack."""
    rows, tokens, patches = _largest(batches, memory.engine_config.max_tokens_per_micro_batch, setting.packed,
                                    lambda t, p: memory.train_step(t, entropy, patches=p))
    work = memory.train_step(tokens, entropy, patches=patches)
    checkpointing = memory.engine_config.gradient_checkpointing
    checkpointed = None if checkpointing else memory.train_step(tokens, entropy, checkpointing=True, patches=patches)
    heap = host_heap_slack(work, setting.lora or checkpointing) if setting.host else 0
    return Step(name, rows, tokens, grads + work, resident, work, checkpointed, heap)


def _optimizer_step(name: str, memory: ModelMemory, grads: int, impl: str, resident: int, host: bool) -> Step:
    return Step(name, 0, 0, grads + memory.optimizer_step(impl, host), resident)  # AdamW's state is resident


def _sft_phase(cfg, lengths: _Lengths, world: int, policy: ModelMemory, setting: _Setting, est: JobEstimate,
               eval_tokens: int) -> None:
    host = policy.host_state(setting.host)
    state = {**setting.rows, **_state_rows("policy", policy, host)}
    resident = sum(state.values())
    shares = lengths.batches("sft", cfg.trainer.sft_steps, cfg.trainer.sft_batch_size, _replicas(cfg, world))
    conversations = lengths.turns is not None and lengths.turns.conversational_sft  # text only
    batches = ([(n, 0) for n in lengths.turns.sft(share)] if conversations else
               [(lengths.prompt(ex) + lengths.answer(ex), lengths.patches(ex)) for ex in share] for share in shares)
    grads = _device_grads(policy, host)
    est.state["sft"] = {**state, "policy gradients (during the update)": grads}
    est.steps["sft"] = [
        _update("update micro-batch", batches, policy, grads, False, resident, setting),
        _optimizer_step("optimizer step", policy, grads, cfg.algo.sft.optim.impl, resident, setting.host),
        _evaluation(cfg, lengths, world, policy, eval_tokens, resident, setting),
    ]


def _rl_phase(cfg, lengths: _Lengths, world: int, policy: ModelMemory, critic: ModelMemory | None,
              frozen: dict[str, ModelMemory], setting: _Setting, est: JobEstimate) -> None:
    g, t = cfg.algo.actor, cfg.trainer
    n, new = g.group_size, g.max_new_tokens
    packed, budget = cfg.engine.use_remove_padding, cfg.engine.max_tokens_per_micro_batch
    host = policy.host_state(setting.host)
    state = {**setting.rows, **_state_rows("policy", policy, host)}
    for role, model in frozen.items():
        state[f"{role} parameters (a frozen copy)"] = 0 if "params" in host else model.params
    if critic is not None:
        state.update(_state_rows("critic", critic, host))
    resident = sum(state.values())
    # The rollout of every step: each rank's prompts x group_size completions at max_new_tokens.
    shares = list(lengths.batches(RL_DATA_STREAM, t.rl_steps, t.prompts_per_step, _replicas(cfg, world)))
    prompt_lengths = [[lengths.prompt(ex) for ex in share for _ in range(n)] for share in shares]
    patches = [[lengths.patches(ex) for ex in share for _ in range(n)] for share in shares]
    gen_rows, width, gen_patches = max((len(p), max((_context(lengths, x, new) for x in p), default=0), sum(q))
                                       for p, q in zip(prompt_lengths, patches))
    full = [[_context(lengths, p, new) + new for p in ps] for ps in prompt_lengths]
    rollouts = [list(zip(ps, qs)) for ps, qs in zip(full, patches)]
    roll_rows, roll_tokens, roll_patches = _largest(rollouts, budget, packed,
                                                   lambda tokens, p: policy.inference(tokens, patches=p))
    # Update mini-batches hold whole groups; the longest groups bound the largest one.
    groups_per_rank = t.prompts_per_step // _replicas(cfg, world)
    mini_groups = -(-groups_per_rank // max(1, min(g.mini_batches(t.prompts_per_step), groups_per_rank)))
    longest = [sorted(seqs[::n], reverse=True)[:mini_groups] for seqs in rollouts]
    updates = [[seq for seq in seqs for _ in range(n)] for seqs in longest]
    loss = cfg.algo.actor_loss(t.prompts_per_step)
    need_old = cfg.algo.needs_old_log_probs(loss, has_reference=g.kl_coef > 0)
    gathered = policy.gathered if cfg.rollout.unshard is not False and setting.sampler is None else 0
    steps = [_generation("rollout generation", gen_rows, width, new, policy, gathered, resident, setting, gen_patches)]
    # The reference pass: a second engine, or (LoRA) the policy with its adapters off.
    if need_old or g.kl_coef > 0:
        work = policy.inference(roll_tokens, patches=roll_patches)
        steps.append(Step("old/ref log-prob pass (no grad)", roll_rows, roll_tokens, work, resident, work))
    taught = frozen["teacher"].inference(roll_tokens, patches=roll_patches) if "teacher" in frozen else None
    steps += [] if taught is None else [Step("teacher log-prob pass (no grad)", roll_rows, roll_tokens, taught,
                                             resident, taught)]
    if critic is not None:
        work = critic.inference(roll_tokens, patches=roll_patches)
        steps.append(Step("critic values pass (no grad)", roll_rows, roll_tokens, work, resident, work))
        steps.append(_update("critic update micro-batch", updates, critic, _device_grads(critic, host), False,
                             resident, setting))
        steps.append(_optimizer_step("critic optimizer step", critic, _device_grads(critic, host),
                                     cfg.algo.critic.optim.impl, resident, setting.host))
    grads = _device_grads(policy, host)
    steps.append(_update("actor update micro-batch", updates, policy, grads, loss.requires_entropy, resident,
                         setting))
    steps.append(_optimizer_step("actor optimizer step", policy, grads, g.optim.impl, resident, setting.host))
    steps += [Step(*step, resident, step[-1]) for step in reward_model_steps(cfg, world, full)]  # reward.model's
    steps.append(_evaluation(cfg, lengths, world, policy, new, resident, setting))
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
    from polyfsdp.backends.registry import unchecked_backend

    backend = unchecked_backend(cfg.backend)
    host_backend, lora = backend.memory_is_host, model_config.lora.enabled
    policy = ModelMemory(model_config, cfg.engine, world_size, hf_config)
    actor = cfg.algo.actor
    est = JobEstimate(
        f"memory estimate per rank: world size {world_size}, master {model_config.dtype}, compute "
        f"{cfg.engine.param_dtype}, LoRA rank {model_config.lora.rank}, offload {cfg.engine.offload}, "
        f"micro-batch budget {cfg.engine.max_tokens_per_micro_batch or 'none (a rank batch each)'}\n"
        f"model: {policy.num_params / 1e6:,.2f}M parameters, {policy.num_trainable / 1e6:,.2f}M trained"
        + ("; CPU: every row is host memory" if host_backend else ""))
    if lengths.note:
        est.notes.append(lengths.note)
    setting = _setting(cfg, backend, policy, lora, est)
    if cfg.engine.ulysses_sp_size > 1:
        est.notes.append(f"engine.ulysses_sp_size={cfg.engine.ulysses_sp_size}: each rank counts its replica's whole "
                         f"sequences; the split of the log-prob and update activations over the SP group is not "
                         f"modelled (an upper bound for those rows)")
    eval_tokens = actor.max_new_tokens if actor is not None else lengths.max_answer() + 2  # Job.eval_tokens
    if cfg.rollout.env is not None or cfg.rollout.agent is not None:
        from ..data.chat import model_max_positions
        from .estimate_turns import TurnLengths

        source = lengths.source
        lengths.turns = TurnLengths(cfg, lengths.tokenizer, source.eval_examples + getattr(source, "train_examples", []),
                                    model_max_positions(cfg.model), eval_tokens)
        est.notes.append(lengths.turns.note())
    if cfg.trainer.sft_steps > 0 or not cfg.algo.rl:
        _sft_phase(cfg, lengths, world_size, policy, setting, est, eval_tokens)
    if cfg.algo.rl:
        frozen = {"reference": ModelMemory(replace(model_config, lora=replace(model_config.lora, rank=0)), cfg.engine,
                                           world_size, hf_config)} if actor.kl_coef > 0 and not lora else {}
        critic = ModelMemory(model_config, cfg.engine, world_size, hf_config, value_head=True) \
            if cfg.algo.estimator.needs_critic else None
        _rl_phase(cfg, lengths, world_size, policy, critic, {**frozen, **teacher_memory(cfg, world_size)}, setting, est)
        if lora and actor.kl_coef > 0:
            est.notes.append("LoRA: the KL reference is the policy with its adapters off (no second copy)")
    if cfg.engine.offload != "none" and not host_backend:
        est.notes.append(f"offload={cfg.engine.offload}: the host holds the rows shown as 0 "
                         f"(python -m polyfsdp.engines.memory prints them)")
    if host_backend:
        est.notes.append(f"CPU: the peak is the process's resident set: its baseline and glibc's heap slack (heap "
                         f"MiB: holes the backward leaves in its heaps) are counted; MALLOC_MMAP_THRESHOLD_=65536 "
                         f"makes the resident set follow the live tensors ({est.peak(live=True)[0] / GIB:.2f} GiB "
                         f"here) for about a third more system time")
    est.notes += [line for line in [_checkpointing_advice(est, host_backend)] if line]
    return est


def _setting(cfg, backend, policy: ModelMemory, lora: bool, est: JobEstimate) -> _Setting:
    """The rows every phase holds: the process's baseline (host memory) and a colocated vLLM
    engine, its weights and KV cache (trainer/rollout/vllm.py; nothing of vLLM is imported)."""
    est.process = HOST_PROCESS_BYTES if backend.memory_is_host else 0
    rows = {"process baseline (python, torch, ...)": est.process} if est.process else {}
    rows.update(reward_model_rows(cfg, policy.world_size, backend))  # reward.model: its shards, every phase
    est.notes += ["rollout.engine=vllm_server: the servers' memory is their own processes' (not counted)"] \
        if cfg.rollout.engine == "vllm_server" else []
    if cfg.rollout.engine != "vllm":
        return _Setting(backend.memory_is_host, lora, rows, None, cfg.engine.use_remove_padding)
    from ..rollout.vllm import colocated_memory

    weights = policy.sampler_params * policy.compute_bytes
    awake, asleep, how = colocated_memory(cfg.rollout.vllm, weights, backend, lora)
    rows[f"vLLM ({how})"] = asleep
    est.notes.append(f"rollout.engine=vllm: vLLM holds its own copy of the weights ({weights / MIB:.2f} MiB: "
                     f"{cfg.engine.param_dtype}, the output embedding untied) and its KV cache (rollout.vllm."
                     f"kv_cache_mb, else gpu_memory_utilization of the device), "
                     + ("throughout (it does not sleep here)" if asleep else
                        "only while it samples (it sleeps while the trainer steps)")
                     + "; its start-up (vLLM's imports, a host copy of the weights to load) is not counted")
    return _Setting(backend.memory_is_host, lora, rows, awake - asleep, cfg.engine.use_remove_padding)


def _checkpointing_advice(est: JobEstimate, host: bool) -> str | None:
    """A line when the peak is an update whose activations are a large share of it
    (CHECKPOINTING_ADVICE_SHARE): what engine.gradient_checkpointing=true would leave of them
    and of the job's peak (``host``: with the heap slack of a checkpointed backward)."""
    peak, where = est.peak()
    step = next(s for phase, steps in est.steps.items() for s in steps if f"{phase}: {s.name}" == where)
    if step.checkpointed is None or step.activations < CHECKPOINTING_ADVICE_SHARE * peak:
        return None
    after = max(s.peak if s.checkpointed is None else s.peak - s.activations - s.heap + s.checkpointed
                + (host_heap_slack(s.checkpointed, True) if host else 0)
                for steps in est.steps.values() for s in steps)
    return (f"{where}: activations are {step.activations / GIB:.2f} GiB of the {peak / GIB:.2f} GiB peak; "
            f"engine.gradient_checkpointing=true would cut them to {step.checkpointed / GIB:.2f} GiB (peak "
            f"{after / GIB:.2f} GiB) for one more forward of each layer in the backward")


def print_estimate(cfg, world_size: int) -> None:
    """Print the per-phase memory table of ``cfg``'s job on ``world_size`` ranks."""
    print(estimate_job(cfg, world_size).table())

"""The rollout-engine interface, and the engine that samples with the FSDP policy itself.

An engine turns token prompts into completions; what runs examples through it (prompts from
examples, turns with an environment, rewards) is a driver (trainer/rollout/drivers/). Syncing an
engine's weights is a phase of its own: :meth:`RolloutEngine.update_weights` runs once before a
rollout (an RL step's, an evaluation's) on every rank, :meth:`RolloutEngine.generate` only samples,
and :meth:`RolloutEngine.sleep` follows the rollout. trainer/rollout/build.py builds the engine
``rollout.engine`` names (this module imports none of the implementations):

- ``builtin``: polyfsdp's decoding loop on the FSDP policy (trainer/rollout/decode.py);
- ``hf``: Hugging Face ``generate`` on the FSDP policy (ranks in lockstep without gather-once);
- ``auto``: the decoding loop wherever no rank must keep calling forward for the others,
  else HF ``generate`` (what polyfsdp did before engines were selectable), on every backend;
- ``vllm``: a vLLM engine per rank holding a copy of the policy's weights (trainer/rollout/vllm.py;
  needs vLLM installed).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


# vLLM's finish_reason for a request it cancelled (aborted: a server shutting down, a request dropped
# under memory pressure or by a client's disconnect): whatever tokens came back are no sample.
ABORTED = "abort"
# How many more times an aborted completion is requested, with the same prompt and seed (the sample
# it would have been), before the rollout stops in one line naming the engine or server.
ABORT_REDRAWS = 2


def aborted_message(who: str, row: int, rows: int, count: int | None = None) -> str:
    """The one line of a rollout that stops because ``who`` aborted row ``row`` of ``rows`` (and
    ``count`` rows in all, when known) on every try."""
    more = f" ({count} row(s) in all)" if count is not None else ""
    return (f"{who}: aborted the completion of row {row} of {rows}{more} {ABORT_REDRAWS + 1} "
            f"times with the same seed (finish_reason '{ABORTED}': vLLM cancelled the request; an aborted "
            f"completion is no sample and is never trained on); see its log for why (out of memory, shutting "
            f"down) and start the run again (trainer.resume=auto)")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one rollout's completions (the same for every prompt of a call). The
    controls after ``temperature`` mean what they mean in vLLM and Hugging Face ``generate``
    (trainer/rollout/controls/logits_shaping.py); their defaults leave the distribution untouched."""

    max_new_tokens: int
    greedy: bool = False                   # True: argmax; else sampled at ``temperature``
    temperature: float = 1.0               # used when not greedy
    stop_token_ids: tuple[int, ...] = ()   # a completion ends at (and keeps) the first one produced
    return_log_probs: bool = False
    pad_token_id: int | None = None        # for engines that pad prompts into a batch; servers ignore it
    top_p: float = 1.0                     # nucleus sampling: 1 keeps every token
    top_k: int = 0                         # the k most likely tokens; 0: all
    repetition_penalty: float = 1.0        # on tokens of the prompt and completion; 1: none
    stop: tuple[str, ...] = ()             # stop strings (trainer/rollout/controls/stop_strings.py)
    # The text a completion's tokens decode to, where stop strings are looked for (the
    # tokenizer's ``decode``: the text the reward sees); needed only with ``stop``.
    detokenize: Callable[[list[int]], str] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def for_tokenizer(cls, tokenizer, max_new_tokens: int, **options) -> "SamplingParams":
        """Parameters that stop at the tokenizer's ``<eos>`` and at its chat template's
        end-of-turn token when that is another one (trainer/data/chat.py), pad with its pad
        token and find stop strings in its decoded text."""
        from ..data.chat import end_of_turn_token_id

        turn_end = end_of_turn_token_id(tokenizer)
        stops = (tokenizer.eos_token_id,) + ((turn_end,) if turn_end is not None else ())
        return cls(max_new_tokens, stop_token_ids=stops, pad_token_id=tokenizer.pad_token_id,
                   detokenize=tokenizer.decode, **options)


@dataclass
class Completions:
    """Per prompt, the new tokens (ending at and including a stop token when produced) and, when
    asked, each token's log-prob under the distribution it was drawn from (logits / temperature)."""

    token_ids: list[list[int]]
    log_probs: list[list[float]] | None = None


class RolloutEngine:
    """The interface every ``rollout.engine`` implements (defaults: an engine without a copy of
    the weights, with nothing to free)."""

    name = "rollout engine"
    holds_weights = False            # True for engines with their own copy of the weights
    # True where generate() needs neither the trainer's device nor a collective (a server's HTTP
    # requests): it may run on a background thread while the trainer trains (trainer/algos/sample_ahead.py).
    samples_beside_training = False
    # True where generate() takes prompts with images (``images=``: one Example or None per prompt).
    takes_images = False
    # Builds the policy's processor (trainer/data/vision.py), for engines that process images themselves
    # (vLLM's): the job sets it.
    processor_factory: Callable | None = None
    weight_version = 0               # syncs done
    last_sync_s: float | None = None

    def update_weights(self, policy) -> None:
        """Bring the engine to ``policy``'s weights if they changed (collective: every rank calls it)."""
        raise NotImplementedError

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> Completions:
        """Completions of ``prompts`` with the weights of the last :meth:`update_weights` (it never
        syncs); ``seeds``: one sampling seed per prompt (trainer/rollout/row_seeds.py), else the
        process's generator draws."""
        raise NotImplementedError

    def sleep(self) -> None:
        """Free the engine's device memory between rollouts (training runs meanwhile)."""

    def wake(self) -> None:
        """Take back what :meth:`sleep` freed."""

    def close(self) -> None:
        """Free the engine's resources."""


class PolicyDecoding(RolloutEngine):
    """Sampling with the FSDP policy itself: ``loop`` is ``builtin``, ``hf`` or ``auto``
    (trainer/rollout/generate.py); ``unshard`` is ``rollout.unshard``. Its "weights" are the
    policy's own: :meth:`update_weights` binds the policy to sample with."""

    takes_images = True

    def __init__(self, loop: str = "auto", unshard="auto") -> None:
        self.loop, self.unshard, self.name = loop, unshard, loop
        self.policy = None

    def update_weights(self, policy) -> None:
        self.policy = policy

    def generate(self, prompts, params, seeds=None, images=None):
        if self.policy is None:
            raise RuntimeError(f"rollout engine {self.name}: generate before update_weights (no policy to sample with)")
        from .generate import generate  # the implementation imports this interface

        return generate(self.policy, prompts, params, unshard=self.unshard, loop=self.loop, row_seeds=seeds,
                        images=images)

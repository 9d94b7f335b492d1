"""The sampling controls beyond temperature, shared by ``algo.actor`` (RL rollouts) and ``eval``
(held-out evaluation); every rollout engine applies them (trainer/rollout/controls/logits_shaping.py,
trainer/rollout/controls/stop_strings.py)."""
from __future__ import annotations

from dataclasses import dataclass

from polyfsdp.engines.config import setting

from ..errors import ConfigError


@dataclass
class SamplingControls:
    """``top_p`` (1: off), ``top_k`` (0 or -1: off), ``repetition_penalty`` (1: off) and
    ``stop`` (strings ending a completion) as vLLM and Hugging Face define them."""

    top_p: float = setting(1.0, doc="nucleus: the most likely tokens up to this probability mass; 1: off")
    top_k: int = setting(0, doc="the k most likely tokens; 0 (or -1): off")
    repetition_penalty: float = setting(1.0, doc="tokens already in the prompt or completion: logit / p (> 0) "
                                                 "or * p (< 0); 1: off")
    stop: list | str = setting([], doc="strings that end a completion (kept, with the token completing them); one string: one stop")

    def validate_sampling(self, where: str) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"{where}.top_p: expected a number in (0, 1] (1: off), got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ConfigError(f"{where}.top_k: expected an int >= 1, or 0 / -1 (off), got {self.top_k!r}")
        if not self.repetition_penalty > 0:
            raise ConfigError(f"{where}.repetition_penalty: expected > 0 (1: off), got {self.repetition_penalty}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"{where}.stop: expected a list of non-empty strings, got {self.stop!r}")

    def sampling_options(self) -> dict:
        """The SamplingParams keywords (trainer/rollout/engines.py) of these controls."""
        return {"top_p": float(self.top_p), "top_k": int(self.top_k),
                "repetition_penalty": float(self.repetition_penalty), "stop": tuple(self.stop)}

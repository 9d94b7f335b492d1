"""The sampling controls beyond temperature, shared by ``algo.actor`` (RL rollouts) and ``eval``
(held-out evaluation); every rollout engine applies them (trainer/rollout/controls/logits_shaping.py,
trainer/rollout/controls/stop_strings.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError


@dataclass
class SamplingControls:
    """``top_p`` (1: off), ``top_k`` (0 or -1: off), ``repetition_penalty`` (1: off) and
    ``stop`` (strings ending a completion) as vLLM and Hugging Face define them."""

    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    stop: list = field(default_factory=list)

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

"""The sampling controls beyond temperature, one definition for every rollout engine: the step's
distribution (logits_shaping.py: repetition penalty, top-k, top-p) and stop strings
(stop_strings.py)."""

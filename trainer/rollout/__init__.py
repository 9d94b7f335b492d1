"""Rollouts: the rollout-engine interface and its engines (own decode loop, Hugging Face generate,
vLLM), the drivers that run examples through an engine (single-turn, multi-turn environments and
tools: ``drivers/``), the factory of both, and dynamic sampling.
"""

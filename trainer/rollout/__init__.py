"""Rollouts: sampling completions (own decode loop, Hugging Face generate, vLLM), the
rollout-engine interface, multi-turn environments and tools, dynamic sampling.
"""

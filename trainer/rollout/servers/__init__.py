"""Pushing trained weights to separate vLLM OpenAI servers through vLLM's weight-transfer protocol."""

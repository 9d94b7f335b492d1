"""Rollout servers (``rollout.engine=vllm_server``): vLLM OpenAI servers in processes of their own,
the trained weights pushed to them through vLLM's weight-transfer protocol."""

"""Rollout servers (``rollout.engine=vllm_server``): vLLM OpenAI servers in processes of their own."""

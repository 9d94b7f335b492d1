"""The model itself: building a Hugging Face model from a config (never downloading),
LoRA adapters, the optimizer and schedules, and streaming the full
weights out of the shards.
"""

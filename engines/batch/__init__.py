"""The engine's batch: the flat packed layout (FlatBatch), its value checks, micro-batches
under a token budget, and token-balanced data-parallel shares.
"""

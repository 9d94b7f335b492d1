"""The LM head's side of the forward: hidden states -> per-token log-probs and entropy
(the fused, chunked head and its compiled kernels), and the critic's value head.
"""

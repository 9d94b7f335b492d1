"""Keywords of varlen (packed) attention that polyfsdp adds to transformers' own.

The engine builds a packed row's model inputs (``cu_seq_lens_q``/``_k``, ``max_length_q``/``_k``,
transformers' names) and every attention function a backend picks (``Backend.attn_implementation``:
``polyfsdp_varlen_sdpa`` on CPUs and CUDA, the fusion-attention patch on NPUs) reads them, so
the names both sides share live here, below the engine and the patches, not in one backend's
patch.
"""

# A host copy (list of ints) of ``cu_seq_lens_q``: functions that need the boundaries on the
# host read it instead of the device tensor, which would stall the device once per layer.
HOST_CU_SEQ_LENS = "polyfsdp_host_cu_seq_lens"

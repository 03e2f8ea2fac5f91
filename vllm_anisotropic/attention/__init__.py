"""Tree attention without vLLM: the log-sum-exp split (``tree_attention``), its fused Triton
kernel (``tree_attention_triton``) and random paged tree batches with their float64
reference (``random_batch``, for the engine's start-up self-test and the kernel check).
"""

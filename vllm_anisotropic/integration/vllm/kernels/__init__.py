"""Attention implementations and GEMM used inside the engine: the CPU tree-attention backend
(``attention``), the FLASH_ATTN tree adapter with its start-up self-test (``gpu_attention``),
and vLLM's CPU GEMM for the draft model's linear layers (``cpu_gemm``). The vLLM-free
attention math is in ``vllm_anisotropic.attention``.
"""

"""vllm-anisotropic: tree speculative decoding for unmodified vLLM.

The core (``tree``, ``proposers``, ``verifiers``, ``allocator``, ``models``, ``data``) never
imports vLLM; ``vllm_anisotropic.integration.vllm`` is the only package that does.
"""

__version__ = "0.1.0"

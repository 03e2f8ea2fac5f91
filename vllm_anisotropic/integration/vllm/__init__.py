"""The only package of vllm-anisotropic that imports vLLM.

``plugin.register`` is the ``vllm.general_plugins`` entry point; vLLM calls it once in every
process it starts (the front end, EngineCore, each worker).
"""

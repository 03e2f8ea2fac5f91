"""The front door: how vLLM finds and configures vllm-anisotropic.

``plugin.register`` (the ``vllm.general_plugins`` entry point), the speculative-config schema
(``config``), ``patches`` (the one module that patches vLLM at runtime) with ``vllm_surface``
(the checked list of private vLLM names it relies on), ``serve_cli`` and the ``proposer`` class.
"""

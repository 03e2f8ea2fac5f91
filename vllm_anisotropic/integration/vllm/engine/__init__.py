"""Engine overrides installed by the front door: the tree worker, model runner (CPU and GPU),
sampler, scheduler and drafter, the step budget, KV moves after acceptance, host timing and
the ``vllm_anisotropic:*`` metrics.
"""

"""Adapters to serving engines. Only ``integration.vllm`` imports vLLM."""

"""What vLLM gives the target's KV cache with ``draft_tree`` on, and what q's KV holds (issue 45).

Qwen2.5-Coder-1.5B-Instruct target, Qwen2.5-Coder-0.5B-Instruct draft, bf16 (q in the target's
dtype: ``draft_dtype`` "auto"), ``kv_cache_memory_bytes`` 1 GiB, 4 MBPP prompts (chat) x 32
tokens at once, greedy. One engine per row, each in its own process: plain vLLM; ``draft_tree``
with its defaults (the reserve is q's share of KV bytes per token); a fixed chain of 4 (q runs
every step: at four requests the defaults' selector drafts nothing); the chain with
``draft_kv_bytes`` 2 MiB (~170 tokens of q: the sessions are dropped after every step and
rebuilt). Printed per row: the target's KV blocks and tokens, the reserve, the most q's sessions
held after a step, the sessions dropped, tokens/s, and whether the output is plain's::

    PYTHONPATH=. .venv/bin/python docs/measurements/cpu/draft_kv_reserve_qwen_2026_12_02.py
"""

from __future__ import annotations

import json
import platform
import tempfile
from pathlib import Path

from vllm_anisotropic.bench.offline import OfflineJob, run_offline_job
from vllm_anisotropic.data import load_dataset
from vllm_anisotropic.data.formatting import format_prompt
from vllm_anisotropic.integration.vllm.engine.metrics import STATS_ENV
from vllm_anisotropic.models.prepare import model_path

KV = 1 << 30
# the defaults draft nothing at four requests (the shipped selector's choice, docs/selector.md):
# a fixed chain of 4 with the allocator off makes q run every step
CHAIN = {"trunk": 4, "branches": 1, "branch_length": 0, "selector": "off", "allocator": "off"}


def main() -> None:
    target, draft = str(model_path("qwen2.5-coder-1.5b")), str(model_path("qwen2.5-coder-0.5b"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    prompts = [format_prompt(p, tok, "chat") for p in load_dataset("mbpp", limit=4)]
    rows = [("plain", None),
            ("draft_tree (defaults)", {"method": "draft_tree", "model": draft}),
            ("draft_tree chain of 4", {"method": "draft_tree", "model": draft, **CHAIN}),
            ("draft_tree chain of 4, draft_kv_bytes 2 MiB", {"method": "draft_tree", "model": draft, **CHAIN,
                                                             "draft_kv_bytes": 2 << 20})]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"# {cpu}; kv_cache_memory_bytes {KV}; 4 MBPP prompts x 32 tokens at once, bf16, greedy")
    print("| engine | target KV blocks | target KV tokens | q reserve MiB | q KV peak bytes | "
          "q sessions dropped | tokens/s | output = plain |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    plain = None
    for name, spec in rows:
        with tempfile.TemporaryDirectory() as tmp:
            stats = Path(tmp) / "stats.json"
            job = OfflineJob(model=target, prompts=prompts, max_tokens=32, speculative_config=spec,
                             llm_kwargs={"dtype": "bfloat16", "kv_cache_memory_bytes": KV, "max_model_len": 2048,
                                         "enforce_eager": True})
            out = run_offline_job(job, env={STATS_ENV: str(stats)})
            tree = json.loads(stats.read_text()) if stats.exists() else {}
        plain = plain or out
        print(f"| {name} | {out.kv_cache_blocks} | {out.kv_cache_blocks * out.kv_cache_block_size} | "
              f"{tree.get('draft_kv_bound_bytes', 0) / 2**20:.1f} | {tree.get('draft_kv_peak_bytes', 0)} | "
              f"{tree.get('draft_kv_evictions', 0)} | {out.tokens_per_second:.2f} | "
              f"{sum(a == b for a, b in zip(out.token_ids, plain.token_ids))}/{len(prompts)} |", flush=True)


if __name__ == "__main__":
    main()

"""Host cost of TreeCPUAttentionImpl._main_plan a step: 30 layers' calls (one build, 29 cache hits) on vLLM's
CPUAttentionMetadata, 9-node trees (spine of 4), 1 / 8 / 64 requests, 200 repeats (median, min), microseconds.
    .venv/bin/python docs/measurements/cpu/main_plan_cost_2026_11_30.py"""
import time, numpy as np, torch
from types import SimpleNamespace
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata
from vllm import _custom_ops as ops
from vllm_anisotropic.integration.vllm.kernels.attention import TreeCPUAttentionImpl
from vllm_anisotropic.integration.vllm.engine.runner import TreePlan
from vllm_anisotropic.tree import DraftTree, FlatTrees
impl = object.__new__(TreeCPUAttentionImpl)
impl.num_heads, impl.head_size, impl.num_kv_heads, impl.kv_cache_dtype = 9, 64, 3, "auto"
parents = [-1, 0, 1, 2, 3, 0, 1, 2, 4]
tree = DraftTree(tokens=np.zeros(9, dtype=np.int64), parents=np.array(parents), values=np.zeros(9))
for R in (1, 8, 64):
    qsl = torch.arange(0, 9 * R + 1, 9, dtype=torch.int32); sl = torch.full((R,), 400, dtype=torch.int32)
    md = CPUAttentionMetadata(num_actual_tokens=9 * R, max_query_len=9, query_start_loc=qsl, max_seq_len=400, seq_lens=sl,
        block_table=torch.zeros(R, 4, dtype=torch.int32), slot_mapping=torch.zeros(9 * R, dtype=torch.int64), scheduler_metadata=None)
    ts = []
    for _ in range(200):
        plan = TreePlan(list(range(R)), FlatTrees.from_trees([tree] * R))
        t0 = time.perf_counter()
        for _ in range(30): impl._main_plan(plan, md, torch.float32, "vec")
        ts.append((time.perf_counter() - t0) * 1e6)
    print(f"R={R}: 30 layers' _main_plan {np.median(ts):.0f} us (min {min(ts):.0f})")

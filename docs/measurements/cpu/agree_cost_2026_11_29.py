"""Cost of the tensor-parallel ranks' per-tree-step agreement: two ranks on this machine, flags
of 1 + batch rows, median over 2,000 calls after 200 warm-up calls; an all-reduce on the gloo
CPU group (``torch.distributed``) next to ``faults.agree`` on vLLM's own TP group (its CPU
communicator: shared memory).
Run: ``.venv/bin/python docs/measurements/cpu/agree_cost_2026_11_29.py``."""

import multiprocessing as mp
import sys
import tempfile
import time


def _rank(rank, path, out):
    import os

    import numpy as np
    import torch
    import torch.distributed as dist

    os.environ.setdefault("VLLM_DIST_IDENT", "agree-cost")
    from vllm.distributed.parallel_state import (get_tp_group, init_distributed_environment,
                                                 initialize_model_parallel)

    from vllm_anisotropic.integration.vllm.engine.faults import agree

    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=2, rank=rank, distributed_init_method=f"file://{path}",
                                     local_rank=rank, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=2)
    group = get_tp_group()

    def gloo(flags):
        t = torch.from_numpy(flags.astype(np.int32))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.cpu_group)
        return t.numpy() > 0

    for name, call in (("gloo cpu_group", gloo), ("faults.agree (vLLM TP group)", lambda f: agree(f, group))):
        for batch in (1, 8, 64, 256):
            flags = np.zeros(batch + 1, bool)
            for _ in range(200):
                call(flags)
            times = []
            for _ in range(2000):
                t0 = time.perf_counter()
                call(flags)
                times.append(time.perf_counter() - t0)
            if rank == 0:
                out.put((name, batch, float(np.median(times)) * 1e6, float(np.percentile(times, 90)) * 1e6))


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    path = tempfile.mktemp()
    procs = [ctx.Process(target=_rank, args=(r, path, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    with open("/proc/cpuinfo") as f:
        cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    print(f"CPU: {cpu}; python {sys.version.split()[0]}")
    print("all-reduce | batch rows | median us | p90 us")
    for _ in range(8):
        name, batch, med, p90 = out.get(timeout=300)
        print(f"{name} | {batch} | {med:.1f} | {p90:.1f}")
    for p in procs:
        p.join()

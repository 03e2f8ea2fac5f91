# A diagnostic for bench runs, not part of the package: put this directory on PYTHONPATH and set
# GATE_DIAG=file.jsonl; every process that imports vllm_anisotropic.allocator.gate logs each
# SpeculationGate.observe call (batch size, arm: 1 speculative / 0 plain, tokens, seconds, clipped seconds).
# Used by dtree_first_steps_compile_2026_12_08.txt and warmup_tokens_ab_2026_12_07_gate_trace.jsonl.
import json, os, statistics, time
path = os.environ.get("GATE_DIAG")
if path:
    try:
        from vllm_anisotropic.allocator import gate as _g
        _orig = _g.SpeculationGate.observe
        def observe(self, num_reqs, speculative, tokens, seconds):
            b = self._bucket(num_reqs)
            c = self.config
            clipped = min(seconds, c.clip * statistics.median(b.recent)) if len(b.recent) >= c.window // 4 else seconds
            with open(path, "a") as f:
                f.write(json.dumps({"t": time.time(), "r": num_reqs, "arm": int(speculative), "tokens": tokens,
                                    "s": round(seconds, 4), "clipped": round(clipped, 4), "n": len(b.recent)}) + "\n")
            return _orig(self, num_reqs, speculative, tokens, seconds)
        _g.SpeculationGate.observe = observe
    except Exception as e:  # noqa
        pass

"""How many of a step's harvested rows a later row of the same step overwrites in the table
(same (prev, token) key): every AdjacencyTable.harvest call of a step counted, under
profile-host (in-process engine), before last_writes (package code = f251c72).
Usage: for c in 8 64; do PYTHONPATH=. .venv/bin/python docs/measurements/cpu/harvest_repeated_keys_2026_12_05.py profile-host \\
  --method goose-b8 --max-num-seqs $c --num-prompts $c --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile; done
"""
import sys, atexit, numpy as np
from vllm_anisotropic.proposers import goose, adjacency
stats = {"rows": 0, "dead": 0, "steps": 0}
orig = adjacency.AdjacencyTable.harvest
def harvest(self, prev, tokens, logits):
    p = np.asarray(prev, np.int64); t = np.asarray(tokens, np.int64)
    if len(t) and len(t) < 4096:  # a step's rows (not a prefill chunk)
        keys = p * 10**6 + t
        _, first_from_end = np.unique(keys[::-1], return_index=True)
        stats["rows"] += len(t); stats["dead"] += len(t) - len(first_from_end); stats["steps"] += 1
    return orig(self, prev, tokens, logits)
adjacency.AdjacencyTable.harvest = harvest
atexit.register(lambda: print("DUPS", stats, "dead share %.3f" % (stats["dead"] / max(1, stats["rows"]))))
from vllm_anisotropic.cli import main
sys.exit(main(sys.argv[1:]))

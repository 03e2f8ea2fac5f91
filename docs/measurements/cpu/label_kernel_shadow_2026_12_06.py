"""The label queue of 700c0ba (kernels/label.py) in the engine, mirrored by the queue it replaced (c8a048c's
labels.py, read from the worktree /tmp/A): every take's histograms compared with the old queue's labels binned by
AcceptanceModel.update (counts and accepted counts exactly, sums of logits to 1e-9). Usage, in a worktree of 700c0ba:
    PYTHONPATH=. VLLM_LOGGING_LEVEL=WARNING .venv/bin/python docs/measurements/cpu/label_kernel_shadow_2026_12_06.py \
        profile-host --method goose-auto --max-num-seqs 1 --num-prompts 8 --dataset mbpp,math500 --max-tokens 128 --no-profile"""
import importlib.util, sys, atexit
import numpy as np
spec = importlib.util.spec_from_file_location("old_labels", "/tmp/A/vllm_anisotropic/integration/vllm/engine/labels.py")
old = importlib.util.module_from_spec(spec); sys.modules["old_labels"] = old; spec.loader.exec_module(old)
from vllm_anisotropic.integration.vllm.engine import labels as new
from vllm_anisotropic.allocator import AcceptanceModel
stats = {"takes": 0, "ready": 0, "diff": 0, "maxdiff": 0.0, "nodes": 0}
Q = new.LabelQueue
o_offer, o_drop, o_take = Q.offer, Q.drop, Q.take
def shadow(self):
    s = self.__dict__.get("_shadow")
    if s is None:
        s = self.__dict__["_shadow"] = old.LabelQueue(self.label_depth)
    return s
def offer(self, trees, index, req_ids, starts):
    shadow(self).offer(trees, index, list(req_ids), np.array(starts))
    return o_offer(self, trees, index, req_ids, starts)
def drop(self, r):
    shadow(self).drop(r); return o_drop(self, r)
def take(self, req_ids, num_tokens, token_ids, config):
    want = shadow(self).take(list(req_ids), num_tokens.copy(), token_ids.copy())
    got = o_take(self, req_ids, num_tokens, token_ids, config)
    stats["takes"] += 1
    if (want is None) != (got is None):
        stats["diff"] += 1; return got
    if want is None: return got
    stats["ready"] += 1
    m = AcceptanceModel(config); m.update(*want)
    stats["nodes"] += len(want[0])
    d = np.abs(m.histograms - got)
    if not (np.array_equal(m.histograms[:2], got[:2]) and d[2].max() < 1e-9):
        stats["diff"] += 1
    stats["maxdiff"] = max(stats["maxdiff"], float(d.max()))
    return got
Q.offer, Q.drop, Q.take = offer, drop, take
atexit.register(lambda: print("SHADOW", stats, file=sys.stderr))
from vllm_anisotropic.cli import main
sys.exit(main())

"""Host cost of the scheduler's grammar work per tree: prune (check/accept/rollback per node) and
the node mask rows (one fill per scheduled node), xgrammar, tiny model tokenizer (49,152 tokens)."""
import json, time, platform
import numpy as np, xgrammar as xgr
from transformers import AutoTokenizer
from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar
from vllm_anisotropic.models import build_tiny_model
from vllm_anisotropic.integration.vllm.engine.tree_grammar import prune_tree, tree_bitmask_rows

tok = AutoTokenizer.from_pretrained(str(build_tiny_model()))
V = len(tok)
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
schema = {"type": "object", "required": ["name", "items"], "properties": {"name": {"type": "string"},
          "items": {"type": "array", "items": {"type": "object", "required": ["key", "on"],
          "properties": {"key": {"enum": ["alpha", "beta"]}, "on": {"type": "boolean"}}}}}}
compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False)
g = XgrammarGrammar(vocab_size=V, matcher=xgr.GrammarMatcher(compiled), ctx=compiled)
rng0 = np.random.default_rng(1)
bits = xgr.allocate_token_bitmask(1, V)
valid = []
for _ in range(40):  # a valid continuation: a random allowed token at each state
    g.fill_bitmask(bits, 0)
    allowed = np.flatnonzero(np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")[0, :V])
    allowed = allowed[allowed != tok.eos_token_id]
    t = int(rng0.choice(allowed))
    assert g.accept_tokens("r", [t])
    valid.append(t)
g.rollback(40)
rng = np.random.default_rng(0)
print("cpu:", open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": \t"), "| avx512f:", " avx512f " in open("/proc/cpuinfo").read())
for n in (8, 16, 32, 64):
    # a valid chain of n/2 nodes, each with one sibling: half valid (a plausible token), half not
    c = n // 2
    tokens, parents = [], []
    for d in range(c):
        parent = 0 if d == 0 else 2 * d - 1  # the previous chain node (local index)
        tokens += [valid[d], int(rng.integers(0, V))]
        parents += [parent, parent]
    reps = 50
    t0 = time.perf_counter()
    for _ in range(reps):
        kept, newp = prune_tree(g, "r", tokens, parents)
    t_prune = (time.perf_counter() - t0) / reps
    rows = xgr.allocate_token_bitmask(n, V)
    kt = [tokens[k - 1] for k in kept]
    t0 = time.perf_counter()
    for _ in range(reps):
        tree_bitmask_rows(g, "r", kt, newp, rows)
    t_rows = (time.perf_counter() - t0) / reps
    print(f"{n} nodes ({kept.size} kept): prune {t_prune*1e3:.3f} ms, node rows {t_rows*1e3:.3f} ms "
          f"({t_rows/kept.size*1e6:.0f} us a row)")

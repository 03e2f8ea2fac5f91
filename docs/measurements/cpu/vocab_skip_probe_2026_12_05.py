"""How far below a row's largest logit do the blocks of 256 vocabulary entries sit? Real rows of
SmolLM2-135M (bf16, transformers on the CPU): 4 prompts of each of humaneval, gsm8k, mtbench,
64 greedy tokens each; every row a generated token was predicted from. Prints, per gap T (natural
log units), the share of blocks whose largest entry is more than T below the row's largest, and
the largest relative change of the normaliser s = sum exp(l - m) when those blocks are left out
(float64)."""
import sys, time
import numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm_anisotropic.bench.tau import load_prompts
path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).eval()
rows = []
for ds in ("humaneval", "gsm8k", "mtbench"):
    for ids in load_prompts(ds, 4, 0, tok, "chat"):
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(x, max_new_tokens=64, do_sample=False, output_logits=True, return_dict_in_generate=True)
        rows += [l[0].to(torch.bfloat16) for l in out.logits]
L = torch.stack(rows).double().numpy()
V = L.shape[1]
nb = (V + 255) // 256
pad = np.full((L.shape[0], nb * 256 - V), -np.inf)
B = np.concatenate([L, pad], 1).reshape(L.shape[0], nb, 256)
m = L.max(1, keepdims=True)
gap = m - B.max(2)  # [rows, blocks]
e = np.exp(B - m[:, :, None])
s = e.sum((1, 2))
blk = e.sum(2)
print(f"{L.shape[0]} rows of {V} logits, {nb} blocks of 256; gap quantiles (10/50/90 %):",
      np.percentile(gap, [10, 50, 90]).round(1).tolist())
for T in (12, 16, 20, 25, 30):
    skip = gap > T
    rel = (blk * skip).sum(1) / s
    print(f"T={T:2d}: blocks skipped {skip.mean():.1%} (rows: 10/50/90 % {np.percentile(skip.mean(1), [10, 50, 90]).round(3).tolist()}), "
          f"largest relative change of s {rel.max():.2e}")

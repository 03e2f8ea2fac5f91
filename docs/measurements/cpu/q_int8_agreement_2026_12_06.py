# Run: PYTHONPATH=. .venv/bin/python docs/measurements/cpu/q_int8_agreement_2026_12_06.py 8 64  (needs qwen2.5-coder-0.5b and -1.5b prepared)
"""q int8 vs bf16 (Qwen2.5-Coder-0.5B, fused CPU layers): how often q's argmax is the target's (Qwen2.5-Coder-1.5B, transformers,
bf16) greedy next token, teacher-forced over the target's own greedy continuation of report-split prompts; and q's decode time."""
import sys, time, os, numpy as np, torch
torch.set_num_threads(2)
from transformers import AutoTokenizer, AutoModelForCausalLM
from vllm_anisotropic.proposers.draft_model import DraftLM
from vllm_anisotropic.proposers.draft_kv import DraftKV
from vllm_anisotropic.integration.vllm.kernels.cpu_draft import use_vllm_cpu_layers, warm_up
from vllm_anisotropic.integration.vllm.kernels.cpu_gemm import use_vllm_cpu_gemm
from vllm_anisotropic.bench.tau import load_prompts
M = os.path.expanduser("~/.cache/vllm-anisotropic/models/")
N, NEW = int(sys.argv[1]), int(sys.argv[2])
tok = AutoTokenizer.from_pretrained(M + "qwen2.5-coder-1.5b")
prompts = []
for ds in ("mbpp", "math500"):
    prompts += load_prompts(ds, N, 200, tok, "chat")  # offset 200: away from the bench's prompts
target = AutoModelForCausalLM.from_pretrained(M + "qwen2.5-coder-1.5b", torch_dtype=torch.bfloat16)
seqs = []
t0 = time.time()
with torch.inference_mode():
    for p in prompts:
        out = target.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)
        seqs.append((len(p), out[0].tolist()))
print(f"target continuations: {len(seqs)} x {NEW} tokens in {time.time()-t0:.0f} s", flush=True)
del target
class S:
    def __init__(s): s.tokens=[]; s.forwarded=0; s.slot=None; s.last_step=0
res = {}
for quant in ("none", "int8"):
    lm = DraftLM(M + "qwen2.5-coder-0.5b", dtype=torch.bfloat16)
    assert use_vllm_cpu_layers(lm, quant); use_vllm_cpu_gemm(lm.model, quant); warm_up(lm)
    kv = DraftKV(lm)
    agree = total = 0; picks = []
    with torch.inference_mode():
        for plen, seq in seqs:
            sess = [S()]; kv.place(sess, [len(seq) + 8])
            logits = kv.forward(1, [seq], [0], [None], [0], want="all")
            pred = logits.argmax(-1).numpy()[plen - 1 : len(seq) - 1]
            truth = np.asarray(seq[plen:])
            agree += int((pred == truth).sum()); total += len(truth); picks.append(pred)
            kv.drop(sess[0])
    # decode time: 1 row after 300
    sess = [S()]; kv.place(sess, [320]); kv.forward(1, [seqs[0][1][:300]], [0], [None], [0])
    ts = []
    for i in range(18):
        t = time.perf_counter(); kv.forward(1, [[5]], [300], [None], [300]); ts.append(time.perf_counter() - t)
    res[quant] = (agree / total, np.concatenate(picks), 1e3 * np.median(ts[3:]))
    print(f"q {quant}: agrees with the target's next token {agree}/{total} = {agree/total:.4f}; decode forward (1 row after 300) median {res[quant][2]:.1f} ms", flush=True)
    del kv, lm
same = float((res["none"][1] == res["int8"][1]).mean())
print(f"int8 q's argmax = bf16 q's argmax at {same:.4f} of positions")

"""vLLM's own draft_model (the target drafting for itself, k = 2, T = 0.7, seeded, float32), in
process: what vLLM's rejection sampler receives -- whether draft probabilities came with the drafts
(probs_none), how many draft rows hold an infinite logit after the sampler's temperature / top-p
(inf_logit_rows) and the target probability of the drafted tokens.

    [VLLM_PLUGINS=none] .venv/bin/python docs/measurements/cpu/draft_model_rows_probe_2026_12_04.py MODEL_DIR
"""
import os, sys, json
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from vllm import LLM, SamplingParams
from vllm.v1.worker import gpu_model_runner as gmr
from vllm.v1.sample import rejection_sampler as rsm
stats = {"calls": 0, "probs_none": 0, "rows": 0, "ratio_sum": 0.0, "q_at_draft_zero": 0, "p_at_draft_sum": 0.0}
orig = rsm.rejection_sample
def wrapped(draft_token_ids, num_draft_tokens, max_spec_len, cu, draft_probs, target_logits, bonus, md, *a, **k):
    stats["calls"] += 1
    if not md.all_greedy:
        p = target_logits.float().softmax(-1)  # already temperature-scaled by apply_sampling_constraints
        pd = p.gather(1, draft_token_ids.long()[:, None]).squeeze(1)
        nanrow = torch.isnan(p).any(-1)
        stats["nan_rows"] = stats.get("nan_rows", 0) + int(nanrow.sum())
        stats["inf_logit_rows"] = stats.get("inf_logit_rows", 0) + int(torch.isinf(target_logits).any(-1).sum())
        stats["p_at_draft_sum"] += pd[~nanrow].sum().item(); stats["rows"] += len(pd)
        if stats["calls"] < 3:
            print("DBG logits", target_logits[:, :5].tolist(), target_logits.dtype, file=sys.stderr)
        if draft_probs is None:
            stats["probs_none"] += 1
        else:
            qd = draft_probs.gather(1, draft_token_ids.long()[:, None]).squeeze(1)
            stats["q_at_draft_zero"] += int((qd == 0).sum())
            stats["ratio_sum"] += (pd / qd.clamp_min(1e-30)).clamp(max=1).sum().item()
            if stats["calls"] < 4:
                print("DBG tv(p,q) per row", (0.5 * (p - draft_probs).abs().sum(-1)).tolist(), file=sys.stderr)
    return orig(draft_token_ids, num_draft_tokens, max_spec_len, cu, draft_probs, target_logits, bonus, md, *a, **k)
rsm.rejection_sample = wrapped
def main():
    model = sys.argv[1]
    llm = LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
              speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 2}, disable_log_stats=False)
    prompts = ["Write a Python function that returns the n-th Fibonacci number.", "Explain why the sky is blue in three sentences."]
    sps = [SamplingParams(temperature=0.7, max_tokens=32, seed=100 + i, ignore_eos=True) for i in range(len(prompts))]
    llm.generate(prompts, sps, use_tqdm=False)
    m = {x.name: getattr(x, "value", None) for x in llm.get_metrics() if "spec_decode" in x.name}
    print(json.dumps({"plugins": os.environ.get("VLLM_PLUGINS"), **stats, **m}))
if __name__ == "__main__":
    main()

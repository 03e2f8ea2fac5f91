#!/usr/bin/env bash
# profile-host --no-profile of this tree, one run per (method, concurrency): plain decoding and
# vLLM's ngram (k = 5) for scale, goose-b8 (a fixed 8-node tree, allocator off) and goose-nogate
# (the allocator on, trees offered every step) at 1 / 8 / 64 requests; bf16, 128 tokens.
# Records: docs/measurements/cpu/host_ab_after_2026_12_02e.jsonl (one tree: no "before" file);
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py 2026_12_02e
#   bash docs/measurements/cpu/host_final_2026_12_02.sh
set -u
cd /work/main
for c in 1 8 64; do
  n=$(( c <= 1 ? 4 : (c <= 8 ? 8 : 22) ))
  for m in plain ngram5 goose-b8 goose-nogate; do  # ngram's own host work: its "propose" phase
    echo "== $m c=$c" >&2
    VLLM_LOGGING_LEVEL=WARNING .venv/bin/python -m vllm_anisotropic.cli profile-host \
      --method $m --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
      --json docs/measurements/cpu/host_ab_after_2026_12_02e.jsonl 2>&1 | grep -v WARNING | grep -E "tokens/s|ms/step" | head -3
  done
done

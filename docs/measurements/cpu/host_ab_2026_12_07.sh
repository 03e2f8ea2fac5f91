#!/usr/bin/env bash
# Issue 43's host work per step on this machine, one tree (035f3f7), one run each: profile-host --no-profile,
# SmolLM2-135M bf16, 128 tokens, humaneval,gsm8k,mtbench. goose-b8 (allocator off: an 8-node tree verified every
# step, the GPU projection's method) at 1 / 8 / 16 / 32 / 64 requests; goose-auto (the default), plain and vLLM
# ngram (k = 5) at 1 / 8 / 64, in that order at each concurrency.
# Records: docs/measurements/cpu/host_ab_after_2026_12_07.jsonl
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py 2026_12_07
#   git worktree add /tmp/wt45 035f3f7 && bash docs/measurements/cpu/host_ab_2026_12_07.sh
set -u
tree=/tmp/wt45
out=/work/main/docs/measurements/cpu/host_ab_after_2026_12_07.jsonl
run() {  # method conc
  local m=$1 c=$2
  local n=$(( c <= 1 ? 4 : (c <= 8 ? 8 : c) ))
  echo "== $(date -u +%H:%M:%S) $m c=$c"
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method $m --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --json $out 2>&1 | grep -v WARNING | grep -E "tokens/s|ms/step" | head -3)
}
lscpu | grep -E 'Model name'
(cd $tree && git log --oneline | head -1)
for c in 1 8 64; do
  for m in goose-b8 goose-auto plain ngram5; do run $m $c; done
done
run goose-b8 16
run goose-b8 32
echo "== $(date -u +%H:%M:%S) done"

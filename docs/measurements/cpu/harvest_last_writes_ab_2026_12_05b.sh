#!/usr/bin/env bash
# The final code of the change (after = acd64d1: last_writes, the k-th block maximum by insertion, and the
# all-rows-kept fast path of learn_batch) against before = a08f20e (package code = f251c72), profile-host --no-profile
# of goose-b8 at 1 and 8 requests ABBA; SmolLM2-135M bf16, 128 tokens.
# Worktrees: /tmp/lb (a08f20e), /tmp/lc (the after commit). Output: harvest_last_writes_ab_2026_12_05b.txt and
# harvest_last_writes_{before,after}_2026_12_05b.jsonl
set -u
out=/work/main/docs/measurements/cpu
run() {  # tree conc tag
  local tree=$1 c=$2 tag=$3
  local n=$(( c <= 1 ? 4 : c ))
  echo "== $(date -u +%H:%M:%S) $tag goose-b8 c=$c"
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method goose-b8 --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --json $out/harvest_last_writes_${tag}_2026_12_05b.jsonl 2>&1 | grep -E "tokens/s|ms/step wall|plugin's own|  (propose|walk|harvest|topk) ")
}
lscpu | grep -E 'Model name'
(cd /tmp/lc && git log --oneline | head -1)
for c in 1 8; do
  run /tmp/lb $c before
  run /tmp/lc $c after
  run /tmp/lc $c after
  run /tmp/lb $c before
done

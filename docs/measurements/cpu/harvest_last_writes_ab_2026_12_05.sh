#!/usr/bin/env bash
# The harvest without the top-k of rows a later row of the step overwrites in the same table
# (kernels.table.last_writes) and with the k-th block maximum by insertion (after = 576819c) against
# every row's top-k (before = a08f20e, package code = f251c72): profile-host --no-profile of goose-b8
# (an 8-draft tree every step, allocator off) at 1, 8 and 64 requests ABBA; SmolLM2-135M bf16, 128 tokens.
# Worktrees: git worktree add /tmp/lb a08f20e; git worktree add /tmp/la 576819c.
# Output: docs/measurements/cpu/harvest_last_writes_ab_2026_12_05.txt and harvest_last_writes_{before,after}_2026_12_05.jsonl
set -u
out=/work/main/docs/measurements/cpu
run() {  # tree conc tag
  local tree=$1 c=$2 tag=$3
  local n=$(( c <= 1 ? 4 : c ))
  echo "== $(date -u +%H:%M:%S) $tag goose-b8 c=$c"
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method goose-b8 --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --json $out/harvest_last_writes_${tag}_2026_12_05.jsonl 2>&1 | grep -E "tokens/s|ms/step wall|plugin's own|  (propose|walk|harvest|topk) ")
}
lscpu | grep -E 'Model name'
for c in 1 8 64; do
  run /tmp/lb $c before
  run /tmp/la $c after
  run /tmp/la $c after
  run /tmp/lb $c before
done

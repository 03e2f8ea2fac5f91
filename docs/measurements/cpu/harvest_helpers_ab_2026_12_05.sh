#!/usr/bin/env bash
# The harvest's top-k rows shared over helper threads that block when idle (kernels/shares.py) against one
# thread (before = f251c72), with the greedy walk's trees shared the same way (after = d2206e0): profile-host --no-profile of goose-b8 (an 8-draft tree every step,
# allocator off) at 1 and 8 requests ABBA, 64 requests AB; SmolLM2-135M bf16, 128 tokens.
# Worktrees: git worktree add /tmp/hb f251c72; git worktree add /tmp/ha d2206e0.
# Output: docs/measurements/cpu/harvest_helpers_ab_2026_12_05.txt and harvest_helpers_{before,after}_2026_12_05.jsonl
set -u
out=/work/main/docs/measurements/cpu
run() {  # tree conc tag
  local tree=$1 c=$2 tag=$3
  local n=$(( c <= 1 ? 4 : c ))
  echo "== $(date -u +%H:%M:%S) $tag goose-b8 c=$c"
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method goose-b8 --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --json $out/harvest_helpers_${tag}_2026_12_05.jsonl 2>&1 | grep -E "tokens/s|ms/step wall|plugin's own|  (propose|walk|harvest|topk) ")
}
lscpu | grep -E 'Model name'
for c in 1 8; do
  run /tmp/hb $c before
  run /tmp/ha $c after
  run /tmp/ha $c after
  run /tmp/hb $c before
done
run /tmp/hb 64 before
run /tmp/ha 64 after

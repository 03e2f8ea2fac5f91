#!/usr/bin/env bash
# The CPU attention's plan in two compiled calls at 64 requests (after = 89ea794: a443943 plus the kernels' bounds checks
# and the early exit past PATHS_MAX_MEAN) against before = de58ef0, profile-host --no-profile of goose-b8 ABBA;
# SmolLM2-135M bf16, 128 tokens. Worktrees: /tmp/before (de58ef0), /tmp/after (89ea794).
# Output: plan_kernels_ab_2026_12_05b.txt and plan_kernels_{before,after}_2026_12_05b.jsonl.
set -u
out=/work/main/docs/measurements/cpu
run() {  # tree conc tag
  local tree=$1 c=$2 tag=$3
  echo "== $(date -u +%H:%M:%S) $tag goose-b8 c=$c"
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method goose-b8 --max-num-seqs $c --num-prompts $c --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --json $out/plan_kernels_${tag}_2026_12_05b.jsonl 2>&1 | grep -E "tokens/s|ms/step wall|plugin's own|  (propose|prepare|plan|walk|kv|harvest|topk) ")
}
lscpu | grep -E 'Model name'
(cd /tmp/after && git log --oneline | head -1)
run /tmp/before 64 before
run /tmp/after 64 after
run /tmp/after 64 after
run /tmp/before 64 before

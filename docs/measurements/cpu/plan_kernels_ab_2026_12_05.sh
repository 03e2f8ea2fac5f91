#!/usr/bin/env bash
# The CPU tree attention's plan in two compiled calls (after = a443943: main_rows, path_rounds with
# the slot maps; plans clocked once when built) against before = de58ef0, profile-host --no-profile
# of goose-b8 at 1 and 8 requests ABBA; SmolLM2-135M bf16, 128 tokens.
# Worktrees: /tmp/before (de58ef0), /tmp/after (a443943). Output: plan_kernels_ab_2026_12_05.txt and
# plan_kernels_{before,after}_2026_12_05.jsonl. Accounting: before, the "plan" phase also held every
# layer's lookup of the step's plan (~1-2 us a layer); after, only the first layer's build.
set -u
out=/work/main/docs/measurements/cpu
run() {  # tree conc tag
  local tree=$1 c=$2 tag=$3
  local n=$(( c <= 1 ? 4 : c ))
  echo "== $(date -u +%H:%M:%S) $tag goose-b8 c=$c"
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method goose-b8 --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --json $out/plan_kernels_${tag}_2026_12_05.jsonl 2>&1 | grep -E "tokens/s|ms/step wall|plugin's own|  (propose|prepare|plan|walk|harvest|topk) ")
}
lscpu | grep -E 'Model name'
(cd /tmp/after && git log --oneline | head -1)
for c in 1 8; do
  run /tmp/before $c before
  run /tmp/after $c after
  run /tmp/after $c after
  run /tmp/before $c before
done

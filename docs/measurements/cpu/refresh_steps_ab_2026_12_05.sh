#!/usr/bin/env bash
# GOOSE's refresh_steps (default 16: a row whose table entries its table wrote in the last 16 steps is not harvested)
# against before = 758160c (every row harvested), profile-host --no-profile of goose-b8, ABBA at 1, 8 and 64 requests,
# SmolLM2-135M bf16, 128 tokens; then one float32 run of each at 8 and 64 requests (float32: the outputs are the same
# tokens whatever the drafts, so model steps compare tau). Worktrees: /tmp/before (758160c), /tmp/after (7caa8e6).
# Output: refresh_steps_ab_2026_12_05.txt and refresh_steps_{before,after}_2026_12_05.jsonl. ~40 min.
set -u
out=/work/main/docs/measurements/cpu
run() {  # tree conc tag [dtype]
  local tree=$1 c=$2 tag=$3 dtype=${4:-bfloat16}
  local n=$(( c <= 1 ? 4 : c ))
  echo "== $(date -u +%H:%M:%S) $tag goose-b8 c=$c $dtype"
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method goose-b8 --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --dtype $dtype --json $out/refresh_steps_${tag}_2026_12_05.jsonl 2>&1 \
     | grep -E "tokens/s|ms/step wall|plugin's own|  (propose|prepare|plan|walk|kv|harvest|topk) ")
}
lscpu | grep -E 'Model name'
(cd /tmp/after && git log --oneline | head -1)
for c in 1 8 64; do
  run /tmp/before $c before
  run /tmp/after $c after
  run /tmp/after $c after
  run /tmp/before $c before
done
for c in 8 64; do
  run /tmp/before $c before float32
  run /tmp/after $c after float32
done

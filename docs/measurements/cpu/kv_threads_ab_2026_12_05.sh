#!/usr/bin/env bash
# The K/V slot moves on numba's OpenMP threads (kernels.kv.move_slots_threads: the layers cut into parts; after =
# 210f7e0, 2 threads on this 2-core machine) against before = 5337f0c (one thread), profile-host --no-profile of
# goose-b8, ABBA at 1, 8 and 64 requests, SmolLM2-135M bf16, 128 tokens; then one float32 run of each at 8 requests
# (the moves copy bits: the same model steps). Worktrees: /tmp/before (5337f0c), /tmp/after (210f7e0).
# Output: kv_threads_ab_2026_12_05.txt and kv_threads_{before,after}_2026_12_05.jsonl. ~35 min.
set -u
out=/work/main/docs/measurements/cpu
run() {  # tree conc tag [dtype]
  local tree=$1 c=$2 tag=$3 dtype=${4:-bfloat16}
  local n=$(( c <= 1 ? 4 : c ))
  echo "== $(date -u +%H:%M:%S) $tag goose-b8 c=$c $dtype"
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method goose-b8 --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --dtype $dtype --json $out/kv_threads_${tag}_2026_12_05.jsonl 2>&1 \
     | grep --line-buffered -E "tokens/s|ms/step wall|plugin's own|  (propose|prepare|plan|walk|kv|harvest|topk|stats) ")
}
lscpu | grep --line-buffered -E 'Model name'
(cd /tmp/after && git log --oneline | head -1)
for c in 1 8 64; do
  run /tmp/before $c before
  run /tmp/after $c after
  run /tmp/after $c after
  run /tmp/before $c before
done
run /tmp/before 8 before float32
run /tmp/after 8 after float32

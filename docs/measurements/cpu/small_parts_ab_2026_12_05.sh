#!/usr/bin/env bash
# Smaller parts for the threaded vocabulary passes (after = dea715e: top-k from 2 rows a part, argmax 8 rows, walk 4
# trees) against before = 210f7e0 (8 rows, 32 rows, 8 trees), profile-host --no-profile of goose-b8, ABBA at 1 and 8
# requests, SmolLM2-135M bf16, 128 tokens. Worktrees: /tmp/before (210f7e0), /tmp/after (dea715e).
# Output: small_parts_ab_2026_12_05.txt and small_parts_{before,after}_2026_12_05.jsonl. ~14 min.
set -u
out=/work/main/docs/measurements/cpu
run() {  # tree conc tag [dtype]
  local tree=$1 c=$2 tag=$3 dtype=${4:-bfloat16}
  local n=$(( c <= 1 ? 4 : c ))
  echo "== $(date -u +%H:%M:%S) $tag goose-b8 c=$c $dtype"
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method goose-b8 --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --dtype $dtype --json $out/small_parts_${tag}_2026_12_05.jsonl 2>&1 \
     | grep --line-buffered -E "tokens/s|ms/step wall|plugin's own|  (propose|prepare|plan|walk|kv|harvest|topk|stats) ")
}
lscpu | grep --line-buffered -E 'Model name'
(cd /tmp/after && git log --oneline | head -1)
for c in 1 8; do
  run /tmp/before $c before
  run /tmp/after $c after
  run /tmp/after $c after
  run /tmp/before $c before
done

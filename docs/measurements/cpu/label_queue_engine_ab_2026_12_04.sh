#!/usr/bin/env bash
# The label queue in the engine: profile-host --no-profile of goose-nogate (allocator on, gate off:
# trees every step, every offered tree labelled) at 8 and 64 requests, before = d7b1efe (/tmp/before,
# a DraftTree per waiting tree) against after (/tmp/v1 = a git worktree of 712f32f, engine/labels.py), ABBA; SmolLM2-135M bf16,
# 128 tokens. Output: docs/measurements/cpu/label_queue_engine_ab_2026_12_04.txt and .jsonl.
set -u
run() {  # tree conc tag
  local tree=$1 c=$2 tag=$3
  local n=$(( c <= 8 ? 16 : 64 ))
  echo "== $(date -u +%H:%M:%S) $tag goose-nogate c=$c"
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method goose-nogate --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --json /work/main/docs/measurements/cpu/label_queue_engine_${tag}_2026_12_04.jsonl 2>&1 | grep -v WARNING \
     | grep -E "tokens/s|ms/step wall|plugin's own|  (harvest|label|propose|states|reply)")
}
lscpu | grep -E 'Model name'
for c in 8 64; do
  run /tmp/before $c before
  run /tmp/v1 $c after
  run /tmp/v1 $c after
  run /tmp/before $c before
done

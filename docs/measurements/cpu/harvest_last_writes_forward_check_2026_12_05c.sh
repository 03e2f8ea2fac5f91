#!/usr/bin/env bash
# Third check of the forward at 8 requests (goose-b8, profile-host --no-profile): before = /tmp/lb (a08f20e), after = /tmp/lc
# (acd64d1), and /tmp/ld = acd64d1 with every row of a learning tree kept (last_writes' answer overwritten in learn_batch:
# the top-k of every row, as before, through the new code path). Order: D B A D B A.
# Output: harvest_last_writes_forward_check_2026_12_05c.txt
set -u
run() {  # tree tag
  echo "== $(date -u +%H:%M:%S) $2"
  (cd $1 && PYTHONPATH=$1 VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method goose-b8 --max-num-seqs 8 --num-prompts 8 --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     2>&1 | grep -E "tokens/s|ms/step wall|plugin's own|  topk ")
}
lscpu | grep -E 'Model name'
for t in d b a d b a; do
  case $t in a) run /tmp/lc after;; b) run /tmp/lb before;; d) run /tmp/ld all-rows;; esac
done

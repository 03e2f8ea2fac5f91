#!/usr/bin/env bash
# Is the "after" worktree's slower forward at 8 requests in harvest_last_writes_ab_2026_12_05 the change or the machine?
# Same profile-host runs (goose-b8, c = 8) in the order after, before, before', after, before', before, where before'
# (/tmp/lb2) is a second worktree of the before commit a08f20e (an A/A pair). Output: ..._forward_check_2026_12_05.txt
set -u
run() {  # tree tag
  echo "== $(date -u +%H:%M:%S) $2"
  (cd $1 && PYTHONPATH=$1 VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method goose-b8 --max-num-seqs 8 --num-prompts 8 --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     2>&1 | grep -E "tokens/s|ms/step wall|plugin's own|  topk ")
}
lscpu | grep -E 'Model name'
run /tmp/la after; run /tmp/lb before; run /tmp/lb2 before2; run /tmp/la after; run /tmp/lb2 before2; run /tmp/lb before

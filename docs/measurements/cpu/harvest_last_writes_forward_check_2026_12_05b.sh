#!/usr/bin/env bash
# Second check of the forward at 8 requests (goose-b8, profile-host --no-profile): before = /tmp/lb (a08f20e), after = /tmp/lc
# (acd64d1), alternating B A B A A B A B. Output: harvest_last_writes_forward_check_2026_12_05b.txt
set -u
run() {  # tree tag
  echo "== $(date -u +%H:%M:%S) $2"
  (cd $1 && PYTHONPATH=$1 VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method goose-b8 --max-num-seqs 8 --num-prompts 8 --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     2>&1 | grep -E "tokens/s|ms/step wall|plugin's own|  topk ")
}
lscpu | grep -E 'Model name'
for t in b a b a a b a b; do
  if [ $t = a ]; then run /tmp/lc after; else run /tmp/lb before; fi
done

#!/usr/bin/env bash
# A chain step's request without a draft as a plain row (523e6da) against the tree before it (0a6c017): profile-host
# --no-profile, SmolLM2-135M bf16, 128 tokens, humaneval,gsm8k,mtbench; goose-auto (the default) before / after,
# interleaved, at 1 request (twice), 8 and 64; plain at each concurrency once.
# Records: docs/measurements/cpu/chain_alone_ab_{before,after,plain}_2026_12_07.jsonl
#   git worktree add /tmp/wt46 0a6c017 && git worktree add /tmp/wtA 523e6da && bash docs/measurements/cpu/chain_alone_ab_2026_12_07.sh
set -u
out=/work/main/docs/measurements/cpu/chain_alone_ab
run() {  # tree label method conc
  local tree=$1 label=$2 m=$3 c=$4
  local n=$(( c <= 1 ? 4 : (c <= 8 ? 8 : c) ))
  echo "== $(date -u +%H:%M:%S) $label $m c=$c"
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method $m --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --json ${out}_${label}_2026_12_07.jsonl 2>&1 | grep -v WARNING | grep -E "tokens/s|ms/step" | head -3)
}
lscpu | grep -E 'Model name'
for c in 1 8 64; do
  run /tmp/wt46 before goose-auto $c
  run /tmp/wtA after goose-auto $c
  run /tmp/wtA plain plain $c
  if [ $c = 1 ]; then run /tmp/wtA after goose-auto 1; run /tmp/wt46 before goose-auto 1; fi
done
echo "== $(date -u +%H:%M:%S) done"

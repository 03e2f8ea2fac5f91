#!/bin/bash
# The acceptance model's refit compiled (kernels.fit.newton_platt) against the numpy refit, in the
# engine: profile-host by arm and the refits' times per call, goose-auto at 8 requests (16 prompts
# of mbpp + math500, 128 tokens, bf16), ABAB. BEFORE / AFTER: git worktrees of the two commits with
# the repository's .venv linked (before = f318b62, after = the commit that compiles the refit).
set -e
PROBE=$(cd "$(dirname "$0")" && pwd)/refit_times_probe_2026_12_06.py
BEFORE=${BEFORE:-/tmp/ab_before}; AFTER=${AFTER:-/tmp/ab_after}; OUT=${OUT:-/tmp/refit_ab}
mkdir -p "$OUT"
for rep in 1 2; do
  for side in before after; do
    tree=$BEFORE; [ $side = after ] && tree=$AFTER
    echo "== $(date -u +%H:%M:%S) $side rep $rep"
    (cd "$tree" && PYTHONPATH="$tree" VLLM_LOGGING_LEVEL=WARNING .venv/bin/python \
      "$PROBE" profile-host --method goose-auto \
      --max-num-seqs 8 --num-prompts 8 --dataset mbpp,math500 --max-tokens 128 --no-profile \
      --json "$OUT/$side.jsonl") 2>&1 | grep -v "WARNING\|INFO\|^\[\|Loading\|FutureWarning\|hasattr\|wrapper = \|^$"
  done
done

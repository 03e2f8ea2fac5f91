#!/bin/bash
# A/B of the plugin's host work at one request: /tmp/A (git worktree of 64da7c7, before) and /tmp/B (cc4ab49:
# the cut at one request in one compiled call) alternated, three rounds; ~12 min on a 2-core EPYC.
# SEQS / PROMPTS / TAG override the batch (refit_normal_ab_c8_2026_12_06.sh: 8 / 8 / c8).
# Summary: .venv/bin/python docs/measurements/cpu/ab_summary_2026_12_06.py /tmp/ab_c1_A.jsonl /tmp/ab_c1_B.jsonl
SEQS=${SEQS:-1}; PROMPTS=${PROMPTS:-4}; TAG=${TAG:-c1}
for round in 1 2 3; do
  for side in A B; do
    cd /tmp/$side
    echo "== $(date -u +%H:%M:%S) round $round side $side $(git log --oneline -1 | cut -c1-7)"
    PYTHONPATH=/tmp/$side VLLM_LOGGING_LEVEL=WARNING .venv/bin/vllm-anisotropic profile-host --method goose-auto --max-num-seqs $SEQS \
      --num-prompts $PROMPTS --dataset mbpp,math500 --max-tokens 128 --no-profile --json /tmp/ab_${TAG}_$side.jsonl 2>&1 \
      | grep -v "WARNING\|INFO\|^\[\|Loading\|FutureWarning\|hasattr\|wrapper = \|^$\|Triton"
  done
done

#!/bin/bash
# A/B of the plugin's host work at eight requests: /tmp/A (git worktree of a8ca539, before) and /tmp/B (64ef4f3:
# the cost model's refit on its normal equations, compiled) alternated, three rounds; ~12 min on a 2-core EPYC.
# Summary: .venv/bin/python docs/measurements/cpu/ab_summary_2026_12_06.py /tmp/ab_c8_A.jsonl /tmp/ab_c8_B.jsonl
for round in 1 2 3; do
  for side in A B; do
    cd /tmp/$side
    echo "== $(date -u +%H:%M:%S) round $round side $side $(git log --oneline -1 | cut -c1-7)"
    PYTHONPATH=/tmp/$side VLLM_LOGGING_LEVEL=WARNING .venv/bin/vllm-anisotropic profile-host --method goose-auto --max-num-seqs 8 \
      --num-prompts 8 --dataset mbpp,math500 --max-tokens 128 --no-profile --json /tmp/ab_c8_$side.jsonl 2>&1 \
      | grep -v "WARNING\|INFO\|^\[\|Loading\|FutureWarning\|hasattr\|wrapper = \|^$\|Triton"
  done
done

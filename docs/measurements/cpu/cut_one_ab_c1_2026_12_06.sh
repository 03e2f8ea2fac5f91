#!/bin/bash
# A/B of the plugin's host work at one request: /tmp/A (git worktree of 64da7c7, before) and /tmp/B (cc4ab49:
# the cut at one request in one compiled call) alternated, three rounds; ~14 min on a 2-core EPYC.
# Summary: .venv/bin/python docs/measurements/cpu/ab_summary_2026_12_06.py /tmp/ab_c1_A.jsonl /tmp/ab_c1_B.jsonl
for round in 1 2 3; do
  for side in A B; do
    cd /tmp/$side
    echo "== $(date -u +%H:%M:%S) round $round side $side $(git log --oneline -1 | cut -c1-7)"
    PYTHONPATH=/tmp/$side VLLM_LOGGING_LEVEL=WARNING .venv/bin/vllm-anisotropic profile-host --method goose-auto --max-num-seqs 1 \
      --num-prompts 4 --dataset mbpp,math500 --max-tokens 128 --no-profile --json /tmp/ab_c1_$side.jsonl 2>&1 \
      | grep -v "WARNING\|INFO\|^\[\|Loading\|FutureWarning\|hasattr\|wrapper = \|^$\|Triton"
  done
done

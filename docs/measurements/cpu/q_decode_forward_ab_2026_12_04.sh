#!/usr/bin/env bash
# q's decode forward before (e6b1ea4: SDPA) / after (938cbc1: short_rows_attention) on one machine, ABBA,
# Qwen2.5-Coder-0.5B bf16, R rows x 1 token after ctx tokens. Trees: git worktree add /tmp/qb e6b1ea4;
# git worktree add /tmp/qa 938cbc1. Output: docs/measurements/cpu/q_decode_forward_ab_2026_12_04.txt
set -u
S=/work/main/docs/measurements/cpu/q_decode_forward_2026_12_03.py
lscpu | grep 'Model name'
for shape in "1 300" "4 300" "8 600"; do
  for tree in qb qa qa qb; do
    echo -n "$tree ($([ $tree = qb ] && echo before || echo after)): "
    PYTHONPATH=/tmp/$tree /work/main/.venv/bin/python $S time $shape 2>&1 | grep "q decode forward"
  done
done

#!/usr/bin/env bash
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py 2026_12_02d
# host_ab_2026_11_29.sh with before = ba4dd08 (/tmp/before) and after = c54a811 (/tmp/after3): the final code
# of 2026-12-02 (22908ac's, and StepTrees.void None when no tree is void, so the sampler's all-greedy CPU
# fast path runs in the engine: in 22908ac it never did).
# Records: docs/measurements/cpu/host_ab_{before,after}_2026_12_02d.jsonl.
#   git worktree add /tmp/before ba4dd08 && git worktree add /tmp/after3 c54a811
#   bash docs/measurements/cpu/host_ab_2026_12_02d.sh
AFTER=/tmp/after3 exec bash "$(dirname "$0")/host_ab_2026_11_29.sh" 2026_12_02d

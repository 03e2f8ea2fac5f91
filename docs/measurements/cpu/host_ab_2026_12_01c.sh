#!/usr/bin/env bash
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py 2026_12_01c
# host_ab_2026_11_29.sh with before = b62e657 (/tmp/before) and after = 63322d2 (/tmp/after): the
# sampler's bookkeeping after the walk (emitted rows, path nodes, K/V moves) and the metrics'
# counts each in one compiled call (kernels/emit.py).
# Records: docs/measurements/cpu/host_ab_{before,after}_2026_12_01c.jsonl.
#   git worktree add /tmp/before b62e657 && git worktree add /tmp/after 63322d2
#   bash docs/measurements/cpu/host_ab_2026_12_01c.sh
AFTER=/tmp/after exec bash "$(dirname "$0")/host_ab_2026_11_29.sh" 2026_12_01c

#!/usr/bin/env bash
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py 2026_12_01b
# host_ab_2026_12_01.sh again with after = a254e9f (a git worktree at /tmp/after): the K/V moves, the
# proposals and the greedy walk each in one compiled call. Before = 095c76f (/tmp/before).
# Records: docs/measurements/cpu/host_ab_{before,after}_2026_12_01b.jsonl.
#   git worktree add /tmp/before 095c76f && git worktree add /tmp/after a254e9f
#   bash docs/measurements/cpu/host_ab_2026_12_01b.sh
AFTER=/tmp/after exec bash "$(dirname "$0")/host_ab_2026_11_29.sh" 2026_12_01b

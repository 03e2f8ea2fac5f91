#!/usr/bin/env bash
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py 2026_11_29b
# The runs of host_ab_2026_11_29.sh (profile-host --no-profile, goose-b8 at 1 and 8 requests,
# before and after interleaved, 2 repeats) with before = 12b0746 (a git worktree at /tmp/before)
# and after = the path-rounds kernel, the K/V moves' element indices once per layout, TreePlan on
# FlatTrees (7b6eb08). Records: docs/measurements/cpu/host_ab_{before,after}_2026_11_29b.jsonl;
# fixed inputs: plan_moves_ab_2026_11_29{,b}.txt.
#   git worktree add /tmp/before 12b0746 && bash docs/measurements/cpu/host_ab_2026_11_29b.sh
exec bash "$(dirname "$0")/host_ab_2026_11_29.sh" 2026_11_29b

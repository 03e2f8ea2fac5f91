#!/usr/bin/env bash
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py 2026_11_29c
# The runs of host_ab_2026_11_29.sh (profile-host --no-profile, goose-b8 at 1 and 8 requests,
# before and after interleaved, 2 repeats) with before = f66bd56 (a git worktree at /tmp/before)
# and after = the harvest's top-k reading CPU logits in place (no gathered copy) and the stats
# files in a phase of their own ("stats", after the reply). Records:
# docs/measurements/cpu/host_ab_{before,after}_2026_11_29c.jsonl.
#   git worktree add /tmp/before f66bd56 && bash docs/measurements/cpu/host_ab_2026_11_29c.sh
exec bash "$(dirname "$0")/host_ab_2026_11_29.sh" 2026_11_29c

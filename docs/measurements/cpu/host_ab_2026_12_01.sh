#!/usr/bin/env bash
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py 2026_12_01
# The runs of host_ab_2026_11_29.sh (profile-host --no-profile, goose-b8 at 1 and 8 requests,
# before and after interleaved, 2 repeats, bf16: native on the AVX512-BF16 EPYC this ran on) with
# before = 095c76f (a git worktree at /tmp/before) and after = e7351d2 (a worktree at /tmp/after; host_ab_2026_12_01b.sh: a254e9f, the walk too):
# the K/V slot moves in one compiled call, GOOSE's proposals in one compiled call per table.
# Records: docs/measurements/cpu/host_ab_{before,after}_2026_12_01.jsonl.
#   git worktree add /tmp/before 095c76f && git worktree add /tmp/after e7351d2
#   bash docs/measurements/cpu/host_ab_2026_12_01.sh
AFTER=/tmp/after exec bash "$(dirname "$0")/host_ab_2026_11_29.sh" 2026_12_01

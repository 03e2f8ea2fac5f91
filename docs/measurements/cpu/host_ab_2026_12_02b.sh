#!/usr/bin/env bash
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py 2026_12_02b
# host_ab_2026_11_29.sh with before = ba4dd08 (/tmp/before) and after = 22908ac (/tmp/after2): everything of
# 2026-12-02 (host_ab_2026_12_02.sh's changes, and take_step's cut in one compiled pass, the CPU
# positions scattered through numpy, the all-greedy walk over every tree).
# Records: docs/measurements/cpu/host_ab_{before,after}_2026_12_02b.jsonl.
#   git worktree add /tmp/before ba4dd08 && git worktree add /tmp/after2 22908ac
#   bash docs/measurements/cpu/host_ab_2026_12_02b.sh
AFTER=/tmp/after2 exec bash "$(dirname "$0")/host_ab_2026_11_29.sh" 2026_12_02b

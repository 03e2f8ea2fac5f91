#!/usr/bin/env bash
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py 2026_12_01d
# host_ab_2026_11_29.sh with before = b62e657 (/tmp/before) and after = a6294c6 (/tmp/after2;
# its package code is 993469c's): the sampler's bookkeeping after
# the walk and the metrics' counts compiled (kernels/emit.py), the scheduled prefix cut once in
# take_step, the step's node rows / positions / chains compiled (kernels.plan.step_rows).
# Records: docs/measurements/cpu/host_ab_{before,after}_2026_12_01d.jsonl.
#   git worktree add /tmp/before b62e657 && git worktree add /tmp/after2 a6294c6
#   bash docs/measurements/cpu/host_ab_2026_12_01d.sh
AFTER=/tmp/after2 exec bash "$(dirname "$0")/host_ab_2026_11_29.sh" 2026_12_01d

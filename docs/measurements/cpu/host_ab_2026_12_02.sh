#!/usr/bin/env bash
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py 2026_12_02
# host_ab_2026_11_29.sh with before = ba4dd08 (/tmp/before) and after = 968ed1a (/tmp/after): the
# sampler's logits starts / walked trees / draft check in one call and the all-greedy CPU step
# verified by the walk alone (a6b6bb3), the harvest's rows in one call, GOOSE's learning keys in
# one call, the proposal's cut only near max_model_len, take_step's whole-proposal path (968ed1a).
# Records: docs/measurements/cpu/host_ab_{before,after}_2026_12_02.jsonl.
#   git worktree add /tmp/before ba4dd08 && git worktree add /tmp/after 968ed1a
#   bash docs/measurements/cpu/host_ab_2026_12_02.sh
AFTER=/tmp/after exec bash "$(dirname "$0")/host_ab_2026_11_29.sh" 2026_12_02

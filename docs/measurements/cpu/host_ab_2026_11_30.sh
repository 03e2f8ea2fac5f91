#!/usr/bin/env bash
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py 2026_11_30
# The runs of host_ab_2026_11_29.sh (profile-host --no-profile, goose-b8 at 1 and 8 requests,
# before and after interleaved, 2 repeats) in float32 (bf16 is emulated on the AVX2-only EPYC
# this ran on), with before = cf9cbfa (a git worktree at /tmp/before) and after = vLLM's first
# attention call without the tree rows off the leading chain.
# Records: docs/measurements/cpu/host_ab_{before,after}_2026_11_30.jsonl.
#   git worktree add /tmp/before cf9cbfa && bash docs/measurements/cpu/host_ab_2026_11_30.sh
PH_EXTRA="--dtype float32" exec bash "$(dirname "$0")/host_ab_2026_11_29.sh" 2026_11_30

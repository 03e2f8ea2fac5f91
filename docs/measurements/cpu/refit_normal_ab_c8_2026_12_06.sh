#!/bin/bash
# A/B of the plugin's host work at eight requests: /tmp/A (git worktree of a8ca539, before) and /tmp/B (64ef4f3:
# the cost model's refit on its normal equations, compiled) alternated, three rounds; ~12 min on a 2-core EPYC.
# Summary: .venv/bin/python docs/measurements/cpu/ab_summary_2026_12_06.py /tmp/ab_c8_A.jsonl /tmp/ab_c8_B.jsonl
SEQS=8 PROMPTS=8 TAG=c8 exec bash "$(dirname "$0")/cut_one_ab_c1_2026_12_06.sh"

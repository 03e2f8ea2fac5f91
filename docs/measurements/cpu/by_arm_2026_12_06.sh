#!/bin/bash
# profile-host by arm (f318b62's split, the LM head timed apart): goose-auto and plain at 1, 8 and
# 64 requests, one run each, in that order (mbpp + math500, 128 tokens, bf16; 4 / 8 / 64 prompts
# of each dataset). ~12 min on a 2-core EPYC. METHODS / SPECS override the lists (the tokens run:
# METHODS=goose-auto SPECS="8:8 64:64").
set -e
OUT=${OUT:-/tmp/by_arm}; mkdir -p "$OUT"
for spec in ${SPECS:-1:4 8:8 64:64}; do
  set -- ${spec/:/ }
  for m in ${METHODS:-goose-auto plain}; do
    echo "== $(date -u +%H:%M:%S) $m max_num_seqs $1"
    VLLM_LOGGING_LEVEL=WARNING .venv/bin/vllm-anisotropic profile-host --method $m --max-num-seqs $1 \
      --num-prompts $2 --dataset mbpp,math500 --max-tokens 128 --no-profile --json "$OUT/by_arm.jsonl" 2>&1 \
      | grep -v "WARNING\|INFO\|^\[\|Loading\|FutureWarning\|hasattr\|wrapper = \|^$"
  done
done

#!/usr/bin/env bash
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py 2026_11_30b
# host_ab_2026_11_30.sh again at one request only, after the first attention call reads the
# leading rows in place (views, no row copies) when the one tree request is the batch's last:
# before (cf9cbfa, /tmp/before) and after, interleaved after, before, before, after.
# Records: docs/measurements/cpu/host_ab_{before,after}_2026_11_30b.jsonl.
set -u
suffix=2026_11_30b
run() {  # tree tag
  echo "== $2 goose-b8 c=1" >&2
  (cd $1 && PYTHONPATH=$1 VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method goose-b8 --max-num-seqs 1 --num-prompts 4 --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --dtype float32 --json /work/main/docs/measurements/cpu/host_ab_$2_${suffix}.jsonl 2>&1 | grep -v WARNING \
     | grep -E "tokens/s|ms/step" | head -3)
}
run /work/main after
run /tmp/before before
run /tmp/before before
run /work/main after

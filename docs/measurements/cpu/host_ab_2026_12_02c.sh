#!/usr/bin/env bash
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py 2026_12_02c
# host_ab_2026_12_02b.sh's trees (before = ba4dd08 at /tmp/before, after = 22908ac at /tmp/after2) at one
# request only, 3 pairs interleaved (before, after, after, before, before, after): in the b runs both
# "before" runs at one request met the machine's slow mode (forward 19-20 ms against 13-14).
# Records: docs/measurements/cpu/host_ab_{before,after}_2026_12_02c.jsonl.
set -u
run() {  # tree tag
  echo "== $2 goose-b8 c=1" >&2
  (cd $1 && PYTHONPATH=$1 VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method goose-b8 --max-num-seqs 1 --num-prompts 4 --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --json /work/main/docs/measurements/cpu/host_ab_$2_2026_12_02c.jsonl 2>&1 | grep -v WARNING | grep -E "tokens/s|ms/step" | head -3)
}
run /tmp/before before; run /tmp/after2 after; run /tmp/after2 after; run /tmp/before before; run /tmp/before before; run /tmp/after2 after

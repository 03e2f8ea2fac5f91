#!/usr/bin/env bash
# Tree rows by path rounds without the four K/V gathers a layer (slot mappings over all rows):
# profile-host --no-profile of goose-b8 (a fixed 8-draft tree every step, allocator off) at 1 and 8
# requests, before = c2eda00 (/tmp/before) against after (/work/main, uncommitted), ABBA; bf16, 128 tokens.
set -u
suffix=$1
run() {  # tree conc tag
  local tree=$1 c=$2 tag=$3
  local n=$(( c <= 1 ? 4 : 8 ))
  echo "== $(date -u +%H:%M:%S) $tag goose-b8 c=$c"
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method goose-b8 --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --json /work/main/docs/measurements/cpu/host_paths_inplace_${tag}_2026_12_03.jsonl 2>&1 | grep -v WARNING | grep -E "tokens/s|ms/step wall|plugin's own|  plan")
}
lscpu | grep -E 'Model name'
for c in 1 8; do
  run /tmp/before $c before
  run /work/main $c after
  run /work/main $c after
  run /tmp/before $c before
done

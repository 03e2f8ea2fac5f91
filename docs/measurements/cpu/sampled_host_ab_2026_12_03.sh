#!/usr/bin/env bash
# Sampled trees' host work, before / after 0b37bac + 6006949 (the bonus sampler call without a top-p
# only walked rows use; the NSS walk reading the rows it visits in place; its draws sorting a row only
# where the top-p might move the draw, cpu_draw.py): profile-host --no-profile at T = 0.7, top-p 0.95,
# every request seeded (seed 1234), bf16, 128 tokens, SmolLM2-135M, tune-split prompts.
# before = 60ad781 (/tmp/before), after = 6006949 (/tmp/after), git worktrees.
# goose-b8 (an 8-draft tree every step, allocator off) ABBA at 1 / 8 / 64 requests, goose-auto (the
# default) ABBA at 1 and 8, plain once at 1 and 8 (after's tree; plain has no trees).
# 64 requests: unseeded (second phase, "$1" = c64). vLLM 0.32's CPU runner crashes on seeded requests
# whose chunked-prefill sample is discarded (gpu_model_runner._bookkeeping_sync: "CPU Generator does
# not use offset"), plain decoding too, so the seeded 64-request runs of the first phase died at start.
set -u
seed_args="--seed 1234"
declare -A seen
out=/work/main/docs/measurements/cpu/sampled_host_2026_12_03.jsonl
run() {  # tree method conc tag
  local tree=$1 m=$2 c=$3 tag=$4
  local n=$(( c <= 1 ? 4 : (c <= 8 ? 8 : 64) ))
  echo "== $(date -u +%H:%M:%S) $tag $m c=$c"
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method $m --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --temperature 0.7 --top-p 0.95 $seed_args --json /tmp/sampled_${tag}.jsonl 2>&1 | grep -v WARNING \
     | grep -E "tokens/s|ms/step wall|plugin's own|  walk|decode steps")
  local lines=$(cat /tmp/sampled_${tag}.jsonl 2>/dev/null | wc -l)
  [ "$lines" -gt "${seen[$tag]:-0}" ] || { echo "   (no record: the run failed)"; return; }
  seen[$tag]=$lines
  tail -1 /tmp/sampled_${tag}.jsonl | python3 -c "import json,sys; d=json.load(sys.stdin); d['tag']='$tag'; print(json.dumps(d))" >> $out
}
lscpu | grep -E 'Model name'
if [ "${1:-}" = c64 ]; then
  seed_args=""
  for tag in before after after before; do run /tmp/$tag goose-b8 64 $tag; done
  exit 0
fi
run /tmp/after plain 1 plain
run /tmp/after plain 8 plain
for c in 1 8 64; do  # 64: died at start, seeded (above)
  run /tmp/before goose-b8 $c before
  run /tmp/after goose-b8 $c after
  run /tmp/after goose-b8 $c after
  run /tmp/before goose-b8 $c before
done
for c in 1 8; do
  run /tmp/before goose-auto $c before
  run /tmp/after goose-auto $c after
  run /tmp/after goose-auto $c after
  run /tmp/before goose-auto $c before
done

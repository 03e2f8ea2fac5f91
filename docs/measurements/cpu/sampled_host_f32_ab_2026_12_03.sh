#!/usr/bin/env bash
# cpu_draw's nucleus test in float64 (6006949, /tmp/after) against float32 (817aa60, /tmp/suite),
# git worktrees: profile-host --no-profile, goose-b8, T = 0.7, top-p 0.95, bf16, 128 tokens,
# SmolLM2-135M, tune split; 8 requests seeded (1234) ABBA, 64 unseeded AB (vLLM 0.32's CPU seeded
# chunked-prefill crash: sampled_host_ab_2026_12_03.sh).
set -u
declare -A seen
out=/work/main/docs/measurements/cpu/sampled_host_f32_2026_12_03.jsonl
run() {  # tree conc tag seed_args
  local tree=$1 c=$2 tag=$3 seed_args=$4
  local n=$(( c <= 8 ? 8 : 64 ))
  echo "== $(date -u +%H:%M:%S) $tag goose-b8 c=$c"
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method goose-b8 --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --temperature 0.7 --top-p 0.95 $seed_args --json /tmp/f32_${tag}.jsonl 2>&1 | grep -v WARNING \
     | grep -E "tokens/s|ms/step wall|plugin's own|  walk")
  local lines=$(cat /tmp/f32_${tag}.jsonl 2>/dev/null | wc -l)
  [ "$lines" -gt "${seen[$tag]:-0}" ] || { echo "   (no record: the run failed)"; return; }
  seen[$tag]=$lines
  tail -1 /tmp/f32_${tag}.jsonl | python3 -c "import json,sys; d=json.load(sys.stdin); d['tag']='$tag'; print(json.dumps(d))" >> $out
}
lscpu | grep -E 'Model name'
run /tmp/after 8 f64 "--seed 1234"
run /tmp/suite 8 f32 "--seed 1234"
run /tmp/suite 8 f32 "--seed 1234"
run /tmp/after 8 f64 "--seed 1234"
run /tmp/after 64 f64 ""
run /tmp/suite 64 f32 ""

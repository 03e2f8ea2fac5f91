#!/usr/bin/env bash
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py 2026_11_30
# profile-host --no-profile, before (cf9cbfa, a git worktree at /tmp/before) and after (this
# tree: vLLM's first attention call without the tree rows off the leading chain), interleaved,
# goose-b8 (allocator off: an 8-draft tree verified every step, the same trees before and after),
# float32 (bf16 is emulated on the AVX2-only EPYC this ran on), 1 and 8 requests, 2 repeats.
# Records: docs/measurements/cpu/host_ab_{before,after}_2026_11_30.jsonl.
#   git worktree add /tmp/before cf9cbfa && bash docs/measurements/cpu/host_ab_2026_11_30.sh
set -u
suffix=2026_11_30
run() {  # tree method conc prompts tag
  local tree=$1 m=$2 c=$3 n=$4 tag=$5
  echo "== $tag $m c=$c" >&2
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method $m --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --dtype float32 --json /work/main/docs/measurements/cpu/host_ab_${tag}_${suffix}.jsonl 2>&1 | grep -v WARNING \
     | grep -E "tokens/s|ms/step" | head -3)
}
for c in 1 8; do
  n=$(( c <= 1 ? 4 : 8 ))
  run /tmp/before goose-b8 $c $n before
  run /work/main goose-b8 $c $n after
done
for c in 1 8; do
  n=$(( c <= 1 ? 4 : 8 ))
  run /work/main goose-b8 $c $n after
  run /tmp/before goose-b8 $c $n before
done

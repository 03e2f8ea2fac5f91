#!/usr/bin/env bash
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py 2026_11_29
# profile-host --no-profile, before (45c1457, a git worktree at /tmp/before) and after (this
# tree), interleaved, goose-b8 (allocator off: an 8-draft tree verified every step, the same work
# before and after; goose-nogate's trees depend on each engine's start-up cost fit, and on this
# AVX2-only EPYC it kept 1,127 of 1,129 steps plain at one request) at 1 and 8 requests,
# 2 repeats. Records: docs/measurements/cpu/host_ab_{before,after}_2026_11_29.jsonl.
#   git worktree add /tmp/before 45c1457 && bash docs/measurements/cpu/host_ab_2026_11_29.sh
# The records' suffix is the first argument (default 2026_11_29; host_ab_2026_11_29b.sh passes its own);
# PH_EXTRA: more profile-host options (host_ab_2026_11_30.sh: --dtype float32); AFTER: the
# "after" tree (default /work/main; host_ab_2026_12_01.sh: a worktree of the commit measured).
set -u
suffix=${1:-2026_11_29}
after=${AFTER:-/work/main}
run() {  # tree method conc prompts tag
  local tree=$1 m=$2 c=$3 n=$4 tag=$5
  echo "== $tag $m c=$c" >&2
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method $m --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     ${PH_EXTRA:-} --json /work/main/docs/measurements/cpu/host_ab_${tag}_${suffix}.jsonl 2>&1 | grep -v WARNING | grep -E "tokens/s|ms/step" | head -3)
}
# 64 requests left out: on this machine (bf16 emulated) a 64-request goose-b8 run takes ~10 min
# (an 8-request step took 0.8 s); the fixed-input stages (host_stages_ab_2026_11_29.txt) cover 64.
# The second repeat runs after first, against drift of the machine's speed over the run.
for c in 1 8; do
  n=$(( c <= 1 ? 4 : 8 ))
  run /tmp/before goose-b8 $c $n before
  run $after goose-b8 $c $n after
done
for c in 1 8; do
  n=$(( c <= 1 ? 4 : 8 ))
  run $after goose-b8 $c $n after
  run /tmp/before goose-b8 $c $n before
done

#!/usr/bin/env bash
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py 2026_11_28b
# profile-host --no-profile, before (e651375, a git worktree at /tmp/before) and after (this
# tree), interleaved, goose-nogate (trees offered every step) at 1 / 8 / 64 requests, 2 repeats
# at 1 and 8; plain once per concurrency for scale. Records: docs/measurements/cpu/host_ab_{before,after}_2026_11_28b.jsonl.
#   git worktree add /tmp/before e651375 && bash docs/measurements/cpu/host_ab_2026_11_28b.sh
set -u
run() {  # tree method conc prompts tag
  local tree=$1 m=$2 c=$3 n=$4 tag=$5
  echo "== $tag $m c=$c" >&2
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method $m --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --json /work/main/docs/measurements/cpu/host_ab_${tag}_2026_11_28b.jsonl 2>&1 | grep -v WARNING | grep -E "tokens/s|ms/step" | head -3)
}
for rep in 0 1; do
  for c in 1 8 64; do
    [ $rep = 1 ] && [ $c -gt 8 ] && continue
    n=$(( c <= 1 ? 4 : (c <= 8 ? 8 : 22) ))
    [ $rep = 0 ] && run /work/main plain $c $n after
    run /tmp/before goose-nogate $c $n before
    run /work/main goose-nogate $c $n after
  done
done

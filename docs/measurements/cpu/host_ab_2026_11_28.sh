#!/usr/bin/env bash
# (records copied afterwards from /tmp/host_{before,after}.jsonl to docs/measurements/cpu/host_ab_{before,after}_2026_11_28.jsonl)
# profile-host, before (be347a8 + HEAD's profile_host.py) and after (HEAD), interleaved, 2 repeats
set -u
OUT=/work/main/results/host_ab_2026_11_28.jsonl
run() {  # tree method conc prompts_per_ds
  local tree=$1 m=$2 c=$3 n=$4 tag=$5
  echo "== $tag $m c=$c" >&2
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method $m --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --json /tmp/host_$tag.jsonl 2>&1 | grep -v WARNING | tail -25)
}
for rep in 0 1; do
  for c in 1 8 16 64; do
    [ $rep = 1 ] && [ $c -gt 8 ] && continue
    n=$(( c <= 1 ? 4 : (c <= 8 ? 8 : (c <= 16 ? 16 : 22)) ))
    for m in plain ngram5; do [ $rep = 0 ] && run /work/main $m $c $n after; done
    run /work/main goose-nogate $c $n after
    run /tmp/before goose-nogate $c $n before
    run /tmp/before goose-auto $c $n before
    run /work/main goose-auto $c $n after
  done
done
run /work/main goose-nogate 32 32 after
run /tmp/before goose-nogate 32 32 before

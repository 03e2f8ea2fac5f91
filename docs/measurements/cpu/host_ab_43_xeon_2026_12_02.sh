#!/usr/bin/env bash
# Issue 43's host work per step, before against after, on one machine in one run:
# profile-host --no-profile, before = be347a8 (the host clocks alone, before issue 43's host work;
# /tmp/b43 with two shim modules at the later module paths the installed entry points name:
# integration/vllm/frontdoor/plugin.py re-exports `register`, platform_fixes/dist_alias.py
# re-exports `install`) and after = fdbe257 (/tmp/a43). goose-b8 (allocator off: an 8-draft tree
# verified every step, the same work before and after) at 1 / 8 / 64 requests, ABBA; plain and
# vLLM ngram (k = 5) once each for scale (after tree). bf16, 128 tokens.
# Records: docs/measurements/cpu/host_ab_{before,after}_43_xeon_2026_12_02.jsonl
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py 43_xeon_2026_12_02
#   git worktree add /tmp/b43 be347a8 (+ the shims) && git worktree add /tmp/a43 fdbe257
#   bash docs/measurements/cpu/host_ab_43_xeon_2026_12_02.sh
set -u
suffix=43_xeon_2026_12_02
run() {  # tree method conc tag
  local tree=$1 m=$2 c=$3 tag=$4
  local n=$(( c <= 1 ? 4 : (c <= 8 ? 8 : 64) ))
  echo "== $(date -u +%H:%M:%S) $tag $m c=$c" >&2
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method $m --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --json /work/main/docs/measurements/cpu/host_ab_${tag}_${suffix}.jsonl 2>&1 | grep -v WARNING | grep -E "tokens/s|ms/step" | head -3)
}
lscpu | grep -E 'Model name' >&2
for c in 1 8 64; do
  run /tmp/b43 goose-b8 $c before
  run /tmp/a43 goose-b8 $c after
  run /tmp/a43 goose-b8 $c after
  run /tmp/b43 goose-b8 $c before
  run /tmp/a43 plain $c after
  run /tmp/a43 ngram5 $c after
done

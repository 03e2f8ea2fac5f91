#!/usr/bin/env bash
# The harvest's top-k over torch's threads in the engine: profile-host --no-profile, goose-b8 (an 8-draft tree
# every step, allocator off), before = d56c44c (/tmp/suite, one thread) / after = the commit that adds
# kernels.vocab.topk_probs_threads (/tmp/ta); 1 and 8 requests ABBA, 64 requests AB; SmolLM2-135M bf16, 128 tokens.
# Output: docs/measurements/cpu/harvest_threads_ab_2026_12_04.txt and harvest_threads_{before,after}_2026_12_04.jsonl
set -u
run() {  # tree conc tag
  local tree=$1 c=$2 tag=$3
  local n=$(( c <= 1 ? 4 : (c <= 8 ? 8 : 64) ))
  echo "== $(date -u +%H:%M:%S) $tag goose-b8 c=$c"
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --method goose-b8 --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
     --json /work/main/docs/measurements/cpu/harvest_threads_${tag}_2026_12_04.jsonl 2>&1 | grep -v WARNING \
     | grep -E "tokens/s|ms/step wall|plugin's own|  (topk|harvest|walk|propose) ")
}
lscpu | grep -E 'Model name'
for c in 1 8; do
  run /tmp/suite $c before
  run /tmp/ta $c after
  run /tmp/ta $c after
  run /tmp/suite $c before
done
run /tmp/suite 64 before
run /tmp/ta 64 after

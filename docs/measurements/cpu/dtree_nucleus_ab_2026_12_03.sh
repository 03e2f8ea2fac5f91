#!/usr/bin/env bash
# draft_tree's sampled laws without the vocabulary sort (verifiers/sampling.py::_nucleus_unsorted),
# before / after in one run: profile-host --no-profile, Qwen2.5-Coder-1.5B target / 0.5B draft, bf16,
# dtree-1.2.0 (a chain of 2 drafted by q, Traversal), 4 requests, 8 report-split prompts (4 MBPP, 4 MATH500) x 48 tokens,
# T = 0.7, top-p 0.95, every request seeded (1234). ABBA.
# before = 310f718 (/tmp/before), after = 2348c98 (/tmp/after), git worktrees.
set -u
declare -A seen
out=/work/main/docs/measurements/cpu/dtree_nucleus_2026_12_03.jsonl
run() {  # tree tag
  local tree=$1 tag=$2
  echo "== $(date -u +%H:%M:%S) $tag"
  (cd $tree && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING /work/main/.venv/bin/python -m vllm_anisotropic.cli profile-host \
     --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --method dtree-1.2.0 --max-num-seqs 4 --num-prompts 4 \
     --dataset mbpp,math500 --max-tokens 48 --max-model-len 2048 --no-profile \
     --temperature 0.7 --top-p 0.95 --seed 1234 --json /tmp/dtree_nucleus_${tag}.jsonl 2>&1 | grep -v WARNING \
     | grep -E "tokens/s|ms/step wall|plugin's own|  walk|  propose")
  local lines=$(cat /tmp/dtree_nucleus_${tag}.jsonl 2>/dev/null | wc -l)
  [ "$lines" -gt "${seen[$tag]:-0}" ] || { echo "   (no record: the run failed)"; return; }
  seen[$tag]=$lines
  tail -1 /tmp/dtree_nucleus_${tag}.jsonl | python3 -c "import json,sys; d=json.load(sys.stdin); d['tag']='$tag'; print(json.dumps(d))" >> $out
}
lscpu | grep -E 'Model name'
for tag in before after after before; do run /tmp/$tag $tag; done

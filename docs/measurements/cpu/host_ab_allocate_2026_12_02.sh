#!/usr/bin/env bash
# profile-host --no-profile A/B of the allocator's decision in one compiled call
# (kernels.allocate.allocate_batch): before = the commit before it (git worktree at /tmp/a0),
# after = this tree. goose-nogate (the allocator on, trees offered every step, so every decode
# step runs BatchBudget.cut's allocations) at 8 and 64 requests, ABBA per concurrency; bf16, 128 tokens.
# Records: docs/measurements/cpu/host_ab_{before,after}_<RUN>.jsonl, RUN = $1 (default 2026_12_02f:
# after = cc30723, the kernel alone; 2026_12_02g: after = 146574e, with the cut over one array);
# table: python docs/measurements/cpu/host_ab_table_2026_11_28.py <RUN>
#   git worktree add /tmp/a0 94974ef && bash docs/measurements/cpu/host_ab_allocate_2026_12_02.sh 2026_12_02g
set -u
cd /work/main
RUN=${1:-2026_12_02f}
run() {  # side tree c
  local side=$1 tree=$2 c=$3 n=$(( $3 <= 8 ? 8 : 22 ))
  echo "== $side c=$c" >&2
  PYTHONPATH=$tree VLLM_LOGGING_LEVEL=WARNING .venv/bin/python -m vllm_anisotropic.cli profile-host \
    --method goose-nogate --max-num-seqs $c --num-prompts $n --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile \
    --json docs/measurements/cpu/host_ab_${side}_${RUN}.jsonl 2>&1 | grep -v WARNING | grep -E "tokens/s|ms/step|cut" | head -4
}
for c in 8 64; do
  run before /tmp/a0 $c; run after /work/main $c; run after /work/main $c; run before /tmp/a0 $c
done

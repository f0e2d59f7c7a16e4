#!/bin/bash
# Issue 32: the CUDA prefill GEMM over FP8 slots (runtime/moe_grouped_cuda.cu) on the card at hand, in one device
# call: its registers and spills (ptxas), its GPU tests against its twin and the reference, each launch of the
# forward with the Triton GEMMs and with the CUDA kernel's variants (same process), then the whole forward against
# the peer with both. Run from the project root:
#
#     OUT=... TAG=2026-12-07-h100-i32-prefill1 bash benchmarks/issue32_prefill.sh
#
# MODELS, TOKENS, VARIANTS (JSON tile overrides, one per profiled config), TESTS (pytest -k), PEER_DIR may be set.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
: "${OUT:?set OUT}" "${TAG:?set TAG}"
MODELS=${MODELS:-DeepSeek-V3,Kimi-K2}
TOKENS=${TOKENS:-512,4096}
PEER_DIR=${PEER_DIR:-.device/peers}
VARIANTS=${VARIANTS:-'{}|{"prefill_kernel": "cuda"}|{"prefill_kernel": "cuda", "prefill_weight_tma": false}|{"prefill_kernel": "cuda", "prefill_overlap": false}|{"prefill_kernel": "cuda", "prefill_act_tma": true}|{"prefill_kernel": "cuda", "prefill_stages": 6}|{"prefill_kernel": "cuda", "group_m": 1}|{"prefill_kernel": "cuda", "gemm1_fused_activation": true}'}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv 2>&1 |
    tee "$OUT/$TAG-card.txt"
lib=$(python3 -c 'import torch; from runtime.moe_grouped_cuda import LIBRARY as L; print(L.library_path(torch.cuda.get_device_capability()))')
mkdir -p "$(dirname "$lib")"
nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC "-gencode=arch=compute_90a,code=sm_90a" -Xptxas -v \
    -o "$lib" runtime/moe_grouped_cuda.cu 2>&1 | grep -E "error|warning|registers|spill" | tee "$OUT/$TAG-ptxas.log"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q --noconftest tests/runtime/test_gpu.py -k "${TESTS:-cuda_prefill}" 2>&1 |
    tail -30 | tee "$OUT/$TAG-gpu-tests.log"
args=()
IFS='|' read -ra vs <<< "$VARIANTS"
for v in "${vs[@]}"; do args+=(--tile-config "$v"); done
timeout "${PROFILE_TIMEOUT:-200}" python3 benchmarks/profile_moe.py --models "$MODELS" --tokens "$TOKENS" --iters 10 \
    "${args[@]}" --peer-dir "$PEER_DIR" 2>&1 | tee "$OUT/$TAG-profile.log"
[ "${BENCH:-1}" = 0 ] && exit 0
for cfg in '{}' '{"prefill_kernel": "cuda"}'; do
    timeout "${BENCH_TIMEOUT:-150}" python3 benchmarks/bench_moe.py --models "$MODELS" --tokens "$TOKENS" --trials 10 \
        --rounds 3 --no-exact --anchors --peer-dir "$PEER_DIR" --tile-config "$cfg" \
        --out "$OUT/$TAG-bench-$([ "$cfg" = '{}' ] && echo triton || echo cuda).json" 2>&1 | tail -12
done

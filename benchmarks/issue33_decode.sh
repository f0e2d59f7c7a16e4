#!/bin/bash
# Issue 33: the CUDA decode GEMM over mixed slots (runtime/moe_mixed_cuda.cu) on the card at hand, in one device call:
# its registers and spills (ptxas), its GPU tests against its PyTorch twin and the reference, then the mixed forward
# against the FP8 conversion of the same weights at decode sizes, with the Triton kernel and the kernel's variants
# timed in the same process. Run from the project root:
#
#     OUT=... TAG=2026-12-06-h200-i33 bash benchmarks/issue33_decode.sh
#
# MODELS, TOKENS, TILES (the base tile config, profiled), VARIANTS, TESTS (pytest -k), TEST_TIMEOUT and BENCH_TIMEOUT
# may be set;
# PREFILL=0 leaves out the T = 4096 runs.
# Writes $OUT/$TAG-{card.txt,ptxas.log,gpu-tests.log,bench.json,bench-4096-mxfp4.json,bench-4096.json}; the
# benchmarks' output goes to stdout.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
: "${OUT:?set OUT}" "${TAG:?set TAG}"
MODELS=${MODELS:-DeepSeek-V4-Flash,Kimi-K2.6,NVFP4-V4-Flash}
TOKENS=${TOKENS:-1,8,64}
# the base config is the default (the CUDA decode kernel at these sizes, profiled launch by launch); the Triton
# kernel, mma.sync and the CUDA kernel's K splits and ring depths the variants
TILES=${TILES:-'{}'}
VARIANTS=${VARIANTS:-'[{"decode_kernel": "triton"}, {"decode_int4_codes": "signed"}, {"decode_mma": "mma.sync"}, {"decode_shared_split": 2}, {"decode_stages": 3}, {"gemm1_split_k": 1}, {"gemm1_split_k": 1, "decode_stages": 3}, {"dependent_launch": false}]'}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv 2>&1 |
    tee "$OUT/$TAG-card.txt"
cap=$(python3 -c 'import torch; print("".join(map(str, torch.cuda.get_device_capability())))')
arch=$cap$([ "$cap" = 90 ] && echo a)
# built where the runtime looks for it, so the tests and the benchmark load this build
lib=$(python3 -c 'import torch; from runtime.moe_mixed_cuda import library_path as p; print(p(torch.cuda.get_device_capability()))')
mkdir -p "$(dirname "$lib")"
nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC "-gencode=arch=compute_$arch,code=sm_$arch" -Xptxas -v \
    -o "$lib" runtime/moe_mixed_cuda.cu 2>&1 | grep -E "error|warning|registers|spill" | tee "$OUT/$TAG-ptxas.log"
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q --noconftest tests/runtime/test_gpu_mixed.py -k "${TESTS:-decode or fold}" 2>&1 | tail -30 |
    tee "$OUT/$TAG-gpu-tests.log"
timeout "${BENCH_TIMEOUT:-270}" python3 benchmarks/bench_mixed_moe.py --models "$MODELS" --tokens "$TOKENS" --trials 10 --profile \
    --tile-config "$TILES" --variants "$VARIANTS" --out "$OUT/$TAG-bench.json"
# prefill, where the Triton kernel runs: the same comparison and each launch's time; MXFP4 with its FP8 fold too
[ "${PREFILL:-1}" = 0 ] && exit 0
timeout 60 python3 benchmarks/bench_mixed_moe.py --models DeepSeek-V4-Flash --tokens 4096 --trials 5 --profile \
    --variants '[{"mxfp4_mma": "fold"}, {"mxfp4_mma": "fold", "swap_ab": true}]' --out "$OUT/$TAG-bench-4096-mxfp4.json"
timeout 60 python3 benchmarks/bench_mixed_moe.py --models Kimi-K2.6,NVFP4-V4-Flash --tokens 4096 --trials 5 --profile \
    --out "$OUT/$TAG-bench-4096.json"

#!/bin/bash
# Issue 33: Nsight Compute over the CUDA decode GEMM (runtime/moe_mixed_cuda.cu) and the FP8 kernel on the same
# weights, one forward each at T = 1 and T = 64 on DeepSeek-V4-Flash's shape: stall reasons, occupancy, memory
# throughput. Run from the project root: OUT=... TAG=... bash benchmarks/issue33_profile.sh
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
: "${OUT:?set OUT}" "${TAG:?set TAG}"
lib=$(python3 -c 'import torch; from runtime.moe_mixed_cuda import library_path as p; print(p(torch.cuda.get_device_capability()))')
mkdir -p "$(dirname "$lib")"
nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC "-gencode=arch=compute_90a,code=sm_90a" -o "$lib" runtime/moe_mixed_cuda.cu
for T in ${TOKENS:-1 64}; do
    # the last (4th) forward of each side: launches 3 x 2 decode GEMMs skipped, then FP8's 3 x 2 skipped
    timeout ${NCU_TIMEOUT:-150} ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
        -k regex:"mixed_decode_kernel" --launch-skip 6 --launch-count 2 \
        python3 benchmarks/profile_mixed_decode.py --tokens "$T" > "$OUT/$TAG-ncu-mixed-T$T.txt" 2>&1
    timeout ${NCU_TIMEOUT:-150} ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
        --section Occupancy -k regex:"_moe_gemm_kernel" --launch-skip 6 --launch-count 2 \
        python3 benchmarks/profile_mixed_decode.py --tokens "$T" > "$OUT/$TAG-ncu-fp8-T$T.txt" 2>&1
done

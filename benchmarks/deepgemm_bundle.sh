#!/bin/bash
# Make the offline DeepGEMM bundle that benchmarks/deepgemm_setup.sh unpacks on the device (which has no network):
# DeepGEMM 03d0be3 (the last version whose kernels are JIT-compiled from Python, no C++ extension to build) with the
# CUTLASS headers it includes (eefa171, its submodule commit) copied into deep_gemm/include, and the cuda-bindings
# wheels its JIT loads kernels with (installed there only if the image lacks them). Run here, from the project root,
# after the two repositories were fetched (the `fetch` tool: github:deepseek-ai/DeepGEMM, github:NVIDIA/cutlass):
#
#     bash benchmarks/deepgemm_bundle.sh /work/.mirror/deepseek-ai+DeepGEMM/repo /work/.mirror/NVIDIA+cutlass/repo
#
# Writes .device/deepgemm/ (git-ignored; about 13 MB; carry it).
set -euo pipefail
DG=${1:?DeepGEMM git dir} CUTLASS=${2:?CUTLASS git dir}
DEST=.device/deepgemm
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git -C "$DG" archive 03d0be3 deep_gemm | tar -x -C "$tmp"
git -C "$CUTLASS" archive eefa171318b79cbe2e78514d4cce5cd0fe919d0c include/cute include/cutlass | tar -x -C "$tmp"
mv "$tmp/include/cute" "$tmp/include/cutlass" "$tmp/deep_gemm/include/"
mkdir -p "$DEST/wheels"
tar -cJf "$DEST/deepgemm-03d0be3_cutlass-eefa171.tar.xz" -C "$tmp" deep_gemm
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$DEST/wheels" \
    "cuda-bindings==13.0.*" cuda-pathfinder
ls -la "$DEST" "$DEST/wheels"

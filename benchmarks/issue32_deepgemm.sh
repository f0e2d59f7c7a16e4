#!/bin/bash
# Issue 32: DeepGEMM's grouped contiguous FP8 GEMM as the fused MoE's prefill backend (prefill_kernel "deepgemm") on
# the card at hand, in one device call: DeepGEMM unpacked from the offline bundle (.device/deepgemm, made by
# benchmarks/deepgemm_bundle.sh), its GPU tests against the twin and exact math, then the forward with it against the
# Triton GEMMs and the peer, same process per model, and one call's launches. Run from the project root:
#
#     OUT=... TAG=2026-12-07-h200-i32-dg bash benchmarks/issue32_deepgemm.sh
#
# MODELS, TOKENS, KERNELS (the prefill kernels benched, "deepgemm triton"), PEER_CONFIGS (a tune_moe results file: the
# peer timed with the configs that won there), TESTS (pytest -k) and TEST_TIMEOUT may be set. Writes
# $OUT/$TAG-{dg.log,bench-deepgemm.json,bench-triton.json}.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
: "${OUT:?set OUT}" "${TAG:?set TAG}"
MODELS=${MODELS:-DeepSeek-V3,Kimi-K2}
TOKENS=${TOKENS:-512,4096}
PEERS=${PEERS:-.device/peers}
log="$OUT/$TAG-dg.log"
eval "$(bash benchmarks/deepgemm_setup.sh /tmp/deepgemm 2> >(tee -a "$log" >&2))" || exit 1
{
    date -u +%FT%TZ
    timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -s --noconftest tests/runtime/test_gpu.py \
        -k "${TESTS:-deepgemm}" 2>&1 | tail -30
    for kernel in ${KERNELS:-deepgemm triton}; do
        python3 benchmarks/bench_moe.py --models "$MODELS" --tokens "$TOKENS" --trials 10 --rounds 3 --no-exact \
            --peer-dir "$PEERS" ${PEER_CONFIGS:+--peer-configs "$PEER_CONFIGS"} \
            --tile-config "{\"prefill_kernel\": \"$kernel\"}" --out "$OUT/$TAG-bench-$kernel.json"
    done
    python3 benchmarks/profile_moe.py --models DeepSeek-V3 --tokens 4096 --iters 5 \
        --tile-config '{"prefill_kernel": "deepgemm"}'
    date -u +%FT%TZ
} 2>&1 | tee -a "$log"

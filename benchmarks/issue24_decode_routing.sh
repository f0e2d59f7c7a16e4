#!/bin/bash
# Issue 24's decode and routing pass on one GPU (2026-12-04): checks first, then timings; everything into $OUT.
#   OUT=/tmp/out PEERS=.peers bash benchmarks/issue24_decode_routing.sh
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
PEER_ARGS="--peer-dir ${PEERS:-.peers} --peer-configs benchmarks/results/2026-12-03-h200-tune-1.json"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee $LOG
python3 -m pytest -q --noconftest tests/runtime/test_gpu.py -k "slot_sum or (dependent_launch and 1]) or \
  ((routing_real_shapes or fused_moe_real_shapes or deepseek_v4) and 1-) or cuda_graph_with_padding_rows and 16" \
  2>&1 | tee -a $LOG
python3 benchmarks/bench_moe.py --tokens 1 --trials 10 --rounds 3 $PEER_ARGS --out $OUT/bench-table.json 2>&1 \
  | tee -a $LOG
python3 benchmarks/bench_moe.py --tokens 1 --trials 10 --rounds 3 $PEER_ARGS --tile-config '{"sum_in_gemm2": true}' \
  --out $OUT/bench-sum-in-gemm2.json 2>&1 | tee -a $LOG
python3 benchmarks/bench_routing.py --variants --out $OUT/routing-variants.json 2>&1 | tee -a $LOG
python3 benchmarks/profile_moe.py --models DeepSeek-V3,GLM-4.5 --tokens 1 --iters 3 --tile-config '{}' \
  --tile-config '{"sum_in_gemm2": true}' 2>&1 | tee -a $LOG
# The T = 1 entries of the tile table: the table's current entry against it with the slot sum in GEMM2.
python3 benchmarks/tune_moe.py --no-peer --trials 5 --tokens 1 --only current,sum-in-gemm2 \
  --variants '{"sum-in-gemm2": {"sum_in_gemm2": true}}' --table-out runtime/configs --results-out $OUT/tune.json \
  2>&1 | tee -a $LOG
cp runtime/configs/moe_fp8_e4m3_block128_NVIDIA_H200.json $OUT/

#!/bin/bash
# Issue 24's routing defaults (bitonic top-k) on one GPU: the GPU routing tests, then the full routing benchmark.
#   OUT=/tmp/out bash benchmarks/issue24_routing_confirm.sh
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -m pytest -q --noconftest tests/runtime/test_gpu.py -k "routing_real_shapes or deepseek_v4 or \
  cuda_graph_with_padding_rows and 16" 2>&1 | tee $OUT/log.txt
python3 benchmarks/bench_routing.py --out $OUT/routing.json 2>&1 | tee -a $OUT/log.txt

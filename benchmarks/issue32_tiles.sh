#!/bin/bash
# Issue 32: one device call per card: tune the FP8 tile table on the card at hand, then time the fused MoE with it,
# with the default a card without a table gets (--default-too), against the peer and the cuBLASLt anchors, all in
# the same call. Run from the project root with the peer harness copied to .device/peers:
#
#     OUT=... TAG=2026-12-06-h100 bash benchmarks/issue32_tiles.sh            # on the device, kind nvidia-h100-x1
#     OUT=... TAG=2026-12-06-h200 bash benchmarks/issue32_tiles.sh            # kind nvidia-h200
#
# MODELS, TOKENS, ONLY, USER_TUNE, TUNE_DEADLINE (seconds of tuning before no new cell starts) and PEER_FROM (an
# earlier tune_moe results file: the peer is timed with vLLM's own config and the one that won each cell there) may be
# set. Writes
# $OUT/$TAG-{card.txt,tune.json,tune.log,bench.json,bench.log,user-tune.log} and the table the run wrote.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
: "${OUT:?set OUT}" "${TAG:?set TAG}"
MODELS=${MODELS:-DeepSeek-V3,Kimi-K2}
TOKENS=${TOKENS:-1,8,64,512,4096}
TUNE_DEADLINE=${TUNE_DEADLINE:-280}
PEER_FROM=${PEER_FROM:-benchmarks/results/2026-12-03-h200-tune-1.json}
PEERS=${PEERS:-.device/peers}
# ONLY: the candidates tried (the narrowed set below by default; ONLY= empty: every candidate of runtime/tune_moe.py)
NARROW=current,current-dense,plain-split4-hq,plain-split2-hq,plain-split4-hq-tma,paired-swap-pq-hq-swap-tma
NARROW=$NARROW,m16-epq-swap-pq,m32-epq-swap-g32-tma,m32-plain-hq-swap-tma,m64-plain-hq-tma
NARROW=$NARROW,m64-plain-hq-s4-tma-dense,m64-plain-hq-g8-s4-tma-dense
ONLY=${ONLY-$NARROW}

{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,clocks.sm,power.limit,driver_version \
        --format=csv
    python3 -c 'import torch, triton; from runtime.moe_triton import card_info
print(torch.__version__, triton.__version__, torch.cuda.get_device_properties(0)); print(card_info(0))'
} 2>&1 | tee "$OUT/$TAG-card.txt"

python3 benchmarks/tune_moe.py --models "$MODELS" --tokens "$TOKENS" --trials 5 ${ONLY:+--only "$ONLY"} \
    --peer-dir "$PEERS" --peer-from "$PEER_FROM" --deadline "$TUNE_DEADLINE" \
    --results-out "$OUT/$TAG-tune.json" 2>&1 | tee "$OUT/$TAG-tune.log"
table=$(python3 -c 'import torch; from runtime.moe_tiles import CONFIG_DIR, table_file_name as f
print(CONFIG_DIR + "/" + f(torch.cuda.get_device_name(), "fp8_e4m3_block128"))')
cp "$table" "$OUT/"

python3 benchmarks/bench_moe.py --models "$MODELS" --tokens "$TOKENS" --trials 10 --rounds 3 --anchors --no-exact \
    --default-too --peer-dir "$PEERS" --peer-configs "$OUT/$TAG-tune.json" --out "$OUT/$TAG-bench.json" 2>&1 |
    tee "$OUT/$TAG-bench.log"

# The user's tuning command on the same card: one shape into a fresh cache folder, then the lookup must read it
# (USER_TUNE=0 leaves it out).
[ "${USER_TUNE:-1}" = 0 ] && exit 0
export XDG_CACHE_HOME=/tmp/issue32-cache
python3 -m runtime.tune_moe --shape slots=257,hidden=7168,intermediate=2048,slots_per_token=9 --tokens 1,4096 \
    --trials 3 2>&1 | tee "$OUT/$TAG-user-tune.log"
python3 -c 'import torch; from runtime.moe_triton import tile_source; from runtime.tune_moe import random_fp8_experts
ew = random_fp8_experts(257, 7168, 2048)
print("lookup after the user run:", tile_source(1, ew, 9, torch.device("cuda")))' 2>&1 | tee -a "$OUT/$TAG-user-tune.log"

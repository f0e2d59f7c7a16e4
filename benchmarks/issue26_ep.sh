#!/bin/bash
# Issue 26 on one machine of N GPUs, one device call per model (the machine starts bare: each call builds its own):
#   OUT=/tmp/out bash benchmarks/issue26_ep.sh v3 2      # DeepSeek-V3: 3 dense + 2 MoE layers at real widths
#   OUT=/tmp/out bash benchmarks/issue26_ep.sh v4 2      # DeepSeek-V4-Flash: 3 hash-routed + 2 score-routed layers
# Builds and converts the checkpoint, then benchmarks/ep_multi_gpu.py twice: with the shared replica (must say PASS,
# exit 0) and without it (must say FAIL, exit 1). Writes $OUT/<model>-<N>{-build,,-noreplica}.json and the log.
# A third argument "cpu" rehearses the same steps on a CPU: toy widths, gloo, float32 (seconds).
set -o pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# NVLink multicast off (device README: a program using it can take the host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 NCCL_NVLSTREE_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
model=$1 n=${2:-2} W=/tmp/ep
if [ "$3" = cpu ]; then
  W=$(mktemp -d) on_build=(--toy --device cpu) on_ep=(--backend gloo --device cpu --dtype float32 --seq 16 --new-tokens 2)
fi
case $model in
  v3) build=(--moe-layers 2) ;;
  v4) build=(--family deepseek-v4-flash --moe-layers $([ "$3" = cpu ] && echo 3 || echo 5)) ;;
  *) echo "usage: OUT=DIR bash $0 v3|v4 NGPUS [cpu]" >&2; exit 2 ;;
esac
log=$OUT/$model-$n.log
trap 'rm -rf $W/$model' EXIT  # the disk goes to the next model's checkpoint, whatever happens
nvidia-smi --query-gpu=index,name,memory.total --format=csv 2>&1 | tee $log
python3 benchmarks/bench_load.py --work $W/$model "${build[@]}" "${on_build[@]}" --build-only \
  --out $OUT/$model-$n-build.json 2>&1 | tee -a $log || exit 1
ep="python3 -m torch.distributed.run --standalone --nproc-per-node $n benchmarks/ep_multi_gpu.py"
ep="$ep $W/$model/converted ${on_ep[*]}"
$ep --out $OUT/$model-$n.json 2>&1 | tee -a $log
replica=$?
$ep --no-shared-replica --no-placement --out $OUT/$model-$n-noreplica.json 2>&1 | tee -a $log
noreplica=$?
echo "issue26 $model on $n GPUs: with the shared replica exit $replica (want 0), without it exit $noreplica (want 1)" \
  | tee -a $log
[ $replica -eq 0 ] && [ $noreplica -ne 0 ]

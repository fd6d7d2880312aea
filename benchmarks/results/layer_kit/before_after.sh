#!/usr/bin/env bash
# Device-side: before/after runs of the two issue-10 benchmarks in one call. Usage: bash .carry/before_after.sh proxy|offline|tests
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
set -o pipefail
ROOT=$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
for what in "$@"; do
  case $what in
    proxy)
      for side in before after; do
        dir=$ROOT; [ $side = before ] && dir=$ROOT/.before
        (cd $dir && PYTHONPATH=$dir timeout 280 python3 benchmarks/gpu_m3_proxy.py --batches 1 32 128 --profile-batches \
           --steps 24 --prefill-reps 2 --time-budget-s 200 --out $OUT/proxy_$side.json > $OUT/proxy_$side.log 2>&1)
        echo "== proxy $side rc=$?"; tail -22 $OUT/proxy_$side.log
      done ;;
    offline)
      for side in before after; do
        dir=$ROOT; [ $side = before ] && dir=$ROOT/.before
        (cd $dir && PYTHONPATH=$dir timeout 240 python3 benchmarks/offline_throughput.py --skip-hf --variants 'ladle={}' \
           --model $ROOT/.bench_assets/smollm2-135m --batch-sizes 1,32,128 --out $OUT/offline_$side.json > $OUT/offline_$side.log 2>&1)
        echo "== offline $side rc=$?"; tail -8 $OUT/offline_$side.log
      done ;;
    tests)
      PYTHONPATH=$ROOT timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/models tests/engine \
        > $OUT/gpu_tests.log 2>&1; echo "== gpu tests rc=$?"; tail -25 $OUT/gpu_tests.log ;;
  esac
done

#!/usr/bin/env bash
# Session 4, call 1: the GPU tests never run yet, the MXFP4 A/B, then gpu_m3_proxy before (a7214e7) / after (HEAD).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
PYTHONPATH=$ROOT timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/engine/test_async_scheduling_gpu.py tests/quant/test_mxfp4.py tests/quant/test_mxfp4_w4a8.py tests/observe/test_op_timing.py \
  > $OUT/gpu_new_tests.log 2>&1
echo "== new gpu tests rc=$?"; tail -12 $OUT/gpu_new_tests.log
PYTHONPATH=$ROOT timeout 170 python3 benchmarks/gpu_mxfp4_ab.py --prefill > $OUT/mxfp4_ab.log 2>&1
echo "== mxfp4 ab rc=$?"; tail -30 $OUT/mxfp4_ab.log
for side in before after; do
  dir=$ROOT; [ $side = before ] && dir=$ROOT/.before
  (cd $dir && PYTHONPATH=$dir timeout 125 python3 benchmarks/gpu_m3_proxy.py --batches 1 32 128 --profile-batches \
     --steps 16 --prefill-reps 1 --time-budget-s 70 --out $OUT/proxy_$side.json > $OUT/proxy_$side.log 2>&1)
  echo "== proxy $side rc=$?"; tail -14 $OUT/proxy_$side.log
done

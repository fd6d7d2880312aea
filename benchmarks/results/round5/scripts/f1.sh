#!/usr/bin/env bash
# Session 5, call F1 (final tree), issue 12's TP = 1 no-regression check in one call: gpu_m3_proxy and
# offline_throughput, before (a7214e7, the tree before the multiprocess executor) / after (HEAD).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
for side in after before; do
  dir=$ROOT; b="1 32 128"; [ $side = before ] && { dir=$ROOT/.before; b="1 32"; }
  (cd $dir && PYTHONPATH=$dir timeout 115 python3 benchmarks/gpu_m3_proxy.py --batches $b --profile-batches \
     --steps 16 --prefill-reps 1 --time-budget-s 70 --out $OUT/proxy_$side.json > $OUT/proxy_$side.log 2>&1)
  echo "== proxy $side rc=$?"; tail -9 $OUT/proxy_$side.log | cut -c1-200
done
for side in before after; do
  dir=$ROOT; [ $side = before ] && dir=$ROOT/.before
  (cd $dir && PYTHONPATH=$dir timeout 80 python3 $ROOT/benchmarks/offline_throughput.py --skip-hf --variants "ladle-$side={}" \
     --no-step-timing --model $ROOT/.bench_assets/smollm2-135m --batch-sizes 1,32,128 --repeats 3 \
     --out $OUT/offline_${side}.json > $OUT/offline_${side}.log 2>&1)
  echo "== offline $side rc=$?"; grep -E "^\s+(1|32|128)\s+ladle" $OUT/offline_${side}.log
done

#!/usr/bin/env bash
# Session 4, call 7: offline_throughput (SmolLM2 shapes, dummy bf16, CUDA graphs) before (a7214e7) / after (HEAD), twice.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$PWD
for i in 1 2; do for side in before after; do
  dir=$ROOT; [ $side = before ] && dir=$ROOT/.before
  (cd $dir && PYTHONPATH=$dir timeout 80 python3 $ROOT/benchmarks/offline_throughput.py --skip-hf --variants "ladle-$side={}" \
     --no-step-timing --model $ROOT/.bench_assets/smollm2-135m --batch-sizes 1,32,128 --repeats 3 \
     --out $OUT/offline_${side}_$i.json > $OUT/offline_${side}_$i.log 2>&1)
  echo "== $side $i rc=$?"; grep -E "^\s+(1|32|128)\s+ladle" $OUT/offline_${side}_$i.log
done; done

#!/usr/bin/env bash
# Session 5, call F4: offline LLM.generate (SmolLM2 shapes, dummy bf16, B = 32, 128, step timing on), this session's
# tree (HEAD) against last session's final tree (00cfb26, .r4), alternating, to tell a tree change from a slower host.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$PWD
lscpu | grep -E "Model name|^CPU\(s\)|MHz" | head -4
for run in head_1 r4_1 head_2 r4_2; do
  dir=$ROOT; [ ${run%_*} = r4 ] && dir=$ROOT/.r4
  (cd $dir && PYTHONPATH=$dir timeout 70 python3 $ROOT/benchmarks/offline_throughput.py --skip-hf --variants "ladle-$run={}" \
     --model $ROOT/.bench_assets/smollm2-135m --batch-sizes 32,128 --repeats 3 \
     --out $OUT/offline_$run.json > $OUT/offline_$run.log 2>&1)
  echo "== $run rc=$?"; grep -E "^\s+(32|128)\s+ladle" $OUT/offline_$run.log
done

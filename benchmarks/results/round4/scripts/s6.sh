#!/usr/bin/env bash
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$PWD
(cd .before && PYTHONPATH=$ROOT/.before timeout 110 python3 benchmarks/gpu_m3_proxy.py --batches 128 --profile-batches \
   --steps 16 --prefill-reps 0 --time-budget-s 60 --out $OUT/proxy_before128.json > $OUT/proxy_before128.log 2>&1)
echo "== before B=128 rc=$?"; tail -6 $OUT/proxy_before128.log | cut -c1-170
PYTHONPATH=$ROOT timeout 250 python3 benchmarks/gpu_m3_proxy.py --layers 60 --quantization fp8 --kv-cache-dtype fp8 \
  --batches 32 128 --profile-batches --steps 12 --prefill-reps 2 --time-budget-s 150 --model-dir /tmp/m3proxy \
  --out $OUT/proxy60_fp8.json > $OUT/proxy60_fp8.log 2>&1
echo "== proxy60 fp8 rc=$?"; tail -9 $OUT/proxy60_fp8.log | cut -c1-200

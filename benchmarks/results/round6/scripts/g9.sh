#!/usr/bin/env bash
# Session 6, call 9: the combine at its swept prefill tile: GPU test, then the FP8 60-layer proxy's 8K prefill and
# B = 32 decode profiles again (call 7 ran the first tile).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_moe_combine.py > $OUT/gpu_test_combine.log 2>&1
echo "== combine gpu test rc=$?"; tail -2 $OUT/gpu_test_combine.log
timeout 200 python3 benchmarks/gpu_m3_proxy.py --layers 60 --quantization fp8 --kv-cache-dtype fp8 \
  --batches 32 --profile-batches 32 --profile-prefill --steps 12 --prefill-reps 1 --time-budget-s 150 --model-dir /tmp/m3proxy \
  --out $OUT/proxy60_fp8_profile_tile.json > $OUT/proxy60_fp8_profile_tile.log 2>&1
echo "== proxy60 fp8 profile rc=$?"; grep -E "_moe_combine_kernel|_index_score_kernel|^B=32|^prefill" $OUT/proxy60_fp8_profile_tile.log | cut -c1-170

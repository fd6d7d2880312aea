#!/usr/bin/env bash
# Session 5, call F5 (final tree): the quant GPU tests (the new act-quant kernel on CUDA), then the FP8 60-layer
# proxy's B = 32 decode and 8K prefill kernel profiles (after the act-quant change; call 1 = before).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$PWD
PYTHONPATH=$ROOT timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/quant > $OUT/gpu_tests_quant.log 2>&1
echo "== quant gpu tests rc=$?"; tail -4 $OUT/gpu_tests_quant.log
PYTHONPATH=$ROOT timeout 200 python3 benchmarks/gpu_m3_proxy.py --layers 60 --quantization fp8 --kv-cache-dtype fp8 \
  --batches 32 --profile-batches 32 --profile-prefill --steps 12 --prefill-reps 1 --time-budget-s 150 --model-dir /tmp/m3proxy \
  --out $OUT/proxy60_fp8_profile_after.json > $OUT/proxy60_fp8_profile_after.log 2>&1
echo "== proxy60 fp8 profile rc=$?"; grep -E "_act_quant_kernel|kernel profile|^B=32|^prefill" $OUT/proxy60_fp8_profile_after.log | cut -c1-200

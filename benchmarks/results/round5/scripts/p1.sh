#!/usr/bin/env bash
# Session 5, call 1: FP8 60-layer proxy, per-kernel profile of the B=32 decode step and of one 8K prefill (issue 11).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
PYTHONPATH=$ROOT timeout 280 python3 benchmarks/gpu_m3_proxy.py --layers 60 --quantization fp8 --kv-cache-dtype fp8 \
  --batches 32 --profile-batches 32 --profile-prefill --steps 12 --prefill-reps 1 --time-budget-s 150 --model-dir /tmp/m3proxy \
  --out $OUT/proxy60_fp8_profile.json > $OUT/proxy60_fp8_profile.log 2>&1
echo "== proxy60 fp8 profile rc=$?"; grep -v "^\s*$" $OUT/proxy60_fp8_profile.log | grep -vE "async_scheduling|cuda_graph_decode|fp8_act_quant|fp8_gemm  |fused_moe" | tail -90 | cut -c1-180

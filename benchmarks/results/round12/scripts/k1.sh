#!/usr/bin/env bash
# Session 12, call 2: per-expert cuBLAS (torch._scaled_mm block-wise) against the Triton FP8 MoE GEMMs at prefill
# sizes (benchmarks/gpu_fp8_moe_cublas_probe.py).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD
timeout 400 python3 benchmarks/gpu_fp8_moe_cublas_probe.py --out $OUT/fp8_moe_cublas_probe.json > $OUT/fp8_moe_cublas_probe.log 2>&1
echo "== probe rc=$?"
tail -c 6000 $OUT/fp8_moe_cublas_probe.log

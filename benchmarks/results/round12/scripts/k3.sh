#!/usr/bin/env bash
# Session 12, call 4: the shared expert (row E, every token) as two dense scaled_mm GEMMs beside the Triton GEMMs on
# the 4 routed columns, against today's 5-column Triton GEMMs (benchmarks/gpu_fp8_moe_cublas_probe.py --shared-split).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD
timeout 300 python3 benchmarks/gpu_fp8_moe_cublas_probe.py --shared-split 8192 2048 512 --out $OUT/shared_split.json > $OUT/shared_split.log 2>&1
echo "== rc=$?"
tail -c 3000 $OUT/shared_split.log

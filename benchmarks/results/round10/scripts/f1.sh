#!/usr/bin/env bash
# Session 10, final call: the GPU tests of the code changed this round (scaled_mm with padded rows and in a CUDA
# graph; the combine), then issue 11's line on the FP8 60-layer TP4-rank proxy (round 8's d2.sh: fresh
# Triton cache, c = 32 and c = 128, debug summaries), all in one call.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PYTHONPATH=. timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/quant/test_fp8_gemm_scaled_mm.py \
  tests/kernels/test_moe_combine.py > $OUT/gpu_tests.log 2>&1
echo "== gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log
TAG=fp8_60 BENCH_S=150 bash benchmarks/results/round8/scripts/d2.sh

#!/usr/bin/env bash
# Session 10, final call (device time left for one point only): the GPU test of scaled_mm with padded rows
# (M = 2050), then issue 11's line at c = 128 on the FP8 60-layer TP4-rank proxy (round 8's d2.sh: fresh Triton
# cache, debug summaries).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PYTHONPATH=. timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider \
  "tests/quant/test_fp8_gemm_scaled_mm.py::test_scaled_mm_gpu_against_reference" > $OUT/gpu_tests.log 2>&1
echo "== gpu tests rc=$?"; tail -2 $OUT/gpu_tests.log
TAG=fp8_60 BENCH_S=150 POINTS="128:128" bash benchmarks/results/round8/scripts/d2.sh

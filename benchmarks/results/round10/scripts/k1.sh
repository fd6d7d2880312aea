#!/usr/bin/env bash
# Session 10, call 1: the bf16 slot-row A/B (round 9's prepared option) on the served FP8 MoE tile at every M of the
# script, each row checked against its reference; then the GPU tests of the fused-MoE kernels and the combine.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
timeout 240 python3 benchmarks/gpu_fp8_moe_prefill_ab.py --only "gu block w8,gu block w8 bf16 slots,gu block,gu block bf16 slots" \
  --time-budget-s 150 --out $OUT/slots_ab.json > $OUT/slots_ab.log 2>&1; echo "== slots_ab rc=$?"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_moe_combine.py tests/kernels/test_moe_fused.py tests/quant/test_fp8_kernels.py \
  > $OUT/gpu_tests.log 2>&1; echo "== gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log
grep -v '^ROW' $OUT/slots_ab.log | tail -40 | cut -c1-200

#!/usr/bin/env bash
# Session 10, call 4: GEMM 2 over 2 / 4 column tiles per program (Fp8MoEOptions.gemm2_n_tiles) against the served
# tile at M = 8192 / 2048 / 32, each row checked against its reference; then the GPU tests of the changed code
# (scaled_mm with padded rows, the FP8 MoE and its options, the combine).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
timeout 240 python3 benchmarks/gpu_fp8_moe_prefill_ab.py \
  --only "gu block w8,gu block w8 g2n2,gu block w8 g2n4,gu block w8 s4 g2n4,gu block,gu block g2n2,gu block g2n4" \
  --time-budget-s 150 --out $OUT/n_tiles_ab.json > $OUT/n_tiles_ab.log 2>&1; echo "== n_tiles_ab rc=$?"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/quant/test_fp8_gemm_scaled_mm.py tests/quant/test_fp8_moe_options.py \
  tests/kernels/test_moe_combine.py tests/kernels/test_moe_fused.py tests/quant/test_fp8_kernels.py > $OUT/gpu_tests.log 2>&1
echo "== gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log
grep -v '^ROW' $OUT/n_tiles_ab.log | tail -16 | cut -c1-220

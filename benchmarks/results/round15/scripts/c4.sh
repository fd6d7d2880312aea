#!/usr/bin/env bash
# Session 15, call 4: the final tree: (1) the FP8 MoE GPU tests at the TP4-rank shapes (per-row and block-uniform
# scales at 1 / 32 / 2048 / 9000 tokens: GEMM 2 into aligned rows up to 8192 tokens, slot rows with the 128-row tile
# above); (2) issue 11's line served (16384-token MoE chunks), c = 32 and c = 128.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
PYTHONPATH=/tmp/site:$PWD timeout 80 python3 -m pytest -q -m gpu -p no:cacheprovider tests/quant/test_fp8_kernels.py \
  -k "fused_moe_fp8_gpu" > $OUT/gpu_tests.log 2>&1
echo "== gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log | cut -c1-250; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.log | head -5
VP_POINTS="32:64 128:128" bash benchmarks/results/round14/scripts/s2.sh

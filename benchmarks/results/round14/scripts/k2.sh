#!/usr/bin/env bash
# Session 14, call 3: (1) the engine-core CUDA-graph test with round 13's cache fix, and its neighbour (the two tests
# call 1's 170 s limit cut off); (2) FP8 MoE prefill tiles at M = 16384 (FusedMoE's chunk size is 8192 tokens, so the
# served 32K-token step never launches M = 32768): 64- and 128-row tiles at 8192 / 16384 / 32768.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=3 tests/engine/test_async_scheduling_gpu.py \
  > $OUT/gpu_tests.log 2>&1
echo "== gpu tests rc=$?"; tail -6 $OUT/gpu_tests.log; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.log | head -5
ONLY="gu block w8 s4 g2n4,gu block bm128 w8 s4 g2n4,gu block bm128 w8 s3 g2n2,gu block bm128 w8,gu block w8 s4 g2n8"
timeout 150 python3 benchmarks/gpu_fp8_moe_prefill_ab.py --sizes 16384 32768 8192 --only "$ONLY" --time-budget-s 120 \
  --out $OUT/fp8_moe_prefill.json > $OUT/fp8_moe_prefill.log 2>&1
echo "== ab rc=$?"; grep -v "^ROW" $OUT/fp8_moe_prefill.log | tail -c 4000

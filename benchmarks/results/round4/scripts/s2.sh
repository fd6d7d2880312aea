#!/usr/bin/env bash
# Session 4, call 2: vLLM and ladle (defaults) served side by side on SmolLM2 shapes, then the new GPU tests.
M=.bench_assets/smollm2-135m
SERVE="--load-format dummy --dtype bfloat16 --max-model-len 4096 --max-num-batched-tokens 8192 --no-enable-prefix-caching"
BENCH="--random-input-len 512 --random-output-len 256 --random-range-ratio 0.1"
bash .peer/s/run.sh vllm $M "$SERVE" "1 32 128" "$BENCH"
bash .peer/s/run.sh ladle $M "$SERVE" "1 32 128" "$BENCH"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PYTHONPATH=/tmp/peer/site:$PWD timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/engine/test_async_scheduling_gpu.py tests/quant/test_mxfp4.py tests/quant/test_mxfp4_w4a8.py tests/observe/test_op_timing.py \
  > $OUT/gpu_new_tests.log 2>&1
echo "== new gpu tests rc=$?"; tail -12 $OUT/gpu_new_tests.log

#!/usr/bin/env bash
# Session 13, call 4: every GPU-marked test on the final tree (the bit-move cast reaches the paged decode / prefill
# kernels every model uses), 420 s at most.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 --ignore=tests/distributed --ignore=tests/server tests > $OUT/gpu_tests_all.log 2>&1
echo "== gpu tests rc=$?"; tail -15 $OUT/gpu_tests_all.log; grep -E "^FAILED|^ERROR" $OUT/gpu_tests_all.log | head -10

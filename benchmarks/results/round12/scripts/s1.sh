#!/usr/bin/env bash
# Session 12, call 6: issue 11's line on this tree (qk_norm_rope_store), vocab-parallel FP8 60-layer proxy
# (tp4-rank-vp) at c = 32 (64 prompts) and c = 128 (128 prompts): round 11's s1.sh, vocabulary-parallel server
# only, after the GPU tests of the fused prologue.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_head_norm_rope.py \
  > $OUT/gpu_tests.log 2>&1; echo "== gpu tests rc=$?"; tail -1 $OUT/gpu_tests.log
NO_FULL=1 VP_POINTS="32:64 128:128" bash benchmarks/results/round11/scripts/s1.sh

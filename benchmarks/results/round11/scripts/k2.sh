#!/usr/bin/env bash
# Session 11, call 2: the one-launch small-T router kernel: its GPU tests (with the router's and the FP8 linears'),
# the router A/B (small x2w / small ieee rows against torch logits and the split-K kernel, old and new epilogue), and
# a per-kernel profile of the router paths at T = 1 / 32 / 128.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_moe_router.py tests/quant/test_fp8_gemm_scaled_mm.py > $OUT/gpu_tests.log 2>&1
echo "== gpu tests rc=$?"; tail -2 $OUT/gpu_tests.log
timeout 110 python3 benchmarks/gpu_moe_router_ab.py --time-budget-s 90 --out $OUT/moe_router_ab.json > $OUT/moe_router_ab.log 2>&1
echo "== router ab rc=$?"
timeout 60 python3 benchmarks/results/round11/scripts/router_kprof.py > $OUT/router_kprof.log 2>&1; echo "== router kprof rc=$?"
grep -E "^(today|kernel|op|small)" $OUT/moe_router_ab.log | grep -v " 8192 " | grep -vE "kernel (s8|s16|ieee s32)" | cut -c1-120
cut -c1-330 $OUT/router_kprof.log

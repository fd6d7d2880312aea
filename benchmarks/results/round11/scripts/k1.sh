#!/usr/bin/env bash
# Session 11, call 1: GPU tests of the changed code (router epilogue, N-minor FP8 linear scales); the router A/B (blocked
# epilogue against the old one, "... e1" rows) and the dense FP8 GEMM decode A/B (N-minor rows); then the FP8 60-layer
# proxy's B = 32 decode step and its kernel profile on round 10's final tree (4642852, git archive in .carry/old) and on
# this tree, one after the other on this machine.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_moe_router.py tests/quant/test_fp8_gemm_scaled_mm.py \
  tests/quant/test_fp8_kernels.py tests/quant/test_fp8_layers.py > $OUT/gpu_tests.log 2>&1
echo "== gpu tests rc=$?"; tail -2 $OUT/gpu_tests.log
timeout 110 python3 benchmarks/gpu_moe_router_ab.py --time-budget-s 80 --out $OUT/moe_router_ab.json > $OUT/moe_router_ab.log 2>&1
echo "== router ab rc=$?"
timeout 80 python3 benchmarks/gpu_fp8_gemm_decode_ab.py --time-budget-s 60 --out $OUT/fp8_gemm_decode_ab.json > $OUT/fp8_gemm_decode_ab.log 2>&1
echo "== gemm decode ab rc=$?"
P="--layers 60 --quantization fp8 --kv-cache-dtype fp8 --gpu-mem-util 0.95 --batches 32 --profile-batches 32 --steps 12 --prefill-reps 1 --time-budget-s 90 --model-dir /tmp/m3proxy"
(cd .carry/old && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 benchmarks/gpu_m3_proxy.py $P --out $OUT/proxy_old.json > $OUT/proxy_old.log 2>&1); echo "== proxy old rc=$?"
timeout 150 python3 benchmarks/gpu_m3_proxy.py $P --out $OUT/proxy_new.json > $OUT/proxy_new.log 2>&1; echo "== proxy new rc=$?"
grep -E "^(today|kernel|op)" $OUT/moe_router_ab.log | grep -v " 8192 " | cut -c1-120
grep -E "default|scaled_mm" $OUT/fp8_gemm_decode_ab.log | grep -v ROW | cut -c1-110
for t in old new; do echo "== proxy $t"; grep -E "^B=32|^  _|^  [a-z]|kernel profile" $OUT/proxy_$t.log | cut -c1-140 | head -24; done

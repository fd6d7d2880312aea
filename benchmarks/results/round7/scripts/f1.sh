#!/usr/bin/env bash
# Session 7, final call: GPU tests of every kernel this session touched; the MXFP4 decode A/B (H45's new path,
# default at <= 64 tokens); the FP8 60-layer proxy served at c = 32 (issue 11's line, as call 1's baseline); then the
# FP8 60-layer proxy's 8K prefill and B = 32 decode kernel profiles.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_msa_sparse_attention.py \
  tests/kernels/test_moe_router.py tests/kernels/test_moe_fused.py tests/kernels/test_moe_combine.py \
  tests/quant/test_fp8_kernels.py tests/quant/test_fp8_gemm_scaled_mm.py tests/quant/test_fp8_moe_options.py \
  tests/quant/test_mxfp4_decode.py tests/quant/test_mxfp4.py tests/models/test_minimax_m3_gpu.py > $OUT/gpu_tests.log 2>&1
echo "== gpu tests rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.log | tail -12
timeout 100 python3 benchmarks/gpu_mxfp4_decode_ab.py --out $OUT/mxfp4_decode_ab.json > $OUT/mxfp4_decode_ab.log 2>&1
echo "== mxfp4 decode ab rc=$?"; tail -22 $OUT/mxfp4_decode_ab.log | cut -c1-200
FP8_POINTS="32:64" NO_BF16=1 bash benchmarks/results/round7/scripts/s1.sh
grep -E "^c=|startup_s|died|not up" $OUT/fp8_60/*.log 2>/dev/null | head; ls $OUT
timeout 200 python3 benchmarks/gpu_m3_proxy.py --layers 60 --quantization fp8 --kv-cache-dtype fp8 \
  --batches 32 --profile-batches 32 --profile-prefill --steps 12 --prefill-reps 1 --time-budget-s 150 --model-dir /tmp/m3proxy \
  --out $OUT/proxy60_fp8_profile.json > $OUT/proxy60_fp8_profile.log 2>&1
echo "== proxy60 fp8 profile rc=$?"; grep -E "^  _|^  [a-z]|^B=32|^prefill|kernel profile" $OUT/proxy60_fp8_profile.log | cut -c1-150 | head -70

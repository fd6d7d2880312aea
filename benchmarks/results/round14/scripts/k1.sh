#!/usr/bin/env bash
# Session 14, call 1: round 13's unmeasured changes on the H200. (1) The GPU tests of the two fixes (fp32 tile-kernel
# stages, the engine-core test's CUDA cache) and of the FP8 MoE kernels; (2) FP8 MoE prefill tiles with GEMM 2's
# epilogue loads (a3ec872), round 12 call 3's variant list, against its table; (3) round 13's proxy profile (FP8
# 60-layer vocab-parallel proxy: one 8K prefill, B = 32 / 128 decode steps, kernel profiles).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/quant/test_fp8_kernels.py tests/quant/test_fp8_moe_options.py \
  tests/models/test_minimax_m3_gpu_greedy.py tests/engine/test_async_scheduling_gpu.py > $OUT/gpu_tests.log 2>&1
echo "== gpu tests rc=$?"; tail -2 $OUT/gpu_tests.log; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.log | head -5
ONLY="gu block w8 s4 g2n4,gu block bm128 w8 s4,gu block bm128 w8,gu block bm128 w8 s4 g2n4,gu block bm128 w8 s3 g2n2,gu block w8 s4 g2n8,gu block bm128 bn1 128 w8 s3,gu block w8 bn1 128"
timeout 150 python3 benchmarks/gpu_fp8_moe_prefill_ab.py --sizes 32768 8192 --only "$ONLY" --time-budget-s 110 \
  --out $OUT/fp8_moe_prefill.json > $OUT/fp8_moe_prefill.log 2>&1
echo "== ab rc=$?"; grep -v "^ROW" $OUT/fp8_moe_prefill.log | tail -c 4500
timeout 260 python3 benchmarks/gpu_m3_proxy.py --preset tp4-rank-vp --layers 60 --quantization fp8 --kv-cache-dtype fp8 \
  --gpu-mem-util 0.95 --batches 32 128 --profile-batches 32 128 --profile-prefill --steps 12 --prefill-reps 1 \
  --time-budget-s 230 --model-dir /tmp/m3proxy --out $OUT/proxy60_fp8_vp.json > $OUT/proxy60_fp8_vp.log 2>&1
echo "== proxy rc=$?"
grep -E "^decode B=|^prefill done|kernel profile|_sparse_attn|_decode_split|_prefill_kernel|_index_score|_fp8_gemm" \
  $OUT/proxy60_fp8_vp.log | cut -c1-200

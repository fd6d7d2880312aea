#!/usr/bin/env bash
# Session 12, call 5: the one-launch attention prologue (qk_norm_rope_store): its GPU tests and the M3 GPU tests,
# then call 1's proxy profile again (gpu_m3_proxy.py, FP8 60-layer vocab-parallel proxy, B = 32 / 128 decode
# steps and one 8K prefill per kernel).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_head_norm_rope.py \
  tests/models/test_minimax_m3_gpu.py tests/kernels/test_fp8_kv.py tests/kernels/test_cuda_graph.py > $OUT/gpu_tests.log 2>&1
echo "== gpu tests rc=$?"; tail -4 $OUT/gpu_tests.log
timeout 380 python3 benchmarks/gpu_m3_proxy.py --preset tp4-rank-vp --layers 60 --quantization fp8 --kv-cache-dtype fp8 \
  --gpu-mem-util 0.95 --batches 32 128 --profile-batches 32 128 --profile-prefill --steps 12 --prefill-reps 1 \
  --time-budget-s 330 --model-dir /tmp/m3proxy --out $OUT/proxy60_fp8_vp.json > $OUT/proxy60_fp8_vp.log 2>&1
echo "== proxy rc=$?"
grep -E "^B=|^prefill|kernel profile|_qk_norm|_head_norm|_store_kernel|_index_score|_sparse_attn|_fp8_gemm" $OUT/proxy60_fp8_vp.log | cut -c1-160

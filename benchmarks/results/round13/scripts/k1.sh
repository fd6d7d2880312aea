#!/usr/bin/env bash
# Session 13, call 1: the bit-move e4m3 -> bf16 cast in the attention kernels (`_common.cache_tile_to`): GPU tests of
# the kernels it touches, the sparse-attention A/B of the two casts (gpu_msa_sparse_ab.py --bit-cast), then round
# 12's proxy profile (gpu_m3_proxy.py, FP8 60-layer vocab-parallel proxy, B = 32 / 128 decode steps and one 8K
# prefill per kernel).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_msa_sparse_attention.py \
  tests/kernels/test_paged_attention.py tests/kernels/test_msa_indexer_decode.py tests/kernels/test_fp8_kv.py \
  > $OUT/gpu_tests.log 2>&1
echo "== gpu tests rc=$?"; tail -2 $OUT/gpu_tests.log; grep -E "^FAILED|Error" $OUT/gpu_tests.log | head -5
timeout 150 python3 benchmarks/gpu_msa_sparse_ab.py --bit-cast --time-budget-s 110 --out $OUT/msa_bitcast_ab.json \
  > $OUT/msa_bitcast_ab.log 2>&1
echo "== ab rc=$?"; sed -n '/^copy .* GB\/s; Hq/,$p' $OUT/msa_bitcast_ab.log
timeout 320 python3 benchmarks/gpu_m3_proxy.py --preset tp4-rank-vp --layers 60 --quantization fp8 --kv-cache-dtype fp8 \
  --gpu-mem-util 0.95 --batches 32 128 --profile-batches 32 128 --profile-prefill --steps 12 --prefill-reps 1 \
  --time-budget-s 280 --model-dir /tmp/m3proxy --out $OUT/proxy60_fp8_vp.json > $OUT/proxy60_fp8_vp.log 2>&1
echo "== proxy rc=$?"
grep -E "^decode B=|^prefill done|kernel profile|_sparse_attn|_decode_split|_prefill_kernel|_index_score|_fp8_gemm" \
  $OUT/proxy60_fp8_vp.log | cut -c1-200

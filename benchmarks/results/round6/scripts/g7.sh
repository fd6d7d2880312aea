#!/usr/bin/env bash
# Session 6, call 7 (final kernels): GPU tests of the new MoE combine and indexer decode path (+ quant, FP8 KV);
# the indexer decode A/B (old vs new defaults, exact check); the FP8 60-layer proxy's B = 32 decode and 8K prefill
# kernel profiles; offline LLM.generate (ladle only) on the final tree.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_moe_combine.py tests/kernels/test_msa_indexer_decode.py \
  tests/kernels/test_msa_indexer.py tests/kernels/test_fp8_kv.py tests/kernels/test_moe_fused.py tests/quant \
  --ignore=tests/quant/test_quantization_flag.py > $OUT/gpu_tests_kernels.log 2>&1
echo "== gpu kernel tests rc=$?"; tail -4 $OUT/gpu_tests_kernels.log
timeout 90 python3 benchmarks/gpu_msa_indexer_ab.py --out $OUT/msa_indexer_ab.json > $OUT/msa_indexer_ab.log 2>&1
echo "== indexer ab rc=$?"; tail -16 $OUT/msa_indexer_ab.log | cut -c1-190
timeout 200 python3 benchmarks/gpu_m3_proxy.py --layers 60 --quantization fp8 --kv-cache-dtype fp8 \
  --batches 32 --profile-batches 32 --profile-prefill --steps 12 --prefill-reps 1 --time-budget-s 150 --model-dir /tmp/m3proxy \
  --out $OUT/proxy60_fp8_profile.json > $OUT/proxy60_fp8_profile.log 2>&1
echo "== proxy60 fp8 profile rc=$?"; grep -E "_moe_combine_kernel|_index_score_kernel|reduce_kernel|^B=32|^prefill" $OUT/proxy60_fp8_profile.log | cut -c1-170
timeout 80 python3 benchmarks/offline_throughput.py --skip-hf --variants 'ladle={}' --model .bench_assets/smollm2-135m \
  --batch-sizes 32,128 --repeats 3 --out $OUT/offline_final.json > $OUT/offline_final.log 2>&1
echo "== offline final rc=$?"; grep -E "^\s+(32|128)\s+ladle" $OUT/offline_final.log

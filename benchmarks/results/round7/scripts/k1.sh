#!/usr/bin/env bash
# Session 7, call 1 (kernels): the four A/B scripts of this session's levers (MSA sparse prefill tile, FP8 dense GEMM
# through torch._scaled_mm block-wise, the router's Triton logits, FP8 MoE prefill GEMMs), each checked against its
# torch reference in the same run; GPU tests of the touched kernels; then the FP8 60-layer proxy's kernel profiles.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD
for s in ${AB:-msa_sparse fp8_gemm fp8_gemm_decode moe_router fp8_moe_prefill}; do
  timeout ${AB_S:-110} python3 benchmarks/gpu_${s}_ab.py --out $OUT/${s}_ab.json > $OUT/${s}_ab.log 2>&1
  echo "== $s ab rc=$?"; tail -${AB_TAIL:-22} $OUT/${s}_ab.log | cut -c1-200
done
if [ -n "$TESTS" ]; then
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS > $OUT/gpu_tests.log 2>&1
  echo "== gpu tests rc=$?"; tail -4 $OUT/gpu_tests.log
fi
if [ -z "$NO_PROFILE" ]; then
  timeout 200 python3 benchmarks/gpu_m3_proxy.py --layers 60 --quantization fp8 --kv-cache-dtype fp8 \
    --batches 32 --profile-batches 32 --profile-prefill --steps 12 --prefill-reps 1 --time-budget-s 150 --model-dir /tmp/m3proxy \
    --out $OUT/proxy60_fp8_profile.json > $OUT/proxy60_fp8_profile.log 2>&1
  echo "== proxy60 fp8 profile rc=$?"; grep -E "^  _|^  [a-z]|^B=32|^prefill|kernel profile" $OUT/proxy60_fp8_profile.log | cut -c1-150 | head -60
fi

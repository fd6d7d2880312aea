#!/usr/bin/env bash
# Session 15, call 3: (1) GPU tests of the FP8 MoE (block-uniform rows: GEMM 2 into aligned rows at 2048 tokens, BM 64
# under a BM 128 plan at 9000) and the combine; (2) FP8 MoE prefill A/B at M = 8192 / 16384 / 32768: the slot-row GEMM 2
# (round 14's served tiles) against aligned rows; (3) issue 11's line served on this tree (16384-token MoE chunks, the
# 128-row tile above 8192 tokens, aligned GEMM 2 rows), c = 32 and c = 128.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
PYTHONPATH=/tmp/site:$PWD timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=4 \
  tests/quant/test_fp8_kernels.py tests/kernels/test_moe_combine.py -k "fused_moe_fp8_gpu or combine" > $OUT/gpu_tests.log 2>&1
echo "== gpu tests rc=$?"; tail -8 $OUT/gpu_tests.log | cut -c1-250; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.log | head -5
ONLY="gu block w8 s4 g2n4,gu block bm128 w8 s4 g2n4,gu block w8 s4 g2n4 aligned,gu block bm128 w8 s4 g2n4 aligned g2bm64"
ONLY="$ONLY,gu block w8 s4 g2n8 aligned,gu block w8 s3 g2n4 aligned"
PYTHONPATH=. timeout 110 python3 benchmarks/gpu_fp8_moe_prefill_ab.py --sizes 8192 16384 32768 --only "$ONLY" \
  --time-budget-s 90 --out $OUT/fp8_moe_prefill.json > $OUT/fp8_moe_prefill.log 2>&1
echo "== ab rc=$?"; grep -v "^ROW" $OUT/fp8_moe_prefill.log | grep -v Warning | cut -c1-200 | tail -n 22
VP_POINTS="32:64 128:128" bash benchmarks/results/round14/scripts/s2.sh

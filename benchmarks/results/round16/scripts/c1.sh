#!/usr/bin/env bash
# Session 16, call 1: (1) GPU tests of the Gluon GEMM 2 (against the Triton loop's aligned rows and the float64 GEMM 2;
# the op through it) and of the served FP8 MoE rows; (2) FP8 MoE prefill A/B at M = 8192 / 16384 / 32768: the served
# tiles (aligned Triton GEMM 2 up to 8192, slot rows with the 128-row tile above) against the Gluon GEMM 2 variants.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=6 \
  tests/quant/test_fp8_kernels.py -k "gluon or fused_moe_fp8_gpu" > $OUT/gpu_tests.log 2>&1
echo "== gpu tests rc=$?"; tail -10 $OUT/gpu_tests.log | cut -c1-250; grep -E "^FAILED|^ERROR|Error" $OUT/gpu_tests.log | head -8
ONLY="gu block w8 s4 g2n4 aligned,gu block bm128 w8 s4 g2n4,gu block w8 s4 g2n4 gluon,gu block w8 s3 g2n4 gluon"
ONLY="$ONLY,gu block w8 s4 g2n8 gluon,gu block bm128 w8 s4 g2n4 gluon,gu block bm128 w8 s3 g2n4 gluon"
PYTHONPATH=. timeout 300 python3 benchmarks/gpu_fp8_moe_prefill_ab.py --sizes 8192 16384 32768 --only "$ONLY" \
  --time-budget-s 260 --out $OUT/fp8_moe_prefill.json > $OUT/fp8_moe_prefill.log 2>&1
echo "== ab rc=$?"; grep -v "^ROW" $OUT/fp8_moe_prefill.log | grep -v Warning | cut -c1-210 | tail -n 40

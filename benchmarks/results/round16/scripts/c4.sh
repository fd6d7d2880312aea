#!/usr/bin/env bash
# Session 16, call 4: (1) GPU tests of the Gluon GEMM 2, now also at 64-row tiles under the 128-row plan
# (Fp8MoEOptions.gemm2_block_m); (2) FP8 MoE prefill A/B at M = 16384 / 32768 (the 128-row plan): the served row
# against GEMM 2 at 64-row tiles under it.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=6 \
  tests/quant/test_fp8_kernels.py -k "gluon" > $OUT/gpu_tests.log 2>&1
echo "== gpu tests rc=$?"; tail -10 $OUT/gpu_tests.log | cut -c1-250; grep -E "^FAILED|^E  " $OUT/gpu_tests.log | head -12
ONLY="gu block bm128 w8 s4 g2n4 gluon,gu block bm128 w8 s4 g2n4 gluon g2bm64,gu block bm128 w8 s3 g2n4 gluon g2bm64"
PYTHONPATH=. timeout 200 python3 benchmarks/gpu_fp8_moe_prefill_ab.py --sizes 16384 32768 --only "$ONLY" \
  --time-budget-s 160 --out $OUT/fp8_moe_prefill.json > $OUT/fp8_moe_prefill.log 2>&1
echo "== ab rc=$?"; grep -v "^ROW" $OUT/fp8_moe_prefill.log | grep -v Warning | cut -c1-210 | tail -n 14

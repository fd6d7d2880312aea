#!/usr/bin/env bash
# Session 16, call 2: (1) GPU tests of both Gluon GEMMs (against the Triton loops and the float64 GEMMs; the op
# through them); (2) FP8 MoE prefill A/B at M = 8192 / 16384 / 32768: call 1's best Gluon GEMM 2 rows against the same
# with GEMM 1 from its Gluon kernel on gathered aligned rows.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=6 \
  tests/quant/test_fp8_kernels.py -k "gluon" > $OUT/gpu_tests.log 2>&1
echo "== gpu tests rc=$?"; tail -10 $OUT/gpu_tests.log | cut -c1-250; grep -E "^FAILED|^E  " $OUT/gpu_tests.log | head -12
ONLY="gu block w8 s4 g2n4 gluon,gu block bm128 w8 s4 g2n4 gluon,gluon both s4,gluon both s3,gluon both bm128 s4"
ONLY="$ONLY,gluon both bm128 s3"
PYTHONPATH=. timeout 300 python3 benchmarks/gpu_fp8_moe_prefill_ab.py --sizes 8192 16384 32768 2048 --only "$ONLY" \
  --time-budget-s 260 --out $OUT/fp8_moe_prefill.json > $OUT/fp8_moe_prefill.log 2>&1
echo "== ab rc=$?"; grep -v "^ROW" $OUT/fp8_moe_prefill.log | grep -v Warning | cut -c1-210 | tail -n 40

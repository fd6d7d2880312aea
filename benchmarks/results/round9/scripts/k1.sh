#!/usr/bin/env bash
# Session 9, call 2: kernel A/Bs in one call (each script checks every row against its reference and prints a table
# last): the router's tf32x2w / ieee kernel variants, the MXFP4 decode kernel's one-dot-per-group tiles (K32), wider
# FP8 MoE prefill tiles; then the GPU tests of the two changed kernels. Results: $OUT/*.log / *.json.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
run() { local name=$1; shift; timeout ${T_MAX:-200} python3 "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$?"; }
run moe_router_ab benchmarks/gpu_moe_router_ab.py --out $OUT/moe_router_ab.json --time-budget-s ${ROUTER_S:-100}
run mxfp4_decode_ab benchmarks/gpu_mxfp4_decode_ab.py --out $OUT/mxfp4_decode_ab.json --time-budget-s ${MX_S:-90}
run fp8_moe_prefill_ab benchmarks/gpu_fp8_moe_prefill_ab.py --out $OUT/fp8_moe_prefill_ab.json --time-budget-s ${PF_S:-60}
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_moe_router.py tests/quant/test_mxfp4_decode.py \
  > $OUT/gpu_tests.log 2>&1; echo "== gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log
for f in moe_router_ab mxfp4_decode_ab fp8_moe_prefill_ab; do echo "== $f"; grep -v '^ROW' $OUT/$f.log | tail -32 | cut -c1-190; done

#!/usr/bin/env bash
# Session 15, call 1: (1) GEMM 2 epilogue probes at M = 8192 / 32768 (benchmarks/gpu_fp8_moe_prefill_ab.py PROBE rows,
# Fp8MoEOptions.gemm2_store: 1 stores aligned rows contiguously with no slot / routed-weight loads, 2 masks the store
# off: timing only, their rel_err is meaningless); (2) issue 11's line served with 16384-token MoE chunks and the
# 128-row FP8 MoE tile above 8192 tokens (round 14's planned call 4, scripts/s2.sh there), c = 32 and c = 128.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ONLY="gu block w8 s4 g2n4,PROBE g2 aligned,PROBE g2 nostore,gu block bm128 w8 s4 g2n4,PROBE g2 aligned bm128"
PYTHONPATH=. timeout 140 python3 benchmarks/gpu_fp8_moe_prefill_ab.py --sizes 8192 32768 --only "$ONLY" \
  --time-budget-s 110 --out $OUT/fp8_moe_prefill.json > $OUT/fp8_moe_prefill.log 2>&1
echo "== ab rc=$?"; grep -v "^ROW" $OUT/fp8_moe_prefill.log | grep -v Warning | tail -c 3000
VP_POINTS="32:64 128:128" bash benchmarks/results/round14/scripts/s2.sh

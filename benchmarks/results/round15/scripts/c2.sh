#!/usr/bin/env bash
# Session 15, call 2: GEMM 2 loop probes at M = 8192 / 32768 (PROBE rows of benchmarks/gpu_fp8_moe_prefill_ab.py):
# "lean" hoists the weight pointers (one [BK, BN] base + a scalar offset per step), drops column masks and activation
# row masks; "aligned" stores rows in aligned order through a block pointer with no slot / routed-weight loads
# (timing only: wrong output), "nostore" masks the store off (timing only), r128 = maxnreg 128.
export PYTHONUNBUFFERED=1
ONLY="gu block w8 s4 g2n4,PROBE lean,PROBE lean aligned,PROBE lean aligned r128,PROBE lean nostore,PROBE lean bm128"
ONLY="$ONLY,PROBE lean g2n8,PROBE lean aligned s3,gu block bm128 w8 s4 g2n4"
PYTHONPATH=. timeout 200 python3 benchmarks/gpu_fp8_moe_prefill_ab.py --sizes 8192 32768 --only "$ONLY" \
  --time-budget-s 170 --out $OUT/fp8_moe_prefill.json > $OUT/fp8_moe_prefill.log 2>&1
echo "== ab rc=$?"; grep -v "^ROW" $OUT/fp8_moe_prefill.log | grep -v Warning | cut -c1-200 | tail -n 25

#!/usr/bin/env bash
# Session 12, call 3: FP8 MoE prefill tiles at a served 32K-token step (M = 32768, ~1,024 rows per routed expert)
# and at 8192: taller row tiles (BM 128) against the served table row.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD
ONLY="gu block w8 s4 g2n4,gu block bm128 w8 s4,gu block bm128 w8,gu block bm128 w8 s4 g2n4,gu block bm128 w8 s3 g2n2,gu block w8 s4 g2n8,gu block bm128 bn1 128 w8 s3,gu block w8 bn1 128"
timeout 420 python3 benchmarks/gpu_fp8_moe_prefill_ab.py --sizes 32768 8192 --only "$ONLY" --time-budget-s 330 \
  --out $OUT/fp8_moe_prefill_32k.json > $OUT/fp8_moe_prefill_32k.log 2>&1
echo "== ab rc=$?"
grep -v "^ROW" $OUT/fp8_moe_prefill_32k.log | tail -c 7000

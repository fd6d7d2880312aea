#!/usr/bin/env bash
# Session 6, call 6: the M3 TP4-rank proxy (28 layers, bf16, dummy) served at c = 32 (64 prompts) and c = 128 (128),
# 8192 in / 1024 out, with /metrics host phases; then the offline decode step of the same proxy at B = 32, 128.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BENCH_S=200 bash benchmarks/results/round4/scripts/m3_serve.sh bf16_28 28 "32:64 128:128" ""
PYTHONPATH=$PWD timeout 150 python3 benchmarks/gpu_m3_proxy.py --batches 32 128 --steps 16 --prefill-reps 1 \
  --time-budget-s 110 --out $OUT/proxy28_offline.json > $OUT/proxy28_offline.log 2>&1
echo "== proxy offline rc=$?"; grep -E "^B=|^prefill|decode step|step ms" $OUT/proxy28_offline.log | head -12; tail -15 $OUT/proxy28_offline.log | cut -c1-200
cd $OUT && tar czf serve_m3.tgz bf16_28 && rm -rf bf16_28

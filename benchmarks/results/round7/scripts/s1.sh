#!/usr/bin/env bash
# Session 7, served: the FP8 60-layer TP4-rank proxy with issue 11's line (8192 in / 1024 out, range ratio 0.1,
# c = 32 with 64 prompts, c = 128 with 128, --max-num-batched-tokens 32768, block 128, FP8 KV), then the bf16
# 28-layer proxy at the same points, in one call (round 4's m3_serve.sh: /metrics host phases around each point).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BENCH_S=180 bash benchmarks/results/round4/scripts/m3_serve.sh fp8_60 60 "${FP8_POINTS:-32:64 128:128}" \
  "--quantization fp8 --kv-cache-dtype fp8 --max-num-batched-tokens 32768 --gpu-memory-utilization 0.95"
[ -n "$NO_BF16" ] || BENCH_S=120 bash benchmarks/results/round4/scripts/m3_serve.sh bf16_28 28 "32:64 128:128" \
  "--dtype bfloat16 --max-num-batched-tokens 32768 --gpu-memory-utilization 0.95"
cd $OUT && for d in fp8_60 bf16_28; do [ -d $d ] && python3 - $d <<'PY'
import json, sys, glob
for f in glob.glob(sys.argv[1] + "/c*.json"):
    r = json.load(open(f))
    for k in ("itls", "generated_texts", "ttfts", "input_lens", "output_lens", "errors"):
        r.pop(k, None)
    json.dump(r, open(f, "w"), indent=1)
PY
done; tar czf serve_m3.tgz fp8_60 bf16_28 2>/dev/null && rm -rf fp8_60 bf16_28

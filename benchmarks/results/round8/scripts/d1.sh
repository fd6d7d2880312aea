#!/usr/bin/env bash
# Session 8, call 1 (diagnosis of the served gap): the FP8 60-layer TP4-rank proxy served with issue 11's line at
# c = 32 twice on one server (a: cold Triton cache, b: warm) and at c = 128, with --observe-timing; after each point
# the Triton cubin count and a /debug/steps + /debug/shapes summary (steps_summary.py).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=/tmp/tcache DEBUG_DUMP=1
mkdir -p $TRITON_CACHE_DIR; echo "triton cubins at start: $(find $TRITON_CACHE_DIR -name '*.cubin' | wc -l)"
BENCH_S=${BENCH_S:-170} bash benchmarks/results/round4/scripts/m3_serve.sh fp8_60 60 "${POINTS:-32:64:a 32:64:b 128:128}" \
  "--quantization fp8 --kv-cache-dtype fp8 --max-num-batched-tokens 32768 --gpu-memory-utilization 0.95 --observe-timing --observe-timing-interval 8 $EXTRA"
grep -E "startup|cubins" $OUT/fp8_60/server.log | head -3
for f in $OUT/fp8_60/debug_*.txt; do echo "== $f"; head -60 $f | cut -c1-170; done
cd $OUT && python3 - <<'PY'
import json, glob
for f in glob.glob("fp8_60/c*.json"):
    r = json.load(open(f))
    for k in ("itls", "generated_texts", "ttfts", "input_lens", "output_lens", "errors"):
        r.pop(k, None)
    json.dump(r, open(f, "w"), indent=1)
PY

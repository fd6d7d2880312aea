#!/usr/bin/env bash
# Session 8, call 2: the kernel warm-up at startup (ladle/runner/warmup.py) on a fresh Triton cache: the FP8 60-layer
# TP4-rank proxy served with issue 11's line at c = 32 (one run, as call 1's cold run a) and c = 128; the cubin count
# after startup and after each point says whether serving still compiles. Results are packed in one tarball.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=/tmp/tcache_$RANDOM DEBUG_DUMP=1
BENCH_S=${BENCH_S:-170} bash benchmarks/results/round4/scripts/m3_serve.sh ${TAG:-fp8_60} ${LAYERS:-60} "${POINTS:-32:64 128:128}" \
  "${FLAGS:---quantization fp8 --kv-cache-dtype fp8} --max-num-batched-tokens 32768 --gpu-memory-utilization 0.95 --observe-timing --observe-timing-interval 8"
D=$OUT/${TAG:-fp8_60}
grep -E "warm-up|memory profile|KV cache:|engine ready" $D/server.log | cut -c1-200
for f in $D/debug_*.txt; do echo "== $f"; sed -n 1,9p $f | cut -c1-400; done
cd $OUT && python3 - $D <<'PY'
import json, glob, sys
for f in glob.glob(sys.argv[1] + "/c*.json"):
    r = json.load(open(f))
    for k in ("itls", "generated_texts", "ttfts", "input_lens", "output_lens", "errors"):
        r.pop(k, None)
    json.dump(r, open(f, "w"), indent=1)
PY
tar czf ${TAG:-fp8_60}.tgz ${TAG:-fp8_60} && rm -rf ${TAG:-fp8_60}

#!/usr/bin/env bash
# Session 11, call 2: issue 11's line on this tree: the FP8 60-layer TP4-rank proxy at c = 32 (64 prompts) and c = 128
# (128 prompts), then the same proxy with the rank's vocab-parallel embedding / LM head (preset tp4-rank-vp, 50016 rows:
# the memory a TP4 rank has) at c = 128. One Triton cache for both servers (fresh at the start of the call); cubin
# counts and /debug/steps summaries after each point (DEBUG_DUMP, round4/scripts/m3_serve.sh). NO_FULL=1 skips the
# full-vocab server, NO_VP=1 the vocab-parallel one; POINTS / VP_POINTS choose their points.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=/tmp/tcache_s11_$RANDOM DEBUG_DUMP=1
FLAGS="--quantization fp8 --kv-cache-dtype fp8 --max-num-batched-tokens 32768 --gpu-memory-utilization 0.95 --observe-timing --observe-timing-interval 8"
[ -n "$NO_FULL" ] || BENCH_S=150 bash benchmarks/results/round4/scripts/m3_serve.sh fp8_60 60 "${POINTS:-32:64 128:128}" "$FLAGS"
[ -n "$NO_VP" ] || PRESET=tp4-rank-vp BENCH_S=150 bash benchmarks/results/round4/scripts/m3_serve.sh fp8_60_vp 60 "${VP_POINTS:-128:128}" "$FLAGS"
cd $OUT
for D in fp8_60 fp8_60_vp; do
  [ -d $D ] || continue
  echo "== $D"; grep -E "memory profile|KV cache:|engine ready" $D/server.log | cut -c1-200
  for f in $D/debug_*.txt; do echo "-- $f"; sed -n 1,6p $f | cut -c1-300; done
  python3 - $D <<'PY'
import json, glob, sys
for f in glob.glob(sys.argv[1] + "/c*.json"):
    r = json.load(open(f))
    for k in ("itls", "generated_texts", "ttfts", "input_lens", "output_lens", "errors"):
        r.pop(k, None)
    json.dump(r, open(f, "w"), indent=1)
PY
  tar czf $D.tgz $D && rm -rf $D
done

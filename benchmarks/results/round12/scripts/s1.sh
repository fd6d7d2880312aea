#!/usr/bin/env bash
# Session 12, call 6: issue 11's line on this tree (qk_norm_rope_store), vocab-parallel FP8 60-layer proxy
# (tp4-rank-vp) at c = 32 (64 prompts) and c = 128 (128 prompts): round 11's s1.sh with NO_VP unset, vp points only,
# after the fixed GPU test of the fused prologue.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_head_norm_rope.py \
  > $OUT/gpu_tests.log 2>&1; echo "== gpu tests rc=$?"; tail -1 $OUT/gpu_tests.log
export TRITON_CACHE_DIR=/tmp/tcache_s12_$RANDOM DEBUG_DUMP=1
FLAGS="--quantization fp8 --kv-cache-dtype fp8 --max-num-batched-tokens 32768 --gpu-memory-utilization 0.95 --observe-timing --observe-timing-interval 8"
PRESET=tp4-rank-vp BENCH_S=150 bash benchmarks/results/round4/scripts/m3_serve.sh fp8_60_vp 60 "32:64 128:128" "$FLAGS"
cd $OUT
for D in fp8_60_vp; do
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

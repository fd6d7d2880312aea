#!/usr/bin/env bash
# Serve the M3 TP4-rank proxy (dummy weights, LAYERS layers) and drive it with `ladle bench serve` at each "C:PROMPTS"
# point, 8192 in / 1024 out (range ratio 0.1), scraping /metrics around each point (device_idle, steps).
# Usage: [PRESET=tp4-rank-vp] bash .carry/m3_serve.sh TAG LAYERS "C:N[:LABEL] C:N[:LABEL]" "serve extra flags"
# (PRESET: the make-checkpoint preset, default tp4-rank; session 11 adds tp4-rank-vp, the vocab-parallel rank)
# A point's LABEL (optional) names its files c<C><LABEL>.json, so a point can repeat. With DEBUG_DUMP=1, after each
# point: the Triton cache's cubin count (TRITON_CACHE_DIR) and a summary of /debug/steps and /debug/shapes
# (round8/scripts/steps_summary.py) go to <TAG>/debug_c<C><LABEL>.txt.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [ ! -d /tmp/peer/site ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:/tmp/peer/site:$PWD
TAG=$1; LAYERS=$2; POINTS=$3; EXTRA=$4
PRESET=${PRESET:-tp4-rank}; M=/tmp/m3_$PRESET; PORT=8013; D=$OUT/$TAG; mkdir -p $D
[ -f $M/config.json ] || python3 -c "from ladle.tools.checkpoint_m3 import make_checkpoint; make_checkpoint('$M','$PRESET',config_only=True)" >/dev/null
OV=$(python3 -c "import json; from ladle.tools.checkpoint_m3 import layer_overrides; print(json.dumps(layer_overrides(json.load(open('$M/config.json'))['text_config'], $LAYERS), separators=(',',':')))")
python3 -m ladle serve $M --load-format dummy --hf-overrides "$OV" --max-model-len 11264 --max-num-seqs 128 \
  --no-enable-prefix-caching --served-model-name m --port $PORT $EXTRA > $D/server.log 2>&1 &
SP=$!; t0=$(date +%s)
until curl -sf http://127.0.0.1:$PORT/health >/dev/null 2>&1; do
  sleep 2; kill -0 $SP 2>/dev/null || { echo "$TAG server died"; tail -30 $D/server.log; exit 1; }
  [ $(( $(date +%s) - t0 )) -gt 300 ] && { echo "$TAG server not up"; kill $SP; exit 1; }
done
echo "$TAG startup_s=$(( $(date +%s) - t0 ))"; grep -iE "weight|KV|capacity|tokens|warm-up" $D/server.log | head -9
[ -n "$DEBUG_DUMP" ] && { echo "$TAG triton cubins after startup: $(find ${TRITON_CACHE_DIR:-$HOME/.triton/cache} -name '*.cubin' | wc -l)"; touch /tmp/m3_serve_started; }
for p in $POINTS; do
  IFS=: read -r c n lab <<< "$p"
  curl -s http://127.0.0.1:$PORT/metrics | grep -E "^ladle:(step_host_seconds|engine_steps)" > $D/metrics_c${c}${lab}_before.txt
  t_point=$(date +%s.%N)
  timeout ${BENCH_S:-400} python3 -m ladle bench serve --backend vllm --base-url http://127.0.0.1:$PORT --model m --tokenizer $M \
    --dataset-name random --random-input-len 8192 --random-output-len 1024 --random-range-ratio 0.1 --num-prompts $n \
    --max-concurrency $c --request-rate inf --ignore-eos --num-warmups 1 --seed 7 --percentile-metrics ttft,tpot,itl,e2el \
    --save-result --result-dir $D --result-filename c$c$lab.json > $D/bench_c$c$lab.log 2>&1 || tail -5 $D/bench_c$c$lab.log
  curl -s http://127.0.0.1:$PORT/metrics | grep -E "^ladle:(step_host_seconds|engine_steps)" > $D/metrics_c${c}${lab}_after.txt
  [ -n "$DEBUG_DUMP" ] && { echo "triton cubins: $(find ${TRITON_CACHE_DIR:-$HOME/.triton/cache} -name '*.cubin' | wc -l)";
    echo "compiled since startup: $(find ${TRITON_CACHE_DIR:-$HOME/.triton/cache} -name '*.cubin' -newer /tmp/m3_serve_started -printf '%f ' | sort)";
    python3 benchmarks/results/round8/scripts/steps_summary.py http://127.0.0.1:$PORT $t_point $D/ops_c$c$lab.json; } > $D/debug_c$c$lab.txt 2>&1
  python3 - $D $c$lab <<'PY'
import json, re, sys
d, c = sys.argv[1], sys.argv[2]
def read(p):
    out = {}
    for line in open(p):
        m = re.match(r'(\S+?)(\{.*phase="(\w+)".*\})?\s+([0-9.eE+-]+)$', line.strip())
        if m:
            out[m.group(3) or m.group(1)] = float(m.group(4))
    return out
try:
    r = json.load(open(f"{d}/c{c}.json"))
except Exception as e:
    raise SystemExit(f"c={c}: no result: {e}")
a, b = read(f"{d}/metrics_c{c}_before.txt"), read(f"{d}/metrics_c{c}_after.txt")
delta = {k: b[k] - a.get(k, 0.0) for k in b}
steps = next((v for k, v in delta.items() if "engine_steps" in k), 0)
idle = delta.get("device_idle", 0.0)
print(f"c={c}: done={r['completed']} failed={r.get('failed')} dur={r['duration']:.1f}s out_tok/s={r['output_throughput']:.1f} "
      f"(per GPU of TP4 {r['output_throughput'] / 4:.1f}) mean_tpot={r['mean_tpot_ms']:.2f}ms median_itl={r['median_itl_ms']:.2f}ms "
      f"median_ttft={r['median_ttft_ms']:.0f}ms | steps={steps:.0f} device_idle={idle:.2f}s ({100 * idle / r['duration']:.1f}% of the run)"
      f" host s: " + " ".join(f"{k}={v:.1f}" for k, v in sorted(delta.items()) if "engine_steps" not in k))
PY
done
kill -INT $SP; wait $SP 2>/dev/null

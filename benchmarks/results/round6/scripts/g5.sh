#!/usr/bin/env bash
# Session 6, call 5 (tree 87bed5d + round6 scripts): vLLM 0.26.0 and ladle (defaults) served side by side on SmolLM2 shapes.
M=.bench_assets/smollm2-135m
SERVE="--load-format dummy --dtype bfloat16 --max-model-len 4096 --max-num-batched-tokens 8192 --no-enable-prefix-caching"
BENCH="--random-input-len 512 --random-output-len 256 --random-range-ratio 0.1"
bash .peer/s/run.sh vllm $M "$SERVE" "1 32 128" "$BENCH"
bash .peer/s/run.sh ladle $M "$SERVE" "1 32 128" "$BENCH"
cd $OUT && for f in *.json; do python3 - "$f" <<'PY'
import json, sys
p = sys.argv[1]; d = json.load(open(p))
d.pop("generated_texts", None)
if isinstance(d.get("itls"), list):
    d["itls"] = [[float(f"{x:.5g}") for x in row] for row in d["itls"]]
json.dump(d, open(p, "w"))
PY
done; tar czf serve_smollm2.tgz * && find . -type f ! -name serve_smollm2.tgz -delete; ls -la $OUT

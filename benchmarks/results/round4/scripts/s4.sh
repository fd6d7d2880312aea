#!/usr/bin/env bash
# Session 4, call 4: the 60-layer TP4-rank proxy in FP8 (weights quantized at load, FP8 KV + index-K) served, issue 11's line.
bash .carry/m3_serve.sh fp8_60 60 "32:64 128:128" "--quantization fp8 --kv-cache-dtype fp8 --max-num-batched-tokens 32768 --gpu-memory-utilization 0.95"
tar -C $OUT -czf $OUT/fp8_60.tgz fp8_60 && rm -rf $OUT/fp8_60

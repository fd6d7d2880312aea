#!/usr/bin/env bash
# Session 4, call 5: the 28-layer TP4-rank proxy in bf16 served at c = 32 and 128 (issue 16; the FP8 ratio of issue 11).
bash .carry/m3_serve.sh bf16_28 28 "${POINTS:-128:128 32:64}" "--dtype bfloat16 --max-num-batched-tokens 32768 --gpu-memory-utilization 0.95"
tar -C $OUT -czf $OUT/bf16_28.tgz bf16_28 && rm -rf $OUT/bf16_28

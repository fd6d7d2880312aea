#!/usr/bin/env bash
# Session 11, call 3: where the router's ~20 us per decode call goes (per-kernel profile), then the FP8 60-layer proxy's
# B = 32 decode step, its byte roofline and kernel profile on this tree (gpu_m3_proxy.py; the engine start takes ~105 s
# with a fresh Triton cache, hence the budget).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 90 python3 benchmarks/results/round11/scripts/router_kprof.py > $OUT/router_kprof.log 2>&1; echo "== router kprof rc=$?"
timeout 330 python3 benchmarks/gpu_m3_proxy.py --layers 60 --quantization fp8 --kv-cache-dtype fp8 --gpu-mem-util 0.95 \
  --batches 32 --profile-batches 32 --steps 12 --prefill-reps 1 --time-budget-s 280 --model-dir /tmp/m3proxy ${PROXY_ARGS} \
  --out $OUT/proxy60_fp8.json > $OUT/proxy60_fp8.log 2>&1; echo "== proxy rc=$?"
cut -c1-400 $OUT/router_kprof.log
grep -E "^B=32|^  _|^  [a-z]|kernel profile|^decode|^-----|^prefill" $OUT/proxy60_fp8.log | cut -c1-150 | head -60

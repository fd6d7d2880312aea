#!/usr/bin/env bash
# Session 12, call 1: the FP8 60-layer vocab-parallel proxy's decode step (B = 32, 128) per kernel, and one 8K prefill
# per kernel, on this tree (gpu_m3_proxy.py; the engine start takes ~105 s with a fresh Triton cache).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv
timeout 520 python3 benchmarks/gpu_m3_proxy.py --preset tp4-rank-vp --layers 60 --quantization fp8 --kv-cache-dtype fp8 \
  --gpu-mem-util 0.95 --batches 32 128 --profile-batches 32 128 --profile-prefill --steps 12 --prefill-reps 1 \
  --time-budget-s 440 --model-dir /tmp/m3proxy --out $OUT/proxy60_fp8_vp.json > $OUT/proxy60_fp8_vp.log 2>&1
echo "== proxy rc=$?"
tail -c 9000 $OUT/proxy60_fp8_vp.log

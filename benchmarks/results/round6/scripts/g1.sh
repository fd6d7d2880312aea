#!/usr/bin/env bash
# Session 6, call 1: peer chunk 1 of 4 (the peer-vllm chunks re-split to 44 MiB: with the tracked tree a 48 MiB chunk no longer fits the 64 MiB limit), then the GPU tests of the engine paths the offline core process touches
# (async vs sync with CUDA graphs, core process vs in-process, M3 graphs vs eager).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/peer-chunks && cp .peer/d1/* /tmp/peer-chunks/
lscpu | grep -E "Model name|^CPU\(s\)" | head -2
PYTHONPATH=$PWD timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_async_scheduling_gpu.py \
  tests/models/test_minimax_m3_gpu.py > $OUT/gpu_tests_engine.log 2>&1
echo "== gpu engine tests rc=$?"; tail -6 $OUT/gpu_tests_engine.log

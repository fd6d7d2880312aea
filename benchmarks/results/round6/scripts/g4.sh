#!/usr/bin/env bash
# Session 6, call 4: peer chunk 4, then offline LLM.generate: vLLM 0.26.0 (child process, first) vs ladle with the
# engine core in its own process (the CUDA default now) and in-process, SmolLM2 shapes, B = 32, 128.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 FLASHINFER_WORKSPACE_BASE=/tmp/fi HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cp .peer/d4/* /tmp/peer-chunks/ && P=/tmp/peer && S=$PWD/.peer/s && mkdir -p $P && \
  cat /tmp/peer-chunks/part* | LD_LIBRARY_PATH=$S $S/zstd -d -q | tar -x -C $P || { echo "chunks failed"; exit 1; }
PYTHONPATH=/tmp/peer/site:$PWD timeout 420 python3 benchmarks/offline_throughput.py --vllm --skip-hf \
  --variants 'ladle={}' --variants 'ladle-inproc={"engine_core_process": false}' \
  --model .bench_assets/smollm2-135m --batch-sizes 32,128 --repeats 3 --out $OUT/offline_vs_vllm.json > $OUT/offline_vs_vllm.log 2>&1
echo "== offline vs vllm rc=$?"; grep -vE "^\s*$" $OUT/offline_vs_vllm.log | grep -v "it/s\]" | tail -12
PYTHONPATH=/tmp/peer/site:$PWD timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_async_scheduling_gpu.py \
  -k core_process > $OUT/gpu_test_core_process.log 2>&1
echo "== gpu core-process test rc=$?"; tail -3 $OUT/gpu_test_core_process.log

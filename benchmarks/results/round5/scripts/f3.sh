#!/usr/bin/env bash
# Session 5, call F3 (final tree): offline LLM.generate, vLLM 0.26.0 (child process, first) vs ladle, SmolLM2 shapes,
# B = 32, 128; then every GPU-marked test.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 FLASHINFER_WORKSPACE_BASE=/tmp/fi HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PYTHONPATH=/tmp/peer/site:$PWD timeout 300 python3 benchmarks/offline_throughput.py --vllm --skip-hf --variants 'ladle={}' \
  --model .bench_assets/smollm2-135m --batch-sizes 32,128 --repeats 3 --out $OUT/offline_vs_vllm.json > $OUT/offline_vs_vllm.log 2>&1
echo "== offline vs vllm rc=$?"; grep -vE "^\s*$" $OUT/offline_vs_vllm.log | grep -v "it/s\]" | tail -14
PYTHONPATH=/tmp/peer/site:$PWD timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests > $OUT/gpu_tests.log 2>&1
echo "== gpu tests rc=$?"; tail -8 $OUT/gpu_tests.log

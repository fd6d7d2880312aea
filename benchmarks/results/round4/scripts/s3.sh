#!/usr/bin/env bash
# Session 4, call 3: offline LLM.generate, vLLM 0.26.0 (child process, first) against ladle, SmolLM2 shapes, B = 32, 128.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 FLASHINFER_WORKSPACE_BASE=/tmp/fi HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PYTHONPATH=/tmp/peer/site:$PWD timeout 400 python3 benchmarks/offline_throughput.py --vllm --skip-hf --variants 'ladle={}' \
  --model .bench_assets/smollm2-135m --batch-sizes 32,128 --repeats 3 --out $OUT/offline_vs_vllm.json > $OUT/offline_vs_vllm.log 2>&1
echo "== offline rc=$?"; grep -vE "^\s*$" $OUT/offline_vs_vllm.log | grep -v "it/s\]" | tail -22

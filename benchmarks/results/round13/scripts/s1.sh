#!/usr/bin/env bash
# Session 13, call 3: issue 11's line on this tree (bit-move e4m3 -> bf16 cast in the attention kernels, round 12's
# prologue rule), vocab-parallel FP8 60-layer proxy (tp4-rank-vp) at c = 32 (64 prompts) and c = 128 (128
# prompts): round 11's s1.sh, vocabulary-parallel server only.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NO_FULL=1 VP_POINTS="32:64 128:128" bash benchmarks/results/round11/scripts/s1.sh

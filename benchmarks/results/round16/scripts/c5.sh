#!/usr/bin/env bash
# Session 16, call 5: issue 11's line served on this tree (the final tree: the Gluon GEMM 2 above 256 tokens, at 64-row tiles under the 128-row plan above 8192):
# vocab-parallel FP8 60-layer proxy at c = 32 (64 prompts) and c = 128 (128 prompts), as round 15's call 4.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
VP_POINTS="32:64 128:128" bash benchmarks/results/round14/scripts/s2.sh

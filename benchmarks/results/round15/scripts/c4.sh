#!/usr/bin/env bash
# Session 15, call 4: issue 11's line served on the final tree (16384-token MoE chunks; GEMM 2 into aligned rows up to
# 8192 tokens, slot rows with the 128-row tile above), c = 32 and c = 128. No GPU tests (the device time left holds
# one served run; call 3 ran them).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
VP_POINTS="32:64 128:128" bash benchmarks/results/round14/scripts/s2.sh

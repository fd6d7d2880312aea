#!/usr/bin/env bash
# Session 14, call 4: issue 11's c = 128 point (128 prompts) on the tree with 16384-token MoE chunks (so a 32K-token
# step runs the 128-row FP8 MoE tiles) besides call 2's changes: vocab-parallel FP8 60-layer proxy (tp4-rank-vp),
# round 11's s1.sh, vocabulary-parallel server only (as round 13's call 3). c = 32 is left out: the device time left
# held one point.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NO_FULL=1 VP_POINTS="${VP_POINTS:-128:128}" bash benchmarks/results/round11/scripts/s1.sh

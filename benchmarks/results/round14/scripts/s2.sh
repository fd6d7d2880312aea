#!/usr/bin/env bash
# Session 14, planned call 4 (NOT run: the device refused two starts and the time left could not hold a served
# point). Issue 11's c = 128 point (128 prompts) with 16384-token MoE chunks, so that a 32K-token step runs the
# 128-row FP8 MoE tiles: first set MOE_CHUNK_TOKENS = 16384 in ladle/layers/moe.py and add the row
# (8192, BM 64 tile), (MAX_TOKENS, MoETileConfig(128, 64, 128, 64, 8, 4)) to MOE_TILES["fp8_block"] (cf1aa7f). Same
# server and load as s1.sh (round 11's s1.sh, vocabulary-parallel server only); VP_POINTS="32:64 128:128" for both.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NO_FULL=1 VP_POINTS="${VP_POINTS:-128:128}" bash benchmarks/results/round11/scripts/s1.sh

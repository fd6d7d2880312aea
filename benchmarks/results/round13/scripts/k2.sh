#!/usr/bin/env bash
# Session 13, call 2: the sparse-attention tile kernel walking each block as key tiles of 128 / 64 / 32 keys
# (`key_tile`): its GPU tests, then the A/B (gpu_msa_sparse_ab.py --key-tiles: 8K prefill random / local, mixed).
# Runs at 8d4f82c only: the option and --key-tiles were reverted after this call (slower).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_msa_sparse_attention.py \
  > $OUT/gpu_tests.log 2>&1
echo "== gpu tests rc=$?"; tail -2 $OUT/gpu_tests.log; grep -E "^FAILED|Error" $OUT/gpu_tests.log | head -5
timeout 200 python3 benchmarks/gpu_msa_sparse_ab.py --key-tiles --time-budget-s 170 --out $OUT/msa_keytile_ab.json \
  > $OUT/msa_keytile_ab.log 2>&1
echo "== ab rc=$?"; sed -n '/^copy .* GB\/s; Hq/,$p' $OUT/msa_keytile_ab.log

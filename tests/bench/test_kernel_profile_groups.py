"""benchmarks/gpu_kernel_profile.py's grouping of kernel symbols (the profile runs on GPU only; the grouping is
plain string logic). Symbols below are as the torch profiler reported them on an H200."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from gpu_kernel_profile import kernel_group  # noqa: E402


@pytest.mark.parametrize("name,group", [
    ("_gemm1_kernel", "fused_moe (ladle)"),
    ("_moe_align_kernel", "fused_moe (ladle)"),
    ("_sparse_attn_kernel", "msa attention/indexer"),
    ("_merge_kernel", "msa attention/indexer"),
    ("_decode_merge_kernel", "dense attention"),  # not the MSA merge, although it contains "_merge_kernel"
    ("_store_kernel", "kv store"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda, "
     "at::native::memory::StoreWithCast<1> >", "torch elementwise/reduce/copy"),  # contains "store"
    ("nvjet_sm90_tst_512x32_64x3_2x1_v_bz_TNT", "gemm (cuBLAS/CUTLASS)"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_tn_align1>", "gemm (cuBLAS/CUTLASS)"),
    ("_head_norm_rope_kernel", "norm / rope"),
    ("something_else", "other"),
])
def test_kernel_group(name, group):
    assert kernel_group(name) == group

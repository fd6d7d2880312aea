"""benchmarks/gpu_kernel_profile.py's grouping of kernel symbols (the profile runs on GPU only; the grouping is
plain string logic). Symbols below are as the torch profiler reported them on an H200."""

from __future__ import annotations

import ast
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from gpu_kernel_profile import LADLE_KERNELS, kernel_group  # noqa: E402

KERNELS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "ladle", "kernels")


@pytest.mark.parametrize("name,group", [
    ("_gemm1_kernel", "fused_moe (ladle)"),
    ("_moe_align_single_kernel", "fused_moe (ladle)"),
    ("_moe_align_scatter_kernel", "fused_moe (ladle)"),  # contains "scatter": must not land in torch's group
    ("_fp8_gemm1_kernel", "fused_moe (ladle)"),  # contains "gemm": must not land in cuBLAS/CUTLASS
    ("_mxfp4_gemm2_kernel", "fused_moe (ladle)"),
    ("_fp8_gemm2_gluon_kernel", "fused_moe (ladle)"),  # the Gluon GEMM 2 (a gluon.jit kernel)
    ("_moe_combine_kernel", "fused_moe (ladle)"),
    ("_fp8_gemm_kernel", "fp8 dense gemm + act quant (ladle)"),
    ("_act_quant_kernel", "fp8 dense gemm + act quant (ladle)"),
    ("_sparse_attn_kernel", "msa attention/indexer"),
    ("_merge_kernel", "msa attention/indexer"),
    ("_decode_merge_kernel", "dense attention"),  # not the MSA merge, although it contains "_merge_kernel"
    ("_store_kernel", "kv store"),
    ("_qk_norm_rope_store_kernel", "norm / rope"),  # ends in "_store_kernel": the norm + RoPE prologue, by name
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda, "
     "at::native::memory::StoreWithCast<1> >", "torch elementwise/reduce/copy"),  # contains "store"
    ("nvjet_sm90_tst_512x32_64x3_2x1_v_bz_TNT", "gemm (cuBLAS/CUTLASS)"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_tn_align1>", "gemm (cuBLAS/CUTLASS)"),
    ("_head_norm_rope_kernel", "norm / rope"),
    ("something_else", "other"),
])
def test_kernel_group(name, group):
    assert kernel_group(name) == group


def _triton_kernel_names() -> set[str]:
    """Names of every @triton.jit function in ladle/kernels whose name ends in _kernel (launched, so profiled)."""
    names = set()
    for fname in os.listdir(KERNELS_DIR):
        if fname.endswith(".py"):
            tree = ast.parse(open(os.path.join(KERNELS_DIR, fname)).read())
            names |= {node.name for node in ast.walk(tree)
                      if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")
                      and any("jit" in ast.unparse(d) for d in node.decorator_list)}
    return names


def test_every_ladle_kernel_has_its_group_by_name():
    """A new ladle kernel must be named in LADLE_KERNELS: the substring groups would file "_fp8_gemm1_kernel" under
    cuBLAS and "_act_quant_kernel" under "other" (round 5's first FP8 profile did)."""
    named = {n for names in LADLE_KERNELS.values() for n in names}
    found = _triton_kernel_names()
    assert len(found) >= 20
    assert found - named == set()

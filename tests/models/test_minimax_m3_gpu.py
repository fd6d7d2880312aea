"""MiniMax-M3 on CUDA: the ladle.kernels path (attn_backend "triton": kv store, dense paged attention, MSA indexer,
MSA sparse attention, router, fused MoE) against the CPU float32 torch reference, and the engine with CUDA graphs.
Skipped without CUDA (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from ladle.models.checkpoint_m3 import make_checkpoint
from ladle.models.minimax_m3_paged import PagedDriver, load_m3_dir

pytestmark = pytest.mark.gpu
BLOCK = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("m3") / "tiny"), "tiny")


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def as_sets(sel: torch.Tensor) -> torch.Tensor:
    sel = sel.long().cpu()
    return torch.sort(torch.where(sel < 0, torch.full_like(sel, 1 << 30), sel), dim=-1).values


def test_kernel_path_matches_cpu_reference_fp32(ckpt):
    cpu = load_m3_dir(ckpt, torch.float32, "cpu")
    gpu = load_m3_dir(ckpt, torch.float32, "cuda")
    ids = prompt(733, 1)
    ref, ref_x = PagedDriver(cpu, 60).step([("a", ids)], record_selection=True)
    drv = PagedDriver(gpu, 60, attn_backend="triton")
    got, got_x = drv.step([("a", ids[:500])], record_selection=True)
    cos = torch.nn.functional.cosine_similarity(got.cpu(), ref[:500], dim=-1)
    assert cos.min().item() >= 0.99999
    agree = [(as_sets(got_x["msa_selected_block_ids"][i]) == as_sets(ref_x["msa_selected_block_ids"][i][:, :500]))
             .all(-1).float().mean().item() for i in (1, 2, 3)]
    assert min(agree) > 0.97, agree  # near-ties may flip; the layout itself must agree
    rest = [drv.step([("a", ids[t:t + 1])])[0] for t in range(500, 520)]  # decode across a block boundary
    rest.append(drv.prefill("a", ids[520:], chunk_size=37))  # chunked prefill, not a block multiple
    cos = torch.nn.functional.cosine_similarity(torch.cat(rest).cpu(), ref[500:], dim=-1)
    assert cos.min().item() >= 0.99999


def test_engine_with_cuda_graphs_matches_reference(ckpt):
    from ladle.core.sampling_params import SamplingParams
    from ladle.engine.llm import LLM

    prompts = [prompt(150, 2), prompt(70, 3), prompt(33, 4)]
    want = PagedDriver(load_m3_dir(ckpt, torch.float32, "cpu"), 40).greedy(dict(enumerate(prompts)), 24)
    llm = LLM(ckpt, device="cuda", dtype="float32", kv_cache_memory_bytes=64 << 20)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [want[0], want[1], want[2]]


def test_bf16_kernel_path_close_to_fp32(ckpt):
    ref = PagedDriver(load_m3_dir(ckpt, torch.float32, "cuda"), 20, attn_backend="triton").prefill("a", prompt(200, 5))
    got = PagedDriver(load_m3_dir(ckpt, torch.bfloat16, "cuda"), 20, attn_backend="triton").prefill("a", prompt(200, 5))
    cos = torch.nn.functional.cosine_similarity(got.float(), ref, dim=-1)
    assert cos.mean().item() > 0.99 and torch.isfinite(got).all()

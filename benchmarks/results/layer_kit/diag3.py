"""Capture the MoE input of layers.3 at decode step 0 (attn+moe, bf16) and test router and fused_moe in isolation."""
import sys, tempfile, torch
sys.path.insert(0, "tests"); sys.path.insert(0, "tests/models")
from test_minimax_m3_gpu_greedy import CASES, _prompts, greedy_trace, NEW_TOKENS
from ladle.layers.attention.metadata import OpBackends
from ladle.tools.checkpoint_m3 import make_checkpoint
from drivers.minimax_m3_paged import PagedDriver, load_m3_dir
from ladle.kernels.moe_router import moe_router_triton, moe_router_ref
from ladle.kernels.fused_moe import fused_moe_triton, fused_moe_ref
ckpt = make_checkpoint(tempfile.mkdtemp() + "/tiny", "tiny")
lengths, blocks = CASES["tiny"]
m = load_m3_dir(ckpt, torch.float32, "cpu")
prompts = _prompts(lengths, m.config.vocab_size)
ref, _, _, _ = greedy_trace(PagedDriver(m, blocks), prompts, NEW_TOKENS)
model = load_m3_dir(ckpt, torch.bfloat16, "cuda")
moe = model.layers[3].mlp
cap, on = [], [False]
h = moe.register_forward_hook(lambda mod, inp, out: cap.append((inp[0].detach().clone(), out.detach().clone())) if on[0] else None)
drv = PagedDriver(model, blocks, backends=OpBackends("TRITON_ATTN", "triton", False))
for s in prompts: drv.add(s)
drv.step(list(prompts.items()))
on[0] = True
drv.step([(s, [ref[s][0]]) for s in prompts])
x, y = cap[0]
print("x", x.shape, x.dtype, x.stride(), x.is_contiguous())
lg = torch.nn.functional.linear(x.float(), moe.gate_weight.float())
sc = torch.sigmoid(lg) + moe.e_score_correction_bias.float()
top = sc.topk(4, dim=-1)
print("choice scores top4 per row", [[round(v, 6) for v in r] for r in top.values.tolist()], top.indices.tolist())
print("top_k", moe.top_k)

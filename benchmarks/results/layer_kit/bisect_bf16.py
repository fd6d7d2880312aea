"""Which op family moves the bf16 M3 tiny greedy trace away from the CPU fp32 reference (device-side debug)."""
import sys, tempfile, torch
sys.path.insert(0, "tests"); sys.path.insert(0, "tests/models")
from test_minimax_m3_gpu_greedy import CASES, _prompts, greedy_trace, NEW_TOKENS
from ladle.layers.attention.metadata import OpBackends
from ladle.tools.checkpoint_m3 import make_checkpoint
from drivers.minimax_m3_paged import PagedDriver, load_m3_dir
ckpt = make_checkpoint(tempfile.mkdtemp() + "/tiny", "tiny")
lengths, blocks = CASES["tiny"]
m = load_m3_dir(ckpt, torch.float32, "cpu")
prompts = _prompts(lengths, m.config.vocab_size)
ref, _, ref5, _ = greedy_trace(PagedDriver(m, blocks), prompts, NEW_TOKENS)
combos = {"attn+norms": OpBackends("TRITON_ATTN", "torch", True), "attn+moe": OpBackends("TRITON_ATTN", "triton", False),
          "moe+norms": OpBackends("TORCH", "triton", True), "kernels": OpBackends.kernels(), "attn": OpBackends("TRITON_ATTN", "torch", False),
          "moe": OpBackends("TORCH", "triton", False), "norms": OpBackends("TORCH", "torch", True),
          "reference": OpBackends.reference()}
for dt in (torch.bfloat16,):
    for name, be in combos.items():
        got, _, got5, _ = greedy_trace(PagedDriver(load_m3_dir(ckpt, dt, "cuda"), blocks, backends=be), prompts, NEW_TOKENS)
        out = []
        for sid in ref:
            j = next((j for j, (a, b) in enumerate(zip(got[sid], ref[sid])) if a != b), None)
            if j is None: out.append(f"{sid}:same"); continue
            ok = got[sid][j] in ref5[sid][j] and ref[sid][j] in got5[sid][j]
            out.append(f"{sid}:div@{j}{'' if ok else '!TOP5'}")
        print(f"{str(dt):15s} {name:10s} " + "  ".join(out), flush=True)

"""MiniMax-M3 checkpoint name mapping (three layouts), MXFP8 dequantisation, dummy weights.

Layouts accepted (design/minimax_m3.md §1.1, §2; minimax_m3_vs_transformers.md B4):
  release          `language_model.model.layers.N.…`, `language_model.lm_head.weight`; per-expert `w1/w3/w2`;
                   `self_attn.index_{q,k}_{proj,norm}`; `block_sparse_moe.{gate.weight, e_score_correction_bias}`;
                   `block_sparse_moe.shared_experts.{gate,up,down}_proj`; dense `mlp.{gate,up,down}_proj`
  text-only        the same names under a plain `model.` prefix (third-party repacks)
  transformers     `model.layers.N.…` (MiniMaxM3VLForCausalLM) or `model.language_model.layers.N.…` (VL class,
                   save_original_format=False): `mlp.experts.gate_up_proj [E, 2I, H]` (= cat(w1, w3) on dim 1),
                   `mlp.experts.down_proj [E, H, I]`, `mlp.gate.{weight, e_score_correction_bias}`,
                   `mlp.shared_experts.gate_up_proj.weight`, `self_attn.indexer.*`, dense `mlp.gate_up_proj.weight`
Skipped (documented): vision tower, multimodal projector, patch-merge MLP, MTP modules.

MXFP8 (§2.2): `X.weight` float8_e4m3fn [N, K] + `X.weight_scale_inv` uint8 [N, K/32]; each byte is an E8M0
exponent and the dequantised value is fp8 × 2^(byte − 127) (a multiplier despite the name). Dequantised at load.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Iterable

import torch

SKIP_PREFIXES = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", "model.vision_tower.",
                 "model.multi_modal_projector.", "mtp.", "model.mtp.", "language_model.mtp.")
PREFIXES = (("language_model.model.", ""), ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", ""), ("model.", ""))


def dequant_block_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Block-scaled FP8 -> float32. weight [N, K] float8_e4m3fn; scale [sN, sK] uint8 E8M0 (2^(b-127)) or float.

    Block sizes come from the scale grid: ceil(N/sN) rows × ceil(K/sK) columns (MXFP8: 1 × 32).
    """
    n, k = weight.shape
    sn, sk = scale.shape
    mult = torch.exp2(scale.float() - 127.0) if scale.dtype == torch.uint8 else scale.float()
    bn, bk = math.ceil(n / sn), math.ceil(k / sk)
    mult = mult.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return weight.float() * mult


def quantize_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] (K % 32 == 0) -> (float8_e4m3fn [N, K], uint8 E8M0 scale [N, K/32]).

    Exponent per 32-block: the smallest e with amax / 2^e <= 448 (e4m3 max), stored as e + 127.
    """
    n, k = w.shape
    assert k % 32 == 0, f"K={k} must be a multiple of 32"
    blocks = w.float().view(n, k // 32, 32)
    amax = blocks.abs().amax(-1).clamp(min=2.0 ** -100)
    e = torch.ceil(torch.log2(amax / 448.0)).clamp(-127, 127)
    q = (blocks / torch.exp2(e)[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(n, k)
    return q, (e + 127).to(torch.uint8)


Slicer = Callable[[torch.Tensor], torch.Tensor]


class M3WeightLoader:
    """Maps checkpoint (name, tensor) pairs onto a MiniMaxM3ForCausalLM's parameters (see module doc)."""

    def __init__(self, model) -> None:
        self.model = model
        self.cfg = model.config
        self.params = dict(model.named_parameters())
        self.written: dict[str, int] = {}  # param name -> elements written
        self.pieces: set[tuple[str, str]] = set()
        self.pending_fp8: dict[str, torch.Tensor] = {}
        self.pending_scale: dict[str, torch.Tensor] = {}

    # -- name resolution -----------------------------------------------------------------------------
    def _expert_rows(self, layer: str, e: int, which: str) -> tuple[str, Slicer]:
        """Rows of w13/w2 for expert e (e == E is the folded shared expert). which in gate|up|down."""
        i = self.cfg.intermediate_size
        if which == "down":
            return f"{layer}.mlp.w2", lambda p: p[e]
        lo = 0 if which == "gate" else i
        return f"{layer}.mlp.w13", lambda p: p[e, lo:lo + i]

    def _shared(self, layer: str, which: str) -> tuple[str, Slicer]:
        if f"{layer}.mlp.shared_w13" not in self.params:  # folded: row E of the routed table
            if which == "gate_up":
                return f"{layer}.mlp.w13", lambda p: p[self.cfg.num_local_experts]
            return self._expert_rows(layer, self.cfg.num_local_experts, which)
        if which == "down":
            return f"{layer}.mlp.shared_w2", lambda p: p
        si = self.cfg.shared_intermediate_size
        sl = {"gate_up": slice(0, 2 * si), "gate": slice(0, si), "up": slice(si, 2 * si)}[which]
        return f"{layer}.mlp.shared_w13", lambda p: p[sl]

    def _qkv_rows(self, layer_idx: str, shard: str) -> tuple[str, str, Slicer]:
        """Rows of layer `layer_idx`'s merged q/k/v(/iq/ik) projection that hold checkpoint piece `shard`."""
        pname = f"layers.{layer_idx}.self_attn.qkv_proj.weight"
        offsets = self.model.layers[int(layer_idx)].self_attn.qkv_proj.shard_offsets if pname in self.params else {}
        if shard not in offsets:
            raise ValueError(f"layer {layer_idx} has no {shard!r} projection (is the layer sparse?)")
        lo, n = offsets[shard]
        return pname, shard, lambda p: p[lo:lo + n]

    def resolve(self, name: str) -> tuple[str, str, Slicer] | None:
        """Checkpoint name -> (param name, piece key, slicer) or None (skipped). Raises ValueError if unknown."""
        if name.startswith(SKIP_PREFIXES):
            return None
        n = name
        for pre, repl in PREFIXES:
            if n.startswith(pre):
                n = repl + n[len(pre):]
                break
        whole = lambda p: p  # noqa: E731
        if n in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
            return n, "all", whole
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", n)
        if not m:
            raise ValueError(f"unknown MiniMax-M3 checkpoint tensor {name!r}")
        layer, rest = f"layers.{m.group(1)}", m.group(2)
        simple = {
            "input_layernorm.weight": "input_layernorm.weight",
            "post_attention_layernorm.weight": "post_attention_layernorm.weight",
            "block_sparse_moe.gate.weight": "mlp.gate_weight", "mlp.gate.weight": "mlp.gate_weight",
            "block_sparse_moe.e_score_correction_bias": "mlp.e_score_correction_bias",
            "mlp.gate.e_score_correction_bias": "mlp.e_score_correction_bias",
            "mlp.gate_up_proj.weight": "mlp.gate_up_proj", "mlp.down_proj.weight": "mlp.down_proj",
        }
        if rest in simple:
            return f"{layer}.{simple[rest]}", "all", whole
        if re.fullmatch(r"self_attn\.o_proj\.weight|self_attn\.(q|k)_norm\.weight", rest):
            return f"{layer}.{rest}", "all", whole
        if mm := re.fullmatch(r"self_attn\.(q|k|v)_proj\.weight", rest):
            return self._qkv_rows(m.group(1), mm.group(1))
        if mm := re.fullmatch(r"self_attn\.(?:index_|indexer\.)(q|k)_proj\.weight", rest):
            return self._qkv_rows(m.group(1), "i" + mm.group(1))
        if mm := re.fullmatch(r"self_attn\.(?:index_|indexer\.)(q|k)_norm\.weight", rest):
            return f"{layer}.self_attn.indexer.{mm.group(1)}_norm.weight", "all", whole
        if mm := re.fullmatch(r"block_sparse_moe\.experts\.(\d+)\.w([123])\.weight", rest):
            e = int(mm.group(1))
            if e >= self.cfg.num_local_experts:
                raise ValueError(f"{name!r}: expert {e} >= num_local_experts {self.cfg.num_local_experts}")
            which = {"1": "gate", "3": "up", "2": "down"}[mm.group(2)]
            p, sl = self._expert_rows(layer, e, which)
            return p, f"{which}{e}", sl
        e_all = self.cfg.num_local_experts
        if rest == "mlp.experts.gate_up_proj":
            return f"{layer}.mlp.w13", "gate_up_all", lambda p: p[:e_all]
        if rest == "mlp.experts.down_proj":
            return f"{layer}.mlp.w2", "down_all", lambda p: p[:e_all]
        if mm := re.fullmatch(r"(?:block_sparse_moe|mlp)\.shared_experts\.(gate_up|gate|up|down)_proj\.weight", rest):
            p, sl = self._shared(layer, mm.group(1))
            return p, f"shared_{mm.group(1)}", sl
        if mm := re.fullmatch(r"mlp\.(gate|up)_proj\.weight", rest):
            inter = self.cfg.dense_intermediate_size
            lo = 0 if mm.group(1) == "gate" else inter
            return f"{layer}.mlp.gate_up_proj", mm.group(1), lambda p: p[lo:lo + inter]
        raise ValueError(f"unknown MiniMax-M3 checkpoint tensor {name!r}")

    # -- copying -------------------------------------------------------------------------------------
    def _copy(self, name: str, tensor: torch.Tensor) -> None:
        target = self.resolve(name)
        if target is None:
            return
        pname, piece, slicer = target
        if pname not in self.params:
            raise ValueError(f"checkpoint tensor {name!r} maps to {pname!r}, which this config does not have")
        if (pname, piece) in self.pieces:
            raise ValueError(f"checkpoint tensor {name!r} written twice into {pname!r} ({piece})")
        dst = slicer(self.params[pname].data)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"{name!r}: shape {tuple(tensor.shape)} != expected {tuple(dst.shape)} for {pname}")
        with torch.no_grad():
            dst.copy_(tensor.to(dst.dtype))
        self.pieces.add((pname, piece))
        self.written[pname] = self.written.get(pname, 0) + dst.numel()

    def feed(self, name: str, tensor: torch.Tensor) -> None:
        if name.endswith(".weight_scale_inv"):
            base = name[: -len("_scale_inv")]
            if base in self.pending_fp8:
                self._copy(base, dequant_block_fp8(self.pending_fp8.pop(base), tensor))
            else:
                self.pending_scale[base] = tensor
        elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if name in self.pending_scale:
                self._copy(name, dequant_block_fp8(tensor, self.pending_scale.pop(name)))
            else:
                self.pending_fp8[name] = tensor
        else:
            self._copy(name, tensor)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            self.feed(name, tensor)
        if self.pending_fp8 or self.pending_scale:
            orphans = sorted(self.pending_fp8)[:3] + sorted(self.pending_scale)[:3]
            raise ValueError(f"FP8 weights without scales (or scales without weights), e.g. {orphans}")
        return {p for p, n in self.written.items() if n == self.params[p].numel()}


@torch.no_grad()
def init_dummy(model, seed: int) -> None:
    """Small uniform random weights that keep a deep stack finite: matrices ±1/sqrt(fan_in), embeddings ±1,
    norm offsets and the routing bias ±0.1 (so (1 + w) stays near 1)."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.rand(p.shape, generator=gen, device=p.device, dtype=torch.float32) * 2 - 1
        if p.dim() == 1:
            r *= 0.1
        elif "embed_tokens" not in name:
            r /= math.sqrt(p.shape[-1])
        p.data.copy_(r.to(p.dtype))

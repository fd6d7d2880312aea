"""MXFP4 experts (4-bit weights; W4A16 or W4A8) for FusedMoE: the quant method of MXFP4 checkpoints.

Checkpoint (written by `ladle make-checkpoint minimax-m3 --dtype mxfp4`; design/minimax_m3.md §2.3): every expert
projection — routed w1/w3/w2 and the shared expert's gate/up/down — as `X.weight` uint8 [N, K/2] (two E2M1 codes
per byte, low nibble = even element) + `X.weight_scale` uint8 [N, K/32] (E8M0); `quantization_config
{"quant_method": "mxfp4", "weight_block_size": [1, 32]}`. Attention, dense MLPs, router, embeddings and lm_head
stay in the model dtype (like the Quark release's exclude list), or FP8 with `--quantization fp8`.
The third-party releases' names (compressed-tensors `weight_packed`, Quark's unconfirmed suffixes) are not read yet.

Parameters (kept as stored, re-laid only by the usual row / tensor-parallel slicing): `w13` uint8 [E', 2 I_r, H/2],
`w13_scale_inv` uint8 [E', 2 I_r, H/32], `w2` uint8 [E', H, I_r/2], `w2_scale_inv` uint8 [E', H, I_r/32]; run by op
`fused_moe_mxfp4` (dequantised inside the K loop), with activations in the model dtype (W4A16) or, when
`Mxfp4Config.activation_dtype` is "fp8" (ladle's `quantization_config.activation_dtype`, ladle/quant/config.py), FP8
per token per 128-group (W4A8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ladle.kernels.fp8_quant import MX_GROUP, quantize_mxfp4
from ladle.kernels.fused_moe import into
from ladle.kernels.fused_moe_mxfp4 import fused_moe_mxfp4
from ladle.layers.linear import set_weight_loader
from ladle.quant.fp8 import Fp8Config, Fp8LinearMethod, _param
from ladle.quant.fp8_moe import Fp8FusedMoEMethod, _moe_scale_loader, register_expert_table


@dataclass(frozen=True)
class Mxfp4Config:
    """MXFP4 experts; linears unquantized, or FP8 quantized at load when linear_fp8 (`--quantization fp8`)."""

    linear_fp8: bool = False
    activation_dtype: Optional[str] = None  # experts' activations: None = model dtype (W4A16), "fp8" (W4A8)

    @property
    def format_name(self) -> str:
        """The weight format in effect, as /version names it (ladle/quant/config.py `quantization_in_effect`)."""
        experts = "mxfp4-w4a8" if self.activation_dtype == "fp8" else "mxfp4"  # FP8 activations into the experts
        return f"{experts}+fp8" if self.linear_fp8 else experts

    def linear_method(self, layer_kind: str) -> Optional[Fp8LinearMethod]:
        return Fp8LinearMethod(Fp8Config()) if self.linear_fp8 else None

    def moe_method(self) -> "Mxfp4FusedMoEMethod":
        return Mxfp4FusedMoEMethod(self)


def _quantize_table(w: nn.Parameter, s: nn.Parameter, values: torch.Tensor) -> None:
    """Dummy weights: float [E', N, K] -> MXFP4 into w / s, expert by expert."""
    for e in range(values.shape[0]):
        packed, scale = quantize_mxfp4(values[e].to(w.device))
        w.data[e].copy_(packed)
        s.data[e].copy_(scale)


class Mxfp4FusedMoEMethod(Fp8FusedMoEMethod):
    """FusedMoE quant method with MXFP4 expert tables (module doc), run by op `fused_moe_mxfp4`: W4A16, or W4A8 when
    the config's activation_dtype is "fp8"."""

    def __init__(self, config: Mxfp4Config = Mxfp4Config()) -> None:
        self.config = config

    def run_experts(self, *args, use_triton: bool, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Op `fused_moe_mxfp4` on `apply`'s arguments (Fp8FusedMoEMethod.run_experts), W4A8 when configured;
        copied into `out` when given."""
        return into(out, fused_moe_mxfp4(*args, use_triton=use_triton,
                                         fp8_activations=self.config.activation_dtype == "fp8"))

    def create_weights(self, layer: nn.Module, num_rows: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: Optional[torch.dtype], device, weight_loader) -> None:
        i_r, h = intermediate_size_per_partition, hidden_size
        if h % MX_GROUP or i_r % MX_GROUP:
            raise ValueError(f"MXFP4 experts need H and I per rank divisible by 32, got {h}, {i_r}")
        for name, (rows, k) in (("w13", (2 * i_r, h)), ("w2", (h, i_r))):
            weight = set_weight_loader(_param((num_rows, rows, k // 2), torch.uint8, device),
                                       _moe_scale_loader(layer, 2), 1)
            scale = set_weight_loader(_param((num_rows, rows, k // MX_GROUP), torch.uint8, device),
                                      _moe_scale_loader(layer, MX_GROUP), 1)
            weight.dummy_shape = (num_rows, rows, k)
            register_expert_table(layer, name, weight, scale,
                                  (lambda w, s: lambda values: _quantize_table(w, s, values))(weight, scale))

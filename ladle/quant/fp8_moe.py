"""FP8 w8a8 block-scaled experts for FusedMoE (the MoE half of ladle/quant/fp8.py; same storage and loading rules).

Parameters: `w13` float8_e4m3fn [E', 2 I_r, H] + `w13_scale_inv` float32 [E', 2 I_r, ceil(H/128)]; `w2` fp8
[E', H, I_r] + `w2_scale_inv` float32 [E', H, ceil(I_r/128)] (one scale per row per 128-group of K); MXFP8: uint8
E8M0 scales per 32 K elements ([E', 2 I_r, H/32], [E', H, I_r/32]), as released. The shared
expert is row E when folded, exactly as in the unquantized method. Checkpoint names `…w1.weight_scale_inv` map to
`w13_scale_inv` through the model's name table (ladle/models/weights.py appends the suffix).
"""

from __future__ import annotations

from typing import Hashable, Optional

import torch
from torch import nn

from ladle.kernels.fp8_quant import FP8_DTYPE, GROUP
from ladle.kernels.fused_moe_fp8 import block_scales_uniform, fused_moe_fp8
from ladle.layers.linear import set_weight_loader
from ladle.quant.fp8 import Fp8Config, _param, _quantize_into, expand_scale_rows, staged_loader


class Fp8FusedMoEMethod:
    """FusedMoE quant method with FP8 block-scaled expert tables, run by op `fused_moe_fp8`."""

    def __init__(self, config: Fp8Config = Fp8Config()) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, num_rows: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: Optional[torch.dtype], device, weight_loader) -> None:
        i_r, h = intermediate_size_per_partition, hidden_size
        group, scale_dtype = self.config.scale_format()
        for name, shape in (("w13", (num_rows, 2 * i_r, h)), ("w2", (num_rows, h, i_r))):
            weight = set_weight_loader(_param(shape, FP8_DTYPE, device), weight_loader, 1)
            scale = _param((*shape[:2], -(-shape[2] // group)), scale_dtype, device)
            set_weight_loader(scale, _moe_scale_loader(layer, group), 1)
            if not self.config.from_checkpoint:
                weight.weight_loader = staged_loader(weight_loader, weight, scale, params_dtype or torch.float32)
                weight.load_dtype = params_dtype or torch.float32
                scale.derived_from = name
            init = (lambda w, s: lambda v: _quantize_into(w, s, v, self.config.mx))(weight, scale)
            register_expert_table(layer, name, weight, scale, init)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              use_triton: bool, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, H], topk_ids / topk_weights [T, k] -> [T, H] in x.dtype: the layer's tables (`w13`, `w13_scale_inv`,
        `w2`, `w2_scale_inv`) and SwiGLU-OAI constants into the format's op, `run_experts` (the one part
        Mxfp4FusedMoEMethod overrides). out: [T, H] contiguous to write and return (FusedMoE's chunk rows)."""
        return self.run_experts(x, layer.w13, layer.w13_scale_inv, layer.w2, layer.w2_scale_inv, topk_ids,
                                topk_weights, layer.swiglu_alpha, layer.swiglu_limit, use_triton=use_triton, out=out)

    def run_experts(self, *args, use_triton: bool, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Op `fused_moe_fp8` on `apply`'s arguments (x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights,
        alpha, limit), with block_uniform = `block_scales_uniform` of this layer's scale tables (checked at the
        first call and kept on the w13 scale parameter: the runner's first forward is eager, before any CUDA-graph
        capture; a capture that comes first runs the per-row path and checks later)."""
        w13_scale, w2_scale = args[2], args[4]
        uniform = getattr(w13_scale, "block_uniform", None)
        if uniform is None:
            if w13_scale.is_cuda and torch.cuda.is_current_stream_capturing():
                uniform = False
            else:
                uniform = w13_scale.block_uniform = block_scales_uniform(w13_scale, w2_scale)
        return fused_moe_fp8(*args, use_triton=use_triton, block_uniform=uniform, out=out)


def register_expert_table(layer: nn.Module, name: str, weight: nn.Parameter, scale: nn.Parameter, init) -> None:
    """Register `name` and `name_scale_inv` on the FusedMoE; dummy weights reach both through `init(values)`."""
    weight.init_from_float = init
    scale.init_from_float = None
    layer.register_parameter(name, weight)
    layer.register_parameter(f"{name}_scale_inv", scale)


def _moe_scale_loader(layer: nn.Module, group: int):
    """Loader of one checkpoint expert scale grid (HF block FP8: [ceil(rows/128), ceil(K/128)]): rows expanded,
    then this rank's slice as FusedMoE.weight_loader slices the weight (w1/w3: rows of the intermediate; w2: K
    groups of the intermediate, which must start on a 128 boundary)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None, expert_id=None) -> int:
        if expert_id is None:
            return sum(load(param, loaded[e], shard_id, e) for e in range(layer.num_experts))
        row = layer._expert_row(expert_id)
        i, i_r, h = layer.intermediate_size, layer.intermediate_size_per_partition, layer.hidden_size
        start = layer.tp_rank * i_r
        if shard_id == "w13":
            gate, up = loaded.split(loaded.shape[0] // 2, dim=0)
            if loaded.shape[0] % 2 or (loaded.shape[0] != 2 * i and i % GROUP):
                raise ValueError(f"a merged gate|up scale grid {tuple(loaded.shape)} does not split at I = {i}")
            return load(param, gate, "w1", expert_id) + load(param, up, "w3", expert_id)
        if shard_id in ("w1", "w3"):
            dst = param.data[row].narrow(0, 0 if shard_id == "w1" else i_r, i_r)
            dst.copy_(expand_scale_rows(loaded, i).narrow(0, start, i_r))
        elif shard_id == "w2":
            if start % group:
                raise ValueError(f"tensor-parallel K slice at {start} is not on a {group}-group boundary")
            dst = param.data[row]
            dst.copy_(expand_scale_rows(loaded, h).narrow(1, start // group, dst.shape[1]))
        else:
            raise ValueError(f"unknown expert shard {shard_id!r} (w1, w3, w13, w2)")
        return dst.numel()

    return load

"""FP8 w8a8 block-scaled compute: the quant methods of the layer kit's `quant_method` slot.

Storage of every FP8 weight (the kernels' layout, ladle/kernels/fp8_gemm.py): `X` float8_e4m3fn [rows, K] and
`X_scale_inv` float32 [rows, ceil(K/128)] — one multiplier per output row per 128-wide K group (a 128x128 block
scale repeated over its rows). `X_scale_inv` keeps the HF block-FP8 name (`weight_scale_inv`), a multiplier.
A linear's float32 `weight_scale_inv` is stored N-minor (strides (1, rows): the transpose of a contiguous
[ceil(K/128), rows] tensor), so its transpose is the contiguous scale_b torch._scaled_mm reads without a per-call
copy. Shape and values are the row-major ones; every loader writes it through copy_. MXFP8 and MoE scales are
row-major.

Two ways in (`Fp8Config.from_checkpoint`):
  mxfp8       the MiniMax-M3 MXFP8 release (design/minimax_m3.md §2.2): weights and uint8 E8M0 [N, K/32] scales kept
              byte for byte (already one scale per row); the kernels step K by 32 (ladle/kernels/fp8_gemm.py).
  checkpoint  the HF block-FP8 format (`quantization_config.quant_method = "fp8"`, `weight_block_size [128, 128]`):
              `X.weight` fp8 [N, K] goes to the layer's own loader unchanged; `X.weight_scale_inv` [ceil(N/128),
              ceil(K/128)] is expanded to rows, then sliced like the weight (`_scale_loader`).
  online      `--quantization fp8` (vLLM's flag): the checkpoint (or dummy) weights are float; each layer's weight
              is staged in the model dtype until every piece of it arrived, then quantized per 128x128 block and
              the staging buffer dropped — one layer at a time, never a whole-model high-precision copy.
Dummy weights (`--load-format dummy`) reach either kind through `param.init_from_float(values)`.

Loading protocol additions read by ladle/models/weights.py: `param.load_dtype` (cast the checkpoint tensor to it,
not to param.dtype), `param.derived_from` (this parameter is filled when the named sibling is: online scales),
`param.init_from_float` (dummy initialisation from float values of the parameter's shape).
Which path runs (Triton or the torch reference) follows `OpBackends.triton_moe` (`--moe-backend`): OpBackends has
no field for linears, and the FP8 GEMMs are grouped with the MoE kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Optional

import torch
from torch import nn

from ladle.kernels.fp8_gemm import fp8_linear
from ladle.kernels.fp8_quant import FP8_DTYPE, GROUP, MX_GROUP, quantize_fp8_rows, quantize_mxfp8
from ladle.layers.backends import op_backends
from ladle.layers.linear import set_weight_loader


@dataclass(frozen=True)
class Fp8Config:
    """from_checkpoint: True = the checkpoint stores FP8 weights and scales; False = quantize float weights at
    load (`--quantization fp8`). A config for `ladle.layers.quant_slot.quant_config_scope`."""

    from_checkpoint: bool = False
    mx: bool = False  # MXFP8 checkpoint: uint8 E8M0 scales per 32 K elements, kept as stored

    def __post_init__(self) -> None:
        assert self.from_checkpoint or not self.mx, "MXFP8 comes from a checkpoint only"

    @property
    def format_name(self) -> str:
        """The weight format in effect, as /version names it (ladle/quant/config.py `quantization_in_effect`)."""
        return "fp8"

    def scale_format(self) -> tuple[int, torch.dtype]:
        """(K elements per weight scale, scale dtype) of this config's weights."""
        return (MX_GROUP, torch.uint8) if self.mx else (GROUP, torch.float32)

    def linear_method(self, layer_kind: str) -> "Fp8LinearMethod":
        return Fp8LinearMethod(self)

    def moe_method(self):
        from ladle.quant.fp8_moe import Fp8FusedMoEMethod  # the MoE half lives in its own file

        return Fp8FusedMoEMethod(self)


def _param(shape: tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _n_minor_param(rows: int, cols: int, dtype: torch.dtype, device) -> nn.Parameter:
    """[rows, cols] parameter with strides (1, rows) (a transposed view of a contiguous [cols, rows] tensor): `.t()`
    is contiguous, the scale_b layout torch._scaled_mm takes without a per-call transpose copy (fp8_gemm.py)."""
    return nn.Parameter(torch.empty(cols, rows, dtype=dtype, device=device).t(), requires_grad=False)


def _quantize_into(w_q: nn.Parameter, scale: nn.Parameter, values: torch.Tensor, mx: bool = False) -> None:
    """Quantize float `values` (w_q's shape) per 128x128 block (mx: MXFP8 1x32 E8M0) into w_q / scale (per
    expert for a 3-D table)."""
    values = values.to(device=w_q.device)
    if mx:
        pairs = [quantize_mxfp8(v) for v in values.reshape(-1, *values.shape[-2:])]
        w_q.data.copy_(torch.stack([q for q, _ in pairs]).view(w_q.shape))
        scale.data.copy_(torch.stack([s for _, s in pairs]).view(scale.shape))
        return
    q, s = quantize_fp8_rows(values)
    w_q.data.copy_(q)
    scale.data.copy_(s)


def staged_loader(layer_loader: Callable, w_q: nn.Parameter, scale: nn.Parameter, stage_dtype: torch.dtype) -> Callable:
    """Online quantization: a weight_loader that lets the layer's own `layer_loader` slice each checkpoint piece
    into a staging tensor of w_q's shape in `stage_dtype` (allocated at the first piece), and quantizes it into
    w_q / scale once every element arrived (then frees it). Returns the elements written, like any loader."""
    state = {"stage": None, "written": 0}

    def load(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None, **kw) -> int:
        if state["stage"] is None:
            stage = _param(tuple(w_q.shape), stage_dtype, w_q.device)
            stage.shard_dim = w_q.shard_dim
            state["stage"] = stage
        n = layer_loader(state["stage"], loaded_weight, shard_id, **kw)
        state["written"] += n
        if state["written"] >= w_q.numel():
            _quantize_into(w_q, scale, state["stage"].data)
            state["stage"], state["written"] = None, 0
        return n

    return load


def expand_scale_rows(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint block-scale grid [ceil(rows/128), sK] -> [rows, sK] (each block's scale on its 128 rows);
    a grid that already has `rows` rows is returned as is."""
    if scale.shape[0] == rows:
        return scale
    if scale.shape[0] != -(-rows // GROUP):
        raise ValueError(f"scale grid {tuple(scale.shape)} does not tile {rows} rows in 128-row blocks")
    return scale.repeat_interleave(GROUP, dim=0)[:rows]


class Fp8LinearMethod:
    """Block-FP8 weights for ColumnParallelLinear / RowParallelLinear (module doc); y = fp8_linear(x, W)."""

    def __init__(self, config: Fp8Config = Fp8Config()) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype, device, weight_loader, shard_dim: Optional[int]) -> None:
        """Register `layer.weight` fp8 [N, K] and `layer.weight_scale_inv` fp32 [N, ceil(K/128)] with strides
        (1, N) (module doc; MXFP8: uint8 [N, K/32], contiguous)."""
        n, k = sum(output_partition_sizes), input_size_per_partition
        group, scale_dtype = self.config.scale_format()
        weight = _param((n, k), FP8_DTYPE, device)
        if scale_dtype == torch.float32:
            scale = _n_minor_param(n, -(-k // group), scale_dtype, device)
        else:
            scale = _param((n, -(-k // group)), scale_dtype, device)
        set_weight_loader(weight, weight_loader, shard_dim)
        set_weight_loader(scale, _scale_loader(layer, weight_loader, shard_dim, group), shard_dim)
        if not self.config.from_checkpoint:
            weight.weight_loader = staged_loader(weight_loader, weight, scale, params_dtype or torch.float32)
            weight.load_dtype = params_dtype or torch.float32
            scale.derived_from = "weight"
        weight.init_from_float = lambda values: _quantize_into(weight, scale, values, self.config.mx)
        scale.init_from_float = None  # filled with the weight
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale_inv", scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., K] float -> [..., N] in x.dtype (activations quantized per token per 128-group)."""
        return fp8_linear(x, layer.weight, layer.weight_scale_inv, bias, use_triton=op_backends().triton_moe)


def _scale_loader(layer: nn.Module, weight_loader: Callable, shard_dim: Optional[int], group: int) -> Callable:
    """Loader of a checkpoint `weight_scale_inv` [ceil(rows/128), ceil(K/128)]: rows expanded, then this rank's
    rows (column-parallel: the layer's own loader, shard by shard) or 128-groups of K (row-parallel; the rank's K
    slice must start on a 128 boundary, else ValueError)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None) -> int:
        if shard_dim == 0:
            if shard_id is None and list(layer.shards) != [None]:
                return sum(load(param, p, sid) for sid, p in zip(layer.shards, _split_grid(layer, loaded)))
            if shard_id not in layer.shards:
                raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(layer.shards)}")
            return weight_loader(param, expand_scale_rows(loaded, layer.shards[shard_id].full_rows), shard_id)
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear has no shard {shard_id!r}")
        start = layer.tp_rank * layer.input_size_per_partition
        if start % group:
            raise ValueError(f"tensor-parallel K slice at {start} is not on a {group}-group boundary")
        full = expand_scale_rows(loaded, layer.output_size)
        param.data.copy_(full.narrow(1, start // group, param.shape[1]))
        return param.numel()

    return load


def _split_grid(layer: nn.Module, loaded: torch.Tensor) -> list[torch.Tensor]:
    """A merged checkpoint scale (pieces concatenated, each on whole 128-row blocks) -> per-shard grids."""
    sizes = [-(-s.full_rows // GROUP) for s in layer.shards.values()]
    if loaded.shape[0] != sum(sizes):
        raise ValueError(f"merged scale grid {tuple(loaded.shape)} != {sum(sizes)} row blocks")
    return list(loaded.split(sizes, dim=0))

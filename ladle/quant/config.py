"""Which quantization a model is built with: the checkpoint's `quantization_config` and `--quantization`.

  checkpoint quant_method "fp8" with weight_block_size [128, 128] (HF block FP8: DeepSeek-V3, Qwen3-FP8)
      -> Fp8Config(from_checkpoint=True): FP8 weights and scales kept as stored (rows expanded).
  checkpoint "mxfp8" (MiniMax-M3-MXFP8, design/minimax_m3.md §2.2) -> Fp8Config(from_checkpoint=True, mx=True):
      the release's fp8 values and E8M0 scales kept byte for byte (the kernels read 32-groups); --quantization fp8
      changes nothing for it.
  checkpoint "mxfp4" (ladle's MXFP4-experts layout, ladle/quant/mxfp4.py) -> Mxfp4Config: experts MXFP4 as stored,
      linears in the model dtype, or FP8 quantized at load with --quantization fp8; expert activations in the model
      dtype (W4A16), or FP8 with ladle's `quantization_config.activation_dtype: "fp8"` (W4A8; `mxfp4_activation_dtype`).
  --quantization fp8 on a float checkpoint (or --load-format dummy) -> Fp8Config(from_checkpoint=False).
Anything else raises ValueError with the supported values.
A quantized checkpoint always loads in its own format: ladle has no option to build a bf16 model from FP8 / MXFP8 /
MXFP4 weights (every model is built in this config's scope by ladle/models/loader.py, and every quantized pair goes
to its quant method's weight loader; there is no dequantise-at-load path).
"""

from __future__ import annotations

from typing import Optional

from ladle.config import ModelConfig
from ladle.quant.fp8 import Fp8Config
from ladle.quant.mxfp4 import Mxfp4Config

QUANTIZATIONS = ("fp8",)  # what --quantization quantizes to at load
CHECKPOINT_METHODS = ("fp8", "mxfp8", "mxfp4")  # checkpoint quant_method values ladle reads


def _quantization_config(hf_config: dict) -> dict:
    """`quantization_config` of the root config (or of its text config), {} when absent."""
    return hf_config.get("quantization_config") or (hf_config.get("text_config") or {}).get("quantization_config") or {}


def mxfp4_activation_dtype(hf_config: dict) -> Optional[str]:
    """Activations of MXFP4 experts: None = the model dtype (W4A16), "fp8" = e4m3 per token per 128-group (W4A8).
    Read from ladle's `quantization_config.activation_dtype` key (no vLLM flag chooses this; set it with
    `--hf-overrides '{"quantization_config": {"activation_dtype": "fp8"}}'`). Raises ValueError for another value,
    or for the key on a checkpoint that has no MXFP4 experts."""
    qc = _quantization_config(hf_config)
    value = qc.get("activation_dtype")
    if value is None:
        return None
    if qc.get("quant_method") != "mxfp4":
        raise ValueError(f"quantization_config.activation_dtype {value!r}: it chooses the activations of MXFP4 "
                         f"experts, and this checkpoint's quant_method is {qc.get('quant_method')!r}")
    if value not in ("fp8",):
        raise ValueError(f"quantization_config.activation_dtype {value!r}: MXFP4 experts take fp8 (W4A8) or, "
                         "without the key, the model dtype (W4A16)")
    return value


def checkpoint_quant_method(hf_config: dict) -> Optional[str]:
    """`quantization_config.quant_method` of the root config (or of its text config), lower-case, or None."""
    qc = _quantization_config(hf_config)
    method = qc.get("quant_method")
    if method in ("mxfp8", "mxfp4") and list(qc.get("weight_block_size") or [1, 32]) != [1, 32]:
        raise ValueError(f"{method} checkpoint with quantization_config.weight_block_size "
                         f"{qc.get('weight_block_size')}; expected [1, 32]")
    if method == "fp8" and list(qc.get("weight_block_size") or []) != [128, 128]:
        raise ValueError(f"FP8 checkpoint with quantization_config.weight_block_size {qc.get('weight_block_size')}: "
                         "ladle reads [128, 128] block scales only")
    return None if method is None else str(method).lower()


def check_quantization(flag: Optional[str], hf_config: Optional[dict]) -> Optional[str]:
    """Validate `--quantization` against the checkpoint (hf_config None: the flag alone) before anything loads.
    Returns the checkpoint's quant_method (None: float weights). Accepted: no flag (the checkpoint's own format),
    "fp8" (quantize the float weights at load: all of them, or the linears of an MXFP4-experts checkpoint; a no-op
    for FP8 / MXFP8 checkpoints, already FP8), or the checkpoint's own quant_method (vLLM accepts that too).
    Raises ValueError naming what ladle offers for any other value, for a checkpoint format ladle does not read,
    and for --quantization fp8 over such a checkpoint."""
    offer = ("ladle offers fp8 (quantize float weights to FP8 E4M3 with 128x128 block scales at load), or leave "
             "--quantization out (the checkpoint's own format)")
    method = None if hf_config is None else checkpoint_quant_method(hf_config)
    if hf_config is not None:
        mxfp4_activation_dtype(hf_config)
    if method is not None and method not in CHECKPOINT_METHODS:
        why = "" if flag is None else f"; --quantization {flag} cannot re-quantize an already quantized checkpoint"
        raise ValueError(f"checkpoint quant_method {method!r} is not a format ladle reads (it reads "
                         f"{', '.join(CHECKPOINT_METHODS)}){why}")
    if flag is None or flag in QUANTIZATIONS or (flag == method and method is not None):
        return method
    if flag in CHECKPOINT_METHODS and hf_config is None:
        return None  # a checkpoint's own format: checked against the checkpoint once it is read
    what = (f"a checkpoint format ladle reads but does not quantize to, and this checkpoint is "
            f"{method or 'not quantized'}" if flag in CHECKPOINT_METHODS else "not a quantization ladle offers")
    raise ValueError(f"--quantization {flag}: {what}; {offer}")


def quant_config_of(model_config: ModelConfig, hf_config: dict) -> "Fp8Config | Mxfp4Config | None":
    """The quant config to build the model with (module doc), None for an unquantized model. Raises ValueError as
    `check_quantization` does."""
    flag = model_config.quantization
    method = check_quantization(flag, hf_config)
    if method == "fp8":
        return Fp8Config(from_checkpoint=True)
    if method == "mxfp8":
        return Fp8Config(from_checkpoint=True, mx=True)
    if method == "mxfp4":
        return Mxfp4Config(linear_fp8=flag == "fp8", activation_dtype=mxfp4_activation_dtype(hf_config))
    return Fp8Config(from_checkpoint=False) if flag == "fp8" else None


def quantization_in_effect(model_config: ModelConfig, hf_config: dict) -> Optional[str]:
    """The weight format the model is built with, as /version reports it: "fp8" (HF block FP8, MXFP8 or
    --quantization fp8: FP8 E4M3 weights and w8a8 GEMMs), "mxfp4" (MXFP4 experts, float linears), "mxfp4+fp8"
    (MXFP4 experts, FP8 linears), with "-w4a8" after "mxfp4" when the experts take FP8 activations (ladle's
    quantization_config.activation_dtype "fp8"), None (float weights). Raises ValueError as `check_quantization` does."""
    config = quant_config_of(model_config, hf_config)
    return None if config is None else config.format_name

"""Helpers shared by the kernel launchers: the one guarded `import triton`, where Triton may run, dispatch
recording, cache-shape checks, small launch facts (SM count, tl.dot precision, log2(e)), the bucket rule of the
tile tables (`MAX_TOKENS`, `tile_row`) and the in-kernel rounding to a storage dtype (`round_to`).

Kernel modules take `triton` and `tl` from here. On an install without Triton (the package marks it Linux-only)
they are `_NoTriton` stand-ins: `@triton.jit` returns the function unchanged, so every op module still imports and
its torch reference runs; no kernel launches, because `triton_ok` then reports "triton not installed".
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence, TypeVar

import torch

from ladle.config import env_flag
from ladle.observe import dispatch


class _NoTriton:
    """Import-time stand-in for `triton` and `triton.language` (see module docstring); never launched."""

    def jit(self, fn: Any = None, **_kwargs: Any) -> Any:
        return fn if fn is not None else (lambda f: f)

    def __getattr__(self, name: str) -> "_NoTriton":
        return self

    def __call__(self, *args: Any, **_kwargs: Any) -> Any:
        """A module-level `tl.constexpr(value)` keeps its value (kernels are never launched without Triton)."""
        return args[0] if args else self


try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised by tests/kernels/test_kv_store.py in a subprocess
    triton = tl = _NoTriton()  # type: ignore[assignment]
    HAS_TRITON = False

LOG2E = 1.4426950408889634  # log2(e): softmax in base 2 folds it into the scale


def interpreting() -> bool:
    """True when Triton runs under its CPU interpreter (TRITON_INTERPRET=1; set by tests/conftest.py on CPU CI)."""
    return env_flag("TRITON_INTERPRET", "0") not in ("", "0")


_CPU_INTERPRETER_ALLOWED = [True]


@contextlib.contextmanager
def cpu_interpreter(allowed: bool = True) -> Iterator[None]:
    """Inside this block, CPU tensors may (allowed=True) or may not (False) run Triton kernels under
    TRITON_INTERPRET=1. Default outside any block: allowed. tests/conftest.py sets TRITON_INTERPRET=1 for the
    whole CPU pytest process, so CPU code that wants the fast torch references (e.g. a whole-model CPU test) can
    wrap itself in `cpu_interpreter(False)`; the runner's OpBackends.reference() on CPU already avoids kernels."""
    _CPU_INTERPRETER_ALLOWED.append(allowed)
    try:
        yield
    finally:
        _CPU_INTERPRETER_ALLOWED.pop()


def triton_ok(*tensors: torch.Tensor) -> Optional[str]:
    """Device part of every Triton eligibility rule: all tensors on one CUDA device, or all on the CPU while the
    Triton interpreter is on and allowed (`cpu_interpreter`). Returns None when eligible, else the reason."""
    if not HAS_TRITON:
        return "triton not installed"
    devices = {t.device.type for t in tensors}
    if devices == {"cuda"}:
        return None
    if devices == {"cpu"} and interpreting() and _CPU_INTERPRETER_ALLOWED[-1]:
        return None
    return f"device {sorted(devices)} (needs cuda, or cpu with TRITON_INTERPRET=1 and cpu_interpreter allowed)"


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Assert the fixed KV layout: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, K and V alike."""
    assert key_cache.dim() == 4, f"key_cache must be [num_blocks, block_size, Hkv, D], got {tuple(key_cache.shape)}"
    assert key_cache.shape == value_cache.shape, f"K {tuple(key_cache.shape)} != V {tuple(value_cache.shape)}"
    assert key_cache.dtype == value_cache.dtype
    assert key_cache.is_contiguous() and value_cache.is_contiguous(), "KV caches must be contiguous"


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: exact fp32 ("ieee") for float32 inputs, so a float32 run matches the float32
    reference instead of carrying TF32 rounding (10-bit mantissa); ignored for bf16/fp16 inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def round_to(x, dt: tl.constexpr):
    """float32 x rounded to dtype `dt` (round to nearest even), returned as float32. bf16 rounds with integer ops on
    the float32 bits, so the round trip cannot be optimised away (seen on an H200 with triton 3.6: with `.to(bf16)
    .to(fp32)` around each product, 12% of head_norm_rope's outputs differed from the torch rounding, about what one
    rounding instead of three gives; the compiler step responsible was not isolated) and the CPU interpreter, which
    truncates on a bf16 cast, rounds the same way; `.to(dt)` of the result is then exact. NaN stays NaN (the bit
    trick would carry a NaN's mantissa into the exponent or the sign); +-inf stay, overflow rounds to inf."""
    if dt == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return tl.where(x == x, b.to(tl.float32, bitcast=True), x)
    elif dt == tl.float32:
        return x
    else:
        return x.to(dt).to(tl.float32)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the interpreter: a few splits, so split/merge
    paths are exercised)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def pow2_dot_reason(x: torch.Tensor, cache: torch.Tensor, dim_name: str) -> Optional[str]:
    """Shape part of the paged tl.dot eligibility rules: x's last dim ("head dim") and cache.shape[1]
    (block_size) must be powers of two, and on CUDA at least 16 (tl.dot's smallest tile). None when they are,
    else the reason (worded with `dim_name`)."""
    d, bs = x.shape[-1], cache.shape[1]
    if d & (d - 1) or bs & (bs - 1):
        return f"{dim_name} {d} / block_size {bs} not a power of two"
    if x.device.type == "cuda" and (bs < 16 or d < 16):
        return f"block_size and {dim_name} must be >= 16 for tl.dot"
    return None


# Tile tables (fp8_gemm.GEMM_TILES, fused_moe.MOE_TILES; the values are each kernel's own): per kernel family a tuple
# ((max tokens of the bucket, config), ...) in increasing bounds, the last bound MAX_TOKENS; the tile of a launch
# with M local tokens is the config of the first bucket with M <= bound.
MAX_TOKENS = 1 << 62  # upper bound of the last (prefill) bucket of a tile table
Tile = TypeVar("Tile")


def tile_row(table: Sequence[tuple[int, Tile]], num_tokens: int) -> tuple[int, Tile]:
    """The (bound, config) row of a tile table (above) that holds `num_tokens` (the launch's local M): the first
    row with num_tokens <= bound. A table that ends at MAX_TOKENS has a row for every M."""
    return next(row for row in table if num_tokens <= row[0])


def decide_triton(op: str, num_tokens: int, use_triton: bool, reason: Optional[str],
                  cache_dtype: Optional[torch.dtype] = None, path: Optional[str] = None) -> bool:
    """Record one dispatch decision for `op` (bucket by `num_tokens`, plus " kv=fp8_e4m3" / " kv=fp8_e5m2" when
    `cache_dtype` is an FP8 KV / index-K cache, so a benchmark names the FP8-KV path, plus " <path>" when the op
    names which of its kernels the Triton path launches) in ladle.observe.dispatch; returns whether the Triton
    path runs (asked for by `use_triton` and eligible, i.e. `reason` is None)."""
    bucket = dispatch.tokens_bucket(num_tokens)
    if cache_dtype is not None and is_fp8(cache_dtype):
        bucket += f" kv={FP8_KV_NAMES[cache_dtype]}"
    if path:
        bucket += f" {path}"
    return dispatch.decide(op, bucket, configured=use_triton, ineligible_reason=reason)


# ----------------------------------------------------------------------------------------------------------------
# FP8 KV / index-K caches (the persistent plane, design/kernels_and_limits.md §5 "FP8 KV"): a cache stores
# round_to_fp8(clamp(x / scale, -max, max)) with one float32 scale per tensor (per layer for K, for V and for
# index-K); readers dequantize on load, x ~= stored * scale. Saturating cast: e4m3fn has no infinity (an
# out-of-range value would become NaN), e5m2's would become inf, so values are clamped to the format's finite max.

FP8_KV_NAMES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


# Smallest REQS_P2 (`reqs_p2`): one compiled variant for every step of up to 255 requests.
REQS_P2_MIN = 256


def reqs_p2(num_reqs: int) -> int:
    """The constexpr width of a kernel's one-vector request lookup over query_start_loc [num_reqs + 1]: the next
    power of two of num_reqs + 1, at least REQS_P2_MIN. A width per batch size would compile one binary per power
    of two of the live request count (up to 8 for --max-num-seqs 128, each at the first step that needs it: a
    served step's seconds, ladle/runner/warmup.py); the masked lanes cost one 1 KiB load from L2 per program."""
    return max(REQS_P2_MIN, triton.next_power_of_2(num_reqs + 1))


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the FP8 cache dtypes (float8_e4m3fn, float8_e5m2)."""
    return dtype in FP8_KV_NAMES


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 cache dtype (448 for e4m3fn, 57344 for e5m2; torch.finfo)."""
    return float(torch.finfo(dtype).max)


def check_cache_dtype(x_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """Readers' rule: the cache holds x's dtype (auto) or an FP8 dtype (dequantized on load)."""
    assert cache_dtype == x_dtype or is_fp8(cache_dtype), f"activations {x_dtype} vs cache {cache_dtype}"


def quantize_fp8_ref(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Torch reference of the store-side quantization: float32 x / scale, clamped to +-fp8_max(dtype), cast
    (round to nearest even) to `dtype`."""
    limit = fp8_max(dtype)
    return (x.to(torch.float32) / scale).clamp(-limit, limit).to(dtype)


def dequantize_ref(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Torch reference of the load-side dequantization: x (cache rows) in `dtype`, times `scale` (skipped when
    it is 1.0, so auto caches are read exactly as before)."""
    x = x.to(dtype)
    return x if scale == 1.0 else x * scale


# Exact float8_e4m3fn -> bf16, 4 values per instance ($2: 4 bytes in; $0, $1: bf16x2 of bytes 0-1, 2-3). Per pair of
# values: prmt sign-extends the two bytes into 16-bit halves; shl 4 and the mask leave sign | the 7 exponent+mantissa
# bits just under bf16's exponent field, which reads as value * 2^-120 (bias gap 127 - 7; e4m3 subnormals land on
# bf16 subnormals, zero on zero); mul.rn.bf16x2 by 2^120 (0x7B80) is exact. NaN codes (0x7f, 0xff) come out as +-480
# (the FP8 cache store saturates: they never occur). tests/kernels/test_msa_indexer_decode.py emulates this text.
E4M3_TO_BF16_PTX = tl.constexpr("""{
.reg .b32 a<2>, s;
mov.b32 s, 0x7B807B80;
prmt.b32 a0, $2, 0, 0x9180;
prmt.b32 a1, $2, 0, 0xB3A2;
shl.b32 a0, a0, 4;
shl.b32 a1, a1, 4;
and.b32 a0, a0, 0x87F087F0;
and.b32 a1, a1, 0x87F087F0;
mul.rn.bf16x2 $0, a0, s;
mul.rn.bf16x2 $1, a1, s;
}""")


@triton.jit
def e4m3_to_bf16(raw):
    """float8_e4m3fn tensor -> bf16, exact (E4M3_TO_BF16_PTX; sm_90). Replaces Hopper's e4m3 -> bf16 cast, which is
    cvt f16x2.e4m3x2 then cvt bf16.f16 per value, all on the low-throughput conversion unit, with integer ops and
    one packed multiply."""
    return tl.inline_asm_elementwise(E4M3_TO_BF16_PTX, "=r,=r,r", [raw.to(tl.int8, bitcast=True)],
                                     dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def cache_tile_to(raw, dtype: tl.constexpr, FP8_BITS: tl.constexpr):
    """A loaded cache tile in the compute dtype: `e4m3_to_bf16` under FP8_BITS (the launcher checked
    `fp8_bit_cast_ineligible`), else Triton's cast (exact for every FP8 value; a no-op for an auto cache)."""
    if FP8_BITS:
        out = e4m3_to_bf16(raw)
    else:
        out = raw.to(dtype)
    return out


def fp8_bit_cast_ineligible(x: torch.Tensor, cache: torch.Tensor) -> Optional[str]:
    """None when a kernel may cast `cache` tiles with `e4m3_to_bf16` (inline PTX) for bf16 activations x, else why
    not: a float8_e4m3fn cache, bf16 x, CUDA sm_90+ (not the interpreter)."""
    if cache.dtype != torch.float8_e4m3fn or x.dtype != torch.bfloat16:
        return f"cache {cache.dtype}, activations {x.dtype}"
    if interpreting() or x.device.type != "cuda":
        return "no inline PTX in the interpreter"
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return "mul.rn.bf16x2 needs sm_90"
    return None


def resolve_fp8_bit_cast(x: torch.Tensor, cache: torch.Tensor, fp8_bit_cast: Optional[bool]) -> bool:
    """A launcher's `fp8_bit_cast` argument: None -> whether `fp8_bit_cast_ineligible` passes; True where it does
    not -> ValueError naming why; False -> Triton's cast."""
    reason = fp8_bit_cast_ineligible(x, cache)
    if fp8_bit_cast and reason:
        raise ValueError(f"fp8_bit_cast=True needs a float8_e4m3fn cache, bf16 activations and sm_90+ "
                         f"(not the interpreter): {reason}; leave it None (auto) or False")
    return reason is None if fp8_bit_cast is None else bool(fp8_bit_cast)

"""The one weight-loading protocol and the one dummy-weight initialiser of every ladle model.

Loading: a model declares ONE name table — `WeightRule`s mapping checkpoint names (regular expressions) to
(parameter name, shard_id[, expert_id]) — and `load_weights_by_table` feeds each checkpoint tensor to the
parameter's `weight_loader(param, loaded_weight, shard_id=None)` (ladle/layers/linear.py documents the protocol;
FusedMoE's loader takes `expert_id` too). The loader receives the full checkpoint tensor and slices this rank's
part itself, so the table knows nothing about tensor parallelism. Under tensor parallelism the "full tensor" is a
lazy `CheckpointSlice` (ladle/models/checkpoint_slice.py): the loader's own narrow / split / index select the
slice and only that is read from the file.

Dummy weights (`--load-format dummy`): `init_dummy_weights` — norms at their identity (1 - weight_offset) plus
uniform noise, vocabulary tables uniform ±1, every other matrix uniform ±1/sqrt(fan_in) (fan_in = last dim, so a
layer's output keeps the input's scale and deep stacks stay finite), other vectors ±0.1; all capped at `max_abs`.
A tensor-parallel shard draws every tensor at its one-rank shape (the same generator sequence as one rank) and keeps
its slice through the parameter's weight_loader, so TP = N holds exactly the slices of the TP = 1 weights.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Hashable, Iterable, Optional, Union

import torch
from torch import nn

from ladle.layers.moe import FusedMoE
from ladle.layers.norm import RMSNorm
from ladle.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding


@dataclass(frozen=True)
class TPShard:
    """Which shard of a tensor-parallel group a model instance holds: rank of size; expert_parallel places whole
    MoE experts on ranks instead of splitting their intermediate dim (ladle/layers/moe.py)."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False

    def kwargs(self) -> dict:
        """tp_rank / tp_size keyword arguments of the layer kit."""
        return {"tp_rank": self.rank, "tp_size": self.size}


SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")  # block-FP8 / MXFP8, and MXFP4 (ladle/quant/mxfp4.py)


class UnknownWeightError(KeyError, ValueError):
    """A checkpoint tensor that no table row maps to a parameter of the model (a KeyError and a ValueError)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class WeightRule:
    """One row of a model's name table.

    A checkpoint name (after the table's prefix rewrite) that fully matches `pattern` loads into the parameter
    named `param` (a `re.Match.expand` template, e.g. r"\\1.qkv_proj.\\3") with `shard_id`; a str shard_id or
    expert_id containing a backslash is expanded from the match too (expert ids made of digits become ints).
    """

    pattern: str
    param: str
    shard_id: Hashable = None
    expert_id: Union[int, str, None] = None

    def resolve(self, name: str) -> Optional[tuple[str, dict]]:
        """(parameter name, weight_loader keyword args) when `name` matches, else None."""
        m = re.fullmatch(self.pattern, name)
        if m is None:
            return None
        kwargs = {"shard_id": _expand(m, self.shard_id)}
        if self.expert_id is not None:
            e = _expand(m, self.expert_id)
            kwargs["expert_id"] = int(e) if isinstance(e, str) and e.isdigit() else e
        return m.expand(self.param), kwargs


def _expand(m: re.Match, value):
    return m.expand(value) if isinstance(value, str) and "\\" in value else value


@dataclass(frozen=True)
class WeightNameTable:
    """rules: tried in order, the first match wins. prefixes: (old, new) pairs, the first matching one rewrites the
    name's start before the rules run. skip: patterns (re.match on the raw name) of tensors the model ignores."""

    rules: tuple[WeightRule, ...]
    prefixes: tuple[tuple[str, str], ...] = ()
    skip: tuple[str, ...] = ()

    def resolve(self, name: str) -> Optional[tuple[str, dict]]:
        """(parameter name, loader kwargs), or None for a skipped tensor. Raises UnknownWeightError.
        A quantization scale `X.weight_scale_inv` (block FP8, MXFP8) or `X.weight_scale` (MXFP4) resolves as
        `X.weight` does, to that parameter's name + "_scale_inv" (`qkv_proj.weight_scale_inv`, `mlp.w13_scale_inv`;
        ladle/quant/fp8.py, mxfp4.py), with the same shard / expert."""
        if any(re.match(p, name) for p in self.skip):
            return None
        for suffix in SCALE_SUFFIXES:
            if name.endswith(suffix):
                found = self.resolve(name[: -len(suffix)] + ".weight")
                return None if found is None else (found[0] + "_scale_inv", found[1])
        local = name
        for old, new in self.prefixes:
            if local.startswith(old):
                local = new + local[len(old):]
                break
        for rule in self.rules:
            found = rule.resolve(local)
            if found is not None:
                return found
        raise UnknownWeightError(f"unknown checkpoint tensor {name!r}: no parameter for it in the name table")


@torch.no_grad()
def load_weights_by_table(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                          table: WeightNameTable) -> set[str]:
    """Feed every (checkpoint name, full tensor) through `table` to its parameter's weight_loader (cast to the
    parameter dtype first). Returns the names of parameters every element of which was written.

    Raises UnknownWeightError for a name outside the table (or mapped to a parameter the model lacks), ValueError
    for a piece written twice, and the weight_loader's ValueError on a shape mismatch or a bad shard."""
    params = dict(model.named_parameters())
    written: dict[str, int] = {}
    pieces: set[tuple] = set()
    for name, tensor in weights:
        target = table.resolve(name)
        if target is None:
            continue
        pname, kwargs = target
        if pname not in params:
            hint = ("; a quantization scale for a model built unquantized: build it in the checkpoint's quant config "
                    "(ladle.quant.config.quant_config_of)" if name.endswith(SCALE_SUFFIXES) else "")
            raise UnknownWeightError(f"unknown checkpoint tensor {name!r}: it maps to {pname!r}, but "
                                     f"{type(model).__name__} has no parameter of that name{hint}")
        key = (pname, *sorted(kwargs.items(), key=lambda kv: kv[0]))
        if key in pieces:
            raise ValueError(f"checkpoint tensor {name!r} written twice into {pname!r} ({kwargs})")
        pieces.add(key)
        param = params[pname]
        try:
            n = param.weight_loader(param, tensor.to(getattr(param, "load_dtype", param.dtype)), **kwargs)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        written[pname] = written.get(pname, 0) + n
    done = {p for p, n in written.items() if n >= params[p].numel()}
    return done | {p for p, param in params.items() if _sibling(p, getattr(param, "derived_from", None)) in done}


def _sibling(pname: str, attr: Optional[str]) -> Optional[str]:
    """Full name of the parameter `attr` of the module that holds `pname` (None when attr is None)."""
    return None if attr is None else ".".join(pname.split(".")[:-1] + [attr])


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, norm_noise: float = 0.1,
                       max_abs: Optional[float] = None, unsharded: Optional[nn.Module] = None) -> None:
    """Random weights for `--load-format dummy` (module doc for the scales), drawn in parameter order from a
    generator seeded with `seed` on the parameters' device (same seed, same device -> same weights).

    norm_noise: half-width of the uniform noise around a norm's identity (0: exactly the identity).
    max_abs: cap on every non-norm bound (None: no cap).
    unsharded: for a tensor-parallel shard, the same model built with one rank (on the meta device: only its
    shapes are read); each tensor is drawn at its one-rank shape and this rank's slice loaded from it."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    seen: set[int] = set()  # a tied weight is drawn once, by the first module that holds it (the embedding)
    full_modules = list(unsharded.modules()) if unsharded is not None else None
    for i, module in enumerate(model.modules()):
        full_module = full_modules[i] if full_modules is not None else module
        for p, full_p in zip(module.parameters(recurse=False), full_module.parameters(recurse=False)):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(module, RMSNorm):
                centre, bound = 1.0 - module.weight_offset, norm_noise
            else:
                centre, bound = 0.0, _bound(full_module, full_p)
                bound = bound if max_abs is None else min(bound, max_abs)
            if bound == 0.0:
                p.fill_(centre)
                continue
            if hasattr(p, "init_from_float") and p.init_from_float is None:
                continue  # a quantization scale: set with its weight
            if getattr(p, "init_from_float", None) is not None:
                # a quantized weight: quantize a float draw of this rank's (unpacked) shape; with tensor parallelism
                # a dummy quantized shard is therefore not a slice of the one-rank model's (stated, not equal)
                r = torch.rand(getattr(p, "dummy_shape", p.shape), generator=gen, device=device,
                               dtype=torch.float32) * 2 - 1
                p.init_from_float(r * bound + centre)
                continue
            r = torch.rand(full_p.shape, generator=gen, device=device, dtype=torch.float32) * 2 - 1
            full = (r * bound + centre).to(p.dtype)
            if unsharded is None:
                p.copy_(full)
            else:
                load_unsharded(module, p, full)


def load_unsharded(module: nn.Module, param: nn.Parameter, full: torch.Tensor) -> None:
    """Load `param` (of `module`, a tensor-parallel shard) from `full`, the same parameter of the one-rank model:
    a merged column-parallel weight is its pieces concatenated in shard order, so the weight_loader with shard_id
    None takes it; expert tables go expert by expert (the folded shared expert is row E)."""
    if isinstance(module, FusedMoE) and (param is module.w13 or param is module.w2):
        shard = "w13" if param is module.w13 else "w2"
        for e in range(module.num_experts):
            module.weight_loader(param, full[e], shard, e)
        if module.shared_folded:
            module.weight_loader(param, full[module.num_experts], shard, "shared")
        return
    param.weight_loader(param, full)


def _bound(module: nn.Module, p: nn.Parameter) -> float:
    if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
        return 1.0
    if p.dim() == 1:
        return 0.1
    return 1.0 / math.sqrt(p.shape[-1])

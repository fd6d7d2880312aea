"""Which quantization method a layer gets when its constructor is not given one: the construction-time scope.

Models build their layers without knowing about quantization; the loader (ladle/models/loader.py) builds the model
inside `quant_config_scope(config)` and every `ColumnParallelLinear` / `RowParallelLinear` / `FusedMoE` created in
that scope asks the config for its method (vLLM's `quant_config.get_quant_method(layer, prefix)`, here without a
prefix: a config that must keep some layers unquantized says so by layer kind). Outside any scope, or with
config None, layers are unquantized.

A config is any object with
    linear_method(layer_kind: str) -> a linear method or None   (layer_kind: "column" | "row")
    moe_method() -> a FusedMoE method or None
(None = the unquantized method). The scope is a stack, so nested scopes (and threads building models one after
another) see the innermost config; it is not thread-local: build one model at a time.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

_SCOPES: list[Any] = [None]


@contextlib.contextmanager
def quant_config_scope(config: Optional[Any]) -> Iterator[None]:
    """Layers constructed inside this block take their quant method from `config` (None: unquantized)."""
    _SCOPES.append(config)
    try:
        yield
    finally:
        _SCOPES.pop()


def scoped_linear_method(layer_kind: str) -> Optional[Any]:
    """The current config's method for a linear layer of `layer_kind` ("column" | "row"), or None."""
    config = _SCOPES[-1]
    return None if config is None else config.linear_method(layer_kind)


def scoped_moe_method() -> Optional[Any]:
    """The current config's FusedMoE method, or None."""
    config = _SCOPES[-1]
    return None if config is None else config.moe_method()

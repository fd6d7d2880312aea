"""Which op backends a layer runs: the forward context's `OpBackends`, or the torch references outside a forward.

Layers never choose between Triton and torch themselves: they pass `use_triton` from here to the op, which checks
its eligibility rule and records the decision (ladle.observe.dispatch).
"""

from __future__ import annotations

from ladle.layers.attention.metadata import OpBackends, get_forward_context


def op_backends() -> OpBackends:
    """`get_forward_context().backends` inside a forward; `OpBackends.reference()` when a layer is called on its own
    (outside `set_forward_context`, e.g. a layer test)."""
    try:
        return get_forward_context().backends
    except AssertionError:  # no forward context: get_forward_context asserts one exists
        return OpBackends.reference()

"""Imports point downward (ARCHITECTURE.md, "Packages and what each owns").

Parses every module under ladle/ with `ast` and checks its `ladle.*` imports against the table below, plus the
third-party rules (core/ and the stdlib-only leaves never import torch; bench/ never imports torch).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "ladle"

# package -> ladle packages it may import (config and observe.dispatch are allowed everywhere).
ALLOWED = {
    "config": set(),
    "core": {"core"},
    "engine": {"engine", "core", "runner", "models", "quant", "observe"},  # quant: --quantization vs config.json
    "runner": {"runner", "core", "models", "layers", "kernels", "distributed", "observe"},
    "models": {"models", "quant", "layers", "kernels", "distributed", "observe"},
    "quant": {"quant", "layers", "kernels", "distributed", "observe"},  # quant methods for the layer kit
    "layers": {"layers", "kernels", "distributed", "observe"},
    "distributed": {"distributed", "observe"},  # process groups and collectives (tensor parallelism)
    "kernels": {"kernels", "observe"},
    "server": {"server", "engine", "core", "observe"},
    "bench": {"bench", "server"},
    "observe": {"observe", "core"},
    "tools": {"tools", "models", "layers", "kernels", "observe"},  # offline writers behind `ladle make-checkpoint`
    "cli": None,  # argument wiring: may import anything
    "cli_args": None,
    "__main__": None,
    "__init__": {"engine", "core"},  # `from ladle import LLM, SamplingParams`: the offline API, loaded lazily
    "data": set(),
}
LEAVES = {"ladle.config", "ladle.observe.dispatch"}
NO_TORCH = ("core", "config", "bench")


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        yield path, ".".join(rel.parts)


def _imports(path: pathlib.Path, modname: str) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    pkg = modname.rsplit(".", 1)[0] if not path.name == "__init__.py" else modname
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names if mod.startswith("ladle"))
    return out


def _top(modname: str) -> str:
    parts = modname.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


@pytest.mark.parametrize("path,modname", list(_modules()), ids=lambda x: str(x) if isinstance(x, str) else "")
def test_imports_point_downward(path, modname):
    top = _top(modname)
    allowed = ALLOWED.get(top, set())
    for imp in _imports(path, modname):
        if imp.startswith("torch") and top in NO_TORCH:
            pytest.fail(f"{modname} imports {imp}: {top}/ must stay free of torch")
        if modname in LEAVES and imp.startswith("ladle"):
            pytest.fail(f"{modname} is a stdlib-only leaf but imports {imp}")
        if not imp.startswith("ladle.") or allowed is None:
            continue
        if any(imp == leaf or imp.startswith(leaf + ".") for leaf in LEAVES):
            continue
        target = _top(imp)
        if target == "observe" and imp.startswith("ladle.observe.dispatch"):
            continue
        assert target in allowed, f"{modname} imports {imp}: {top}/ may import only {sorted(allowed)}"

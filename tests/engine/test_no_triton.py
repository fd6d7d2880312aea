"""An install without Triton (the package marks it Linux-only; the CPU torch wheel does not bring it) still serves:
every kernel module imports through the guarded `import triton` of ladle/kernels/_common.py and the engine runs the
torch references. Found by a new-user trial of the README (2026-12-01): `ladle serve` died with
`ModuleNotFoundError: No module named 'triton'` from a kernel module that imported Triton directly."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import importlib.abc, sys

    class BlockTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}")

    sys.meta_path.insert(0, BlockTriton())
    import pkgutil, importlib
    import ladle.kernels
    for info in pkgutil.iter_modules(ladle.kernels.__path__):
        importlib.import_module(f"ladle.kernels.{info.name}")
    from ladle.core.sampling_params import SamplingParams
    from ladle.engine.llm import LLM
    llm = LLM(kv_cache_memory_bytes=64 << 20, max_model_len=512)
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert "triton" not in sys.modules
    print("served without triton")
""")


def test_engine_imports_every_kernel_and_generates_without_triton():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "served without triton" in done.stdout, done.stderr[-3000:]

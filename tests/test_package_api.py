"""`from ladle import LLM, SamplingParams` (vLLM's spelling of the offline API), loaded lazily: `import ladle` alone
imports no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_offline_api_names_at_the_top():
    import ladle
    from ladle.core.sampling_params import SamplingParams
    from ladle.engine.llm import LLM

    assert ladle.LLM is LLM and ladle.SamplingParams is SamplingParams
    assert sorted(ladle.__all__) == ["LLM", "SamplingParams"]
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        ladle.Engine  # noqa: B018


def test_import_ladle_imports_no_torch():
    code = "import sys, ladle; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr

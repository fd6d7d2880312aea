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


def test_llm_public_methods_and_chat_signature():
    """LLM's public surface; chat takes vLLM's LLM.chat parameters, same names in the same order
    (vllm/entrypoints/llm.py LLM.chat), so ported calls bind the same way."""
    import inspect

    from ladle.engine.llm import LLM

    assert sorted(n for n in vars(LLM) if not n.startswith("_")) == [
        "chat", "core_stats", "from_engine_config", "generate", "shutdown"]
    assert list(inspect.signature(LLM.chat).parameters) == [
        "self", "messages", "sampling_params", "use_tqdm", "lora_request", "chat_template",
        "chat_template_content_format", "add_generation_prompt", "continue_final_message", "tools",
        "chat_template_kwargs", "mm_processor_kwargs"]


def test_import_ladle_imports_no_torch():
    code = "import sys, ladle; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr

"""ladle, an LLM serving engine. The offline API, under vLLM's names: `from ladle import LLM, SamplingParams`
(loaded on first use, so `import ladle` and the command line do not import torch for it)."""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from ladle.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from ladle.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'ladle' has no attribute {name!r}")

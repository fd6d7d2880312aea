"""Logprobs as the offline API returns them (vLLM's shape), and the text of one token as logprobs report it.

Inside ladle one position's logprobs are a TokenLogprobs list (core/outputs.py): (token id, logprob, rank) of the
sampled (or prompt) token first, then the top-k alternatives with ranks 1..k; the server's OpenAI formats are built
from that list. `LLM.generate` turns it, at its edge (`offline_request_output`), into vLLM's offline form: per
position a dict token id -> Logprob, so `out.outputs[0].logprobs[i][token_id].logprob` reads as with vLLM. The dict
holds the sampled token once: k entries when it is among the top k, else k + 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from ladle.core.outputs import TokenLogprobs

if TYPE_CHECKING:
    from ladle.engine.client import RequestOutput


@dataclass
class Logprob:
    """One token at one position (vLLM's `Logprob` fields).

    logprob:       raw log-softmax of the model's logits (float32 on the device), before any sampling transform.
    rank:          1-based rank of the token in the whole vocabulary (1 + tokens with a strictly higher logprob;
                   the top-k entries are ranked 1..k by their order).
    decoded_token: the token's text decoded alone (TokenTexts); None when the engine has no tokenizer.
    """

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


SampleLogprobs = list[dict[int, Logprob]]  # one dict per generated token
PromptLogprobs = list[Optional[dict[int, Logprob]]]  # one per prompt token; None for the first


class TokenTexts(dict):
    """token id -> the token's text decoded alone (`tokenizer.decode([id], skip_special_tokens=False)`, as vLLM's
    logprobs detokenizer; a partial UTF-8 byte shows as U+FFFD), decoded on first use and kept. One per tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def logprob_dict(entry: TokenLogprobs, texts: Optional[TokenTexts]) -> dict[int, Logprob]:
    """One position's TokenLogprobs -> {token id: Logprob}, the sampled/prompt token's key first. When that token is
    also among the top k it is one key holding the top-k entry's values (as vLLM, whose dict is built the same way).
    texts None: every decoded_token is None."""
    return {tid: Logprob(lp, rank, None if texts is None else texts[tid]) for tid, lp, rank in entry}


def _sample_logprobs(entries: Optional[list[TokenLogprobs]], texts: Optional[TokenTexts]) -> Optional[SampleLogprobs]:
    return None if entries is None else [logprob_dict(e, texts) for e in entries]


def offline_request_output(out: RequestOutput, texts: Optional[TokenTexts]) -> RequestOutput:
    """A RequestOutput (engine/client.py) with its logprobs in vLLM's offline form: each choice's `logprobs` and
    `logprobs_delta` a SampleLogprobs, `prompt_logprobs` a PromptLogprobs. `out` itself is left as it is."""
    prompt = None
    if out.prompt_logprobs is not None:
        prompt = [None if e is None else logprob_dict(e, texts) for e in out.prompt_logprobs]
    choices = [dataclasses.replace(c, logprobs=_sample_logprobs(c.logprobs, texts),
                                   logprobs_delta=_sample_logprobs(c.logprobs_delta, texts)) for c in out.outputs]
    return dataclasses.replace(out, outputs=choices, prompt_logprobs=prompt)

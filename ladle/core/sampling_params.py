"""Per-request sampling parameters (validated at the edge: `ValueError` maps to HTTP 400)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Sampling order (ARCHITECTURE.md): penalties -> temperature -> min_p -> top_k -> top_p.
    temperature == 0 means greedy; top_p == 1 no top-p; min_p == 0 none.
    top_k == 0 means no top-k: the one encoding of "off" from here through SamplingTensors to the kernels (0 is
    the zero of a count, needs no vocabulary size, and a zero-filled tensor row reads as "off"). -1, which
    OpenAI-compatible servers such as vLLM have accepted for "off", is accepted here and normalised to 0.
    `seed`: per-request seed; the engine gives choice i of `n` the seed `seed + i`.
    `max_tokens` None: filled by the engine with max_model_len - prompt length.
    `logprobs`: number of top logprobs per generated token (the sampled token's logprob is always
    returned when this is not None). `prompt_logprobs`: same for prompt tokens (None = off). Both >= 0; their upper
    bound is the front end's (`check_logprobs_limit`).
    Raises ValueError on any out-of-range value.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # Normalise list inputs to tuples so the object stays hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        # Every integer crosses the engine-core process boundary as a 64-bit integer (msgspec) and becomes int64
        # tensor values; vLLM bounds `seed` to the same range. Refused here, so both engine layouts answer alike.
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
                bad(f"{name} must fit in a signed 64-bit integer [-2**63, 2**63 - 1], got {str(value)[:24]}"
                    + ("..." if len(str(value)) > 24 else ""))
        if any(isinstance(t, int) and not INT64_MIN <= t <= INT64_MAX for t in self.stop_token_ids):
            bad("stop_token_ids must fit in a signed 64-bit integer")
        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            bad(f"temperature must be non-negative, got {self.temperature}")
        if 0 < self.temperature < 0.01:  # dividing logits by a tinier one overflows float32; vLLM raises it to the
            object.__setattr__(self, "temperature", 0.01)  # same floor (vllm/sampling_params.py `_MAX_TEMP`)
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad(f"top_k must be 0 or -1 (disable) or at least 1, got {self.top_k}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)  # the edge's second spelling of "off"
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 0:
            bad(f"max_tokens must be non-negative, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        # No fixed upper bound: the front end sets it (the server's --max-logprobs, the offline LLM's vocabulary;
        # check_logprobs_limit).
        if self.logprobs is not None and self.logprobs < 0:
            bad(f"logprobs must be non-negative, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            bad("stop strings must be non-empty")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")

    def check_logprobs_limit(self, limit: int, what: str) -> None:
        """ValueError naming the field when `logprobs` or `prompt_logprobs` exceeds `limit` (`what` names the
        limit, e.g. "the vocabulary size")."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > limit:
                raise ValueError(f"{name} must be in [0, {limit}] ({what}), got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

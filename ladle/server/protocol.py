"""OpenAI-compatible request/response schemas (pydantic v2). A shared contract: `ladle/bench` imports it.

Field names and meanings follow the OpenAI API and vLLM's extensions (vllm/entrypoints/openai/protocol.py):
`ignore_eos`, `min_tokens`, `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `skip_special_tokens`,
`include_stop_str_in_output`, `chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`.
Wrong types fail validation (HTTP 400).

Fields ladle does not honour are refused, never ignored (vLLM ignores unknown fields with a log warning; ladle does
not): the two generation requests keep their undeclared top-level fields (`extra="allow"`, in `model_extra`) and
ladle.server.validation.check_request_fields answers 400 naming the field and what ladle offers instead, for
- a field of OpenAI's API or of vLLM's extensions that ladle does not implement (`logit_bias`, `response_format`
  json_object / json_schema, `audio`, `guided_json`, `use_beam_search`, `best_of` other than n, ...), unless its
  value is equivalent to leaving it out (`logit_bias: {}`, `response_format: {"type": "text"}`, `best_of` equal to
  n, `service_tier: "auto"`, null): clients send defaults;
- any other field (a typo, another server's extension such as `top_a`): the message lists the fields ladle honours.
  Clients send only what their user passes (the openai client's `extra_body` included; `ladle bench serve` sends
  declared fields only), so a field ladle does not know is a request it would answer wrongly.
Identifiers no output depends on (`user`, `metadata`, `safety_identifier`, `prompt_cache_key`) are accepted.
Nested objects (messages, stream_options) still ignore unknown keys: clients send back the assistant messages they
received (`refusal`, `annotations`, ...), which are history, not generation controls. /tokenize and /detokenize
ignore unknown fields.
Response shapes follow OpenAI's published schema (github.com/openai/openai-openapi, openapi.yaml:
CreateChatCompletionResponse, ChatCompletionResponseMessage, CreateChatCompletionStreamResponse,
CreateCompletionResponse): required-but-nullable fields are always present (`message.refusal`, `choices[].logprobs`,
`logprobs.refusal`); `system_fingerprint` (a string where present) is left out, ladle has none to give.
`reasoning_content` and `stop_reason` are vLLM's additions. Stream chunks have no models here: they are plain dicts
(ladle/server/stream_chunks.py; the chat delta's fields: serving_chat._DELTA_FIELDS).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


def ladle_version() -> str:
    try:
        from importlib.metadata import version

        return version("ladle")
    except Exception:  # not installed (running from a source tree)
        return "0.0.0+unknown"


def random_id(prefix: str) -> str:
    """Internal ids: `<prefix>-<32 hex>` (never the client's X-Request-Id)."""
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[int, str]] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------------------------------- shared
class StreamOptions(OpenAIModel):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class _SamplingFields(OpenAIModel):
    """Sampling fields shared by both endpoints (OpenAI + vLLM extensions). Undeclared fields are kept (see the module
    docstring); `api_path` names the endpoint for ladle.server.validation.check_request_fields."""

    model_config = ConfigDict(extra="allow")
    api_path: ClassVar[str] = ""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    max_tokens: Optional[int] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


# ---------------------------------------------------------------------------------------------- completions
class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or a list of token-id lists."""

    api_path: ClassVar[str] = "/v1/completions"
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[list[Optional[dict[int, Any]]]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


# ---------------------------------------------------------------------------------------------- chat
class ChatMessage(OpenAIModel):
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    api_path: ClassVar[str] = "/v1/chat/completions"
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None  # unset / true: every parsed call; false: the first one only
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: Optional[list[ChatLogprobToken]] = None
    refusal: Optional[list[ChatLogprobToken]] = None  # required (nullable) in OpenAI's schema; ladle never refuses


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    refusal: Optional[str] = None  # required (nullable) in OpenAI's schema
    reasoning_content: Optional[str] = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


# ---------------------------------------------------------------------------------------------- models, tokenize
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ladle"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize: either `prompt` (completion form) or `messages` (chat form)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None  # unset: True for `prompt`, False for `messages` (vLLM's defaults)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str

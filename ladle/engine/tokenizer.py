"""Tokenizer loading (through transformers), chat template, and the model's EOS ids.

The tokenizer comes from the model: an HF directory (`AutoTokenizer.from_pretrained(dir)`) or a GGUF file
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`, which reads the vocabulary, merges and chat template
stored in the GGUF metadata). `--tokenizer DIR` overrides both.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping, Optional, Sequence


def load_tokenizer(tokenizer_path: Optional[str], gguf_file: Optional[str] = None) -> Any:
    """A transformers tokenizer.

    tokenizer_path: a directory (or the directory holding the GGUF); gguf_file: the GGUF's file name (or full
    path) when the tokenizer lives inside it (`--tokenizer` is already folded into tokenizer_path by the loader).
    Raises ValueError when nothing to load from.
    """
    from transformers import AutoTokenizer

    if gguf_file:
        directory = tokenizer_path or os.path.dirname(os.path.abspath(gguf_file))
        if os.path.isfile(directory):
            directory = os.path.dirname(directory)
        return AutoTokenizer.from_pretrained(directory, gguf_file=os.path.basename(gguf_file))
    if not tokenizer_path:
        raise ValueError("no tokenizer: the model source names no tokenizer directory; pass --tokenizer")
    return AutoTokenizer.from_pretrained(tokenizer_path)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, Iterable):
        return [int(v) for v in value if v is not None]
    return []


def eos_token_ids(tokenizer: Any, generation_config: Optional[dict] = None) -> tuple[int, ...]:
    """The tokenizer's eos id plus generation_config's `eos_token_id` (an int or a list), deduplicated,
    in first-seen order."""
    ids: list[int] = []
    for v in _as_ids(getattr(tokenizer, "eos_token_id", None)) + _as_ids((generation_config or {}).get("eos_token_id")):
        if v not in ids:
            ids.append(v)
    return tuple(ids)


# The roles of OpenAI's chat messages that ladle passes to the chat template (developer: OpenAI's newer name for
# system instructions, which templates such as MiniMax-M3's render). OpenAI's deprecated `function` role and any
# other name are refused: a template would render an unknown role verbatim, a turn the model was never trained on.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# chat_template_kwargs keys that would replace an argument chat_prompt_ids passes to `apply_chat_template` itself
# (they raise inside the template call, or change what it returns).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message", "tools",
    "documents", "chat_template", "return_tensors", "return_dict", "return_assistant_tokens_mask", "padding",
    "truncation", "max_length", "tokenizer_kwargs",
})


class ChatInputError(ValueError):
    """Chat messages or template arguments ladle cannot render; `param` names the field as a dotted path
    (`messages[0].content[1].type`): the server answers 400 with it, LLM.chat raises it as is."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def chat_message_dicts(messages: Sequence[Any]) -> list[dict]:
    """Messages (dicts in OpenAI's shape: role, content, and tool_calls / tool_call_id / name ... passed through) as
    the template takes them, text only: content is a string, or a list of {"type": "text", "text": str} parts
    joined into one string; null (or missing) content only in an assistant message with tool_calls (rendered as
    ""). Raises ChatInputError for no messages, a role outside CHAT_ROLES, any other content (image, audio ...
    parts)."""
    if not messages:
        raise ChatInputError("messages must contain at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatInputError(f"messages[{i}] must be a dict with role and content, got {type(m).__name__}",
                                 f"messages[{i}]")
        role = m.get("role")
        if role not in CHAT_ROLES:
            hint = " (OpenAI's deprecated function role: send the result as role tool with tool_call_id)" \
                if role == "function" else ""
            shown = repr(role)[:40] if isinstance(role, str) else type(role).__name__
            raise ChatInputError(f"messages[{i}].role {shown} is not a chat role ladle handles; use one of "
                                 f"{', '.join(CHAT_ROLES)}{hint}", f"messages[{i}].role")
        d = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            d["content"] = "".join(_text_part(part, f"messages[{i}].content[{j}]") for j, part in enumerate(content))
        elif content is None:
            if role != "assistant" or not m.get("tool_calls"):  # OpenAI's rule: null only beside tool_calls
                raise ChatInputError(f"messages[{i}].content is required in a {role} message (null only in an "
                                     f"assistant message with tool_calls)", f"messages[{i}].content")
            d["content"] = ""
        elif not isinstance(content, str):
            raise ChatInputError(f"messages[{i}].content must be a string or a list of text parts, got "
                                 f"{type(content).__name__}", f"messages[{i}].content")
        out.append(d)
    return out


def _text_part(part: Any, param: str) -> str:
    """The text of one content part; ChatInputError for a part that is not {"type": "text", "text": str}."""
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind != "text":
        shown = repr(kind)[:40] if isinstance(kind, str) else type(kind).__name__
        raise ChatInputError(f"not supported yet: content part of type {shown} ({param}); ladle takes text only "
                             f"(a string, or parts of type 'text')", f"{param}.type")
    if not isinstance(part.get("text"), str):
        raise ChatInputError(f"{param}.text must be a string", f"{param}.text")
    return part["text"]


def chat_prompt_ids(tokenizer: Any, messages: Sequence[Any], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: Optional[list[dict]] = None,
                    chat_template: Optional[str] = None, chat_template_kwargs: Optional[Mapping[str, Any]] = None,
                    add_special_tokens: bool = False) -> list[int]:
    """The prompt token ids of one conversation: chat_message_dicts(messages) through the chat template (the
    tokenizer's, or `chat_template`, a Jinja string), tokenized (apply_chat_template). `continue_final_message`
    leaves the last message open for the model to continue; `tools` (OpenAI tool schemas) and
    `chat_template_kwargs` (extra template variables) reach the template as transformers passes them.
    Raises ChatInputError for the messages (chat_message_dicts), a chat_template_kwargs key in
    RESERVED_TEMPLATE_KWARGS, or add_generation_prompt with continue_final_message (transformers refuses the pair);
    ValueError without a template; whatever the template raises (jinja2.TemplateError) as is."""
    for key in chat_template_kwargs or {}:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ChatInputError(f"chat_template_kwargs.{key} is set by ladle itself and cannot be overridden",
                                 "chat_template_kwargs")
    if add_generation_prompt and continue_final_message:
        raise ChatInputError("add_generation_prompt and continue_final_message cannot both be true: the first "
                             "opens a new assistant turn, the second continues the last message",
                             "continue_final_message")
    kwargs = dict(chat_template_kwargs or {})
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if tools:
        kwargs["tools"] = tools
    return apply_chat_template(tokenizer, chat_message_dicts(messages), add_generation_prompt=add_generation_prompt,
                               add_special_tokens=add_special_tokens, chat_template=chat_template, **kwargs)


def apply_chat_template(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
                        add_special_tokens: bool = False, chat_template: Optional[str] = None,
                        **template_kwargs: Any) -> list[int]:
    """Render `messages` with the model's chat template (or `chat_template`, a Jinja string that replaces it) and
    tokenize. Raises ValueError when neither exists.
    `add_special_tokens`: the tokenizer's own (BOS ...) on top of what the template writes; off by default, the
    template writes them (vLLM's /tokenize default for messages too)."""
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: give one (LLM.chat's chat_template, a Jinja "
                         "string), or send a plain prompt (the completions API, LLM.generate)")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template, **template_kwargs)
    return tokenizer(text, add_special_tokens=add_special_tokens).input_ids

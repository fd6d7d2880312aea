"""LLM.chat (vLLM's offline chat) on the real SmolLM2 GGUF: the prompt is checked against transformers'
apply_chat_template(..., tokenize=True) on a separately loaded tokenizer (the independent reference), and the
generated tokens against LLM.generate on those reference ids; then every argument ladle refuses."""

from __future__ import annotations

import pytest

from helpers import smollm2_bundle

from ladle.core.sampling_params import SamplingParams
from ladle.engine.llm import LLM
from ladle.engine.tokenizer import ChatInputError

GREEDY = SamplingParams(max_tokens=8, temperature=0)
CONV = [{"role": "user", "content": "What is the capital of France?"}]
CONV_B = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}]
# A template of our own: role-prefixed lines, a `tools` count and a `greeting` variable (chat_template_kwargs).
TEMPLATE = ("{% if greeting %}{{ greeting }}\n{% endif %}{% if tools %}tools: {{ tools | length }}\n{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def llm():
    """One model load for the module; prefix caching off so no call's numerics depend on an earlier call."""
    return LLM(bundle=smollm2_bundle(enable_prefix_caching=False))


def reference_ids(tokenizer, conversation, **kwargs) -> list[int]:
    """transformers' own render-and-tokenize (a BatchEncoding in transformers 5, a list before)."""
    out = tokenizer.apply_chat_template(conversation, tokenize=True, **kwargs)
    return list(out if isinstance(out, list) else out["input_ids"])


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_one_conversation_matches_generate_on_the_reference_prompt(llm, smollm2_tokenizer):
    ids = reference_ids(smollm2_tokenizer, CONV, add_generation_prompt=True)
    out = llm.chat(CONV, GREEDY)
    assert len(out) == 1 and out[0].prompt_token_ids == ids and out[0].prompt is None
    assert token_ids(out) == token_ids(llm.generate(ids, GREEDY))
    assert len(out[0].outputs[0].token_ids) > 0


def test_batch_of_two_in_order_with_one_sampling_params_each(llm, smollm2_tokenizer):
    ids = [reference_ids(smollm2_tokenizer, c, add_generation_prompt=True) for c in (CONV, CONV_B)]
    params = [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)]
    out = llm.chat([CONV, CONV_B], params)
    assert [o.prompt_token_ids for o in out] == ids
    assert [len(t) for t in token_ids(out)] == [3, 6]
    assert token_ids(out) == token_ids(llm.generate(ids, params))


def test_text_parts_render_as_the_string_content(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                          {"type": "text", "text": "of France?"}]}]
    one = SamplingParams(max_tokens=1, temperature=0)
    assert llm.chat(parts, one)[0].prompt_token_ids == llm.chat(CONV, one)[0].prompt_token_ids


def test_continue_final_message(llm, smollm2_tokenizer):
    conv = CONV + [{"role": "assistant", "content": "The capital of France is"}]
    ids = reference_ids(smollm2_tokenizer, conv, add_generation_prompt=False, continue_final_message=True)
    out = llm.chat(conv, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert out[0].prompt_token_ids == ids
    assert ids != reference_ids(smollm2_tokenizer, conv, add_generation_prompt=False)  # the last turn left open
    assert token_ids(out) == token_ids(llm.generate(ids, GREEDY))
    with pytest.raises(ValueError, match="add_generation_prompt and continue_final_message"):
        llm.chat(conv, GREEDY, continue_final_message=True)  # add_generation_prompt defaults to True


def test_custom_chat_template_with_tools_and_kwargs(llm, smollm2_tokenizer):
    kwargs = dict(chat_template=TEMPLATE, add_generation_prompt=True, tools=TOOLS)
    ids = reference_ids(smollm2_tokenizer, CONV, greeting="Hello.", **kwargs)
    out = llm.chat(CONV, GREEDY, chat_template_kwargs={"greeting": "Hello."}, **kwargs)
    text = smollm2_tokenizer.decode(ids)
    assert text.startswith("Hello.\ntools: 1\nuser: What is the capital") and text.endswith("assistant:")
    assert out[0].prompt_token_ids == ids
    assert token_ids(out) == token_ids(llm.generate(ids, GREEDY))


def test_no_template_is_a_clear_error_unless_one_is_given(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template.*chat_template"):
        llm.chat(CONV, GREEDY)
    assert llm.chat(CONV, SamplingParams(max_tokens=1), chat_template=TEMPLATE)[0].prompt_token_ids


@pytest.mark.parametrize("kwargs, match", [
    (dict(lora_request=object()), "lora_request.*no LoRA"),
    (dict(mm_processor_kwargs={}), "mm_processor_kwargs.*text only"),
    (dict(chat_template_content_format="openai"), "chat_template_content_format='openai'.*'auto' or 'string'"),
    (dict(use_tqdm=True), "use_tqdm=True.*no progress bar"),
    (dict(chat_template_kwargs={"tools": []}), "chat_template_kwargs.tools"),
])
def test_refused_arguments(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(CONV, GREEDY, **kwargs)
    assert not llm.core.has_unfinished_requests()


@pytest.mark.parametrize("message, param", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages[1].content[0].type"),
    ({"role": "bot", "content": "hi"}, "messages[1].role"),
    ({"role": "user"}, "messages[1].content"),
    ({"role": "user", "content": 3}, "messages[1].content"),
])
def test_refused_messages_name_the_conversation_and_field(llm, message, param):
    with pytest.raises(ChatInputError, match=r"^conversation 1: ") as e:
        llm.chat([CONV, CONV + [message]], GREEDY)
    assert e.value.param == param
    assert not llm.core.has_unfinished_requests()


def test_chat_accepts_vllm_defaults(llm):
    out = llm.chat(CONV, SamplingParams(max_tokens=1), use_tqdm=False, lora_request=None,
                   chat_template_content_format="string", mm_processor_kwargs=None)
    assert len(out) == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(lora_request=object()), "LLM.generate does not support: lora_request.*no LoRA"),
    (dict(use_tqdm=True), "LLM.generate does not support: use_tqdm=True.*no progress bar"),
])
def test_generate_takes_vllm_defaults_and_refuses_the_rest(llm, kwargs, match):
    """Ported vLLM calls pass use_tqdm / lora_request to generate too (a new user's report: a TypeError before)."""
    with pytest.raises(ValueError, match=match):
        llm.generate(["hi"], GREEDY, **kwargs)
    assert not llm.core.has_unfinished_requests()
    out = llm.generate(["hi"], SamplingParams(max_tokens=1), use_tqdm=False, lora_request=None)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 1


@pytest.mark.parametrize("messages", ["hello", ["hello", "again"]])
def test_text_instead_of_messages_says_what_a_conversation_is(llm, messages):
    with pytest.raises(ValueError, match=r"takes messages, not text.*\[\{'role': 'user', 'content': 'hello'\}\]"):
        llm.chat(messages, GREEDY)

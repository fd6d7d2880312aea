"""The converted GGUF copy (ladle.models.gguf_cache) must change nothing but load time."""

from __future__ import annotations

import os

import pytest
import torch

from ladle.config import ModelConfig
from ladle.models import gguf_cache
from ladle.models.gguf import iter_gguf_tensors
from ladle.models.loader import checkpoint_tensors, default_model_path, resolve_model_source


@pytest.fixture(scope="module")
def source():
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return resolve_model_source(ModelConfig())


def test_converted_weights_are_bit_identical(source):
    assert source.converted_dir and os.path.isfile(os.path.join(source.converted_dir, gguf_cache.WEIGHTS_FILE))
    _, converted = checkpoint_tensors(source)
    converted = dict(converted)
    count, direct = iter_gguf_tensors(source.path)
    seen = 0
    for name, tensor in direct:
        assert torch.equal(converted[name], tensor), name
        seen += 1
    assert seen == count == len(converted)


def test_converted_tokenizer_matches_the_gguf_one(source):
    from transformers import AutoTokenizer

    from ladle.engine.tokenizer import load_tokenizer

    ours = load_tokenizer(source.tokenizer_path, source.tokenizer_gguf_file)
    ref = AutoTokenizer.from_pretrained(os.path.dirname(source.path), gguf_file=os.path.basename(source.path))
    for text in ["Hello world", "  two  spaces\n\nand 日本語 🙂", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours(text).input_ids == ref(text).input_ids
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token_id, ours.bos_token_id) == (ref.eos_token_id, ref.bos_token_id)


def test_key_changes_with_the_file(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc")
    k1 = gguf_cache.cache_key(str(f))
    f.write_bytes(b"abcd")  # different content -> different key
    assert gguf_cache.cache_key(str(f)) != k1
    assert gguf_cache.cached_dir(str(f)) is None
    twin = tmp_path / "elsewhere" / "m.gguf"  # same content in another place (another clone) -> same copy
    twin.parent.mkdir()
    twin.write_bytes(b"abcd")
    assert gguf_cache.cache_key(str(twin)) == gguf_cache.cache_key(str(f))

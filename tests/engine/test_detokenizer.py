"""Incremental detokenizer with the real SmolLM2 tokenizer (byte-level BPE: CJK and emoji split mid-character)."""

from __future__ import annotations

from ladle.engine.detokenizer import IncrementalDetokenizer

PROMPT = "Say something:"


def _stream(tok, text, **kw):
    """Feed `text`'s tokens one at a time; returns (deltas, detokenizer)."""
    ids = tok(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, tok(PROMPT).input_ids, **kw)
    deltas = []
    for i, t in enumerate(ids):
        deltas.append(detok.update([t], finished=(i == len(ids) - 1 and not kw.get("stop"))))
        if detok.stop_reason is not None:
            break
    return ids, deltas, detok


def test_multibyte_deltas_concatenate_without_replacement_chars(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = "Tokyo 東京 is big 🚀🎉 — naïve café; 한국어 テスト 👩‍👩‍👧 end"
    ids, deltas, detok = _stream(tok, text)
    assert any(len(tok.decode([i])) and "\ufffd" in tok.decode([i]) for i in ids), "text must split a character"
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == detok.output_text
    assert "".join(deltas) == text


def test_stop_string_split_over_tokens_never_leaks(smollm2_tokenizer):
    tok = smollm2_tokenizer
    stop = "STOPWORD"
    text = "alpha beta STOPWORD gamma delta"
    ids = tok(text, add_special_tokens=False).input_ids
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces), "the stop string must span several tokens"
    ids, deltas, detok = _stream(tok, text, stop=[stop])
    assert detok.stop_reason == stop
    assert "".join(deltas) == "alpha beta "
    for k in range(1, len(stop) + 1):  # no prefix of the stop string leaks in any delta or the tail
        assert not "".join(deltas).endswith(stop[:k])
    assert all(stop[:2] not in d for d in deltas)


def test_held_text_is_released_when_match_fails(smollm2_tokenizer):
    tok = smollm2_tokenizer
    stop = "Hello world!"
    text = "He said Hello wor and left."
    ids = tok(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, tok(PROMPT).input_ids, stop=[stop])
    released, held_seen = "", False
    for t in ids:
        released += detok.update([t])
        decoded_so_far = tok.decode(ids[:ids.index(t) + 1])
        if len(released) < len(decoded_so_far):
            held_seen = True
            assert stop.startswith(decoded_so_far[len(released):].lstrip(" ")[:1] or "H")
    released += detok.update([], finished=True)
    assert held_seen, "some text should have been held while it could start the stop string"
    assert released == text and detok.stop_reason is None


def test_include_stop_str_and_multiple_stops(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids, deltas, detok = _stream(tok, "one two three four five", stop=["four", "two three"],
                                 include_stop_str_in_output=True)
    assert detok.stop_reason == "two three"
    assert "".join(deltas) == "one two three"


def test_skip_special_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok("Hi there", add_special_tokens=False).input_ids + [end]
    for skip, expect in ((True, "Hi there"), (False, "Hi there<|im_end|>")):
        detok = IncrementalDetokenizer(tok, [1, 2], skip_special_tokens=skip)
        text = "".join(detok.update([t]) for t in ids) + detok.update([], finished=True)
        assert text == expect


def test_stop_strings_wait_for_min_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = "one two one two three"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == 5
    detok = IncrementalDetokenizer(tok, [1], stop=["two"], min_tokens=3)
    out = ""
    for t in ids:
        out += detok.update([t])
        if detok.stop_reason:
            break
    assert detok.stop_reason == "two" and out == "one two one "


def test_single_token_cache_gives_the_same_deltas(smollm2_tokenizer):
    """OutputProcessor shares a token id -> text cache between sequences (one decode per step becomes a lookup):
    fresh random ids (multi-byte splits, specials) and stop strings give exactly the deltas of the uncached path."""
    import random

    tok = smollm2_tokenizer
    rng = random.Random()
    vocab = len(tok)
    for skip in (True, False):
        cache: dict[int, str] = {}
        for _ in range(6):
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))]
            ids = [rng.randrange(vocab) if rng.random() < 0.7 else rng.randrange(50) for _ in range(60)]
            kw = dict(stop=("e t", "zz"), skip_special_tokens=skip)
            plain, cached = IncrementalDetokenizer(tok, prompt, **kw), IncrementalDetokenizer(
                tok, prompt, single_token_texts=cache, **kw)
            i = 0
            while i < len(ids):  # one token per step mostly, sometimes two (a window of two: no lookup)
                step = ids[i:i + rng.choice((1, 1, 1, 2))]
                i += len(step)
                assert cached.update(step, finished=i >= len(ids)) == plain.update(step, finished=i >= len(ids))
            assert cached.output_text == plain.output_text and cached.stop_reason == plain.stop_reason
        assert cache  # the lookups happened

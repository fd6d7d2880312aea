"""Synthetic tokenizer + M3 chat template for generated MiniMax-M3 checkpoints.

A byte-level BPE whose vocabulary covers exactly `vocab_size` ids, so every id a random model can emit decodes:
256 byte tokens, the M3 special tokens at fixed ids, and deterministic merges (common-character pairs first) to
fill the rest. Built with the `tokenizers` library only (no transformers at run time).

Chat template: design/minimax_m3.md §4.1 (BOS `]~!b[` once, role markers `]~b]system` / `]~b]developer` /
`]~b]user` / `]~b]ai` / `]~b]tool`, end of turn `[e~[`, generation prompt `]~b]ai\\n` plus the thinking-mode
prefix: enabled → `<mm:think>`, disabled → `</mm:think>`, adaptive (default) → nothing). The verbatim release
template was not available (spec §6.1); the fixed system text here is a short stand-in.
"""

from __future__ import annotations

import json
import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

BOS, EOS = "]~!b[", "[e~["
SPECIALS = [BOS, EOS, "<mm:think>", "</mm:think>", "]<]minimax[>[", "]<]image[>[", "]<]video[>[",
            "]<]start of image[>[", "]<]end of image[>[", "]<]pad[>["]
# Real ids where known (spec §1.3); the rest are placed just after the highest known id.
RELEASE_IDS = {BOS: 200034, EOS: 200020, "]<]image[>[": 200025, "]<]video[>[": 200026, "<mm:think>": 200059,
               "</mm:think>": 200060}

# Every literal goes through {{ }} so whitespace control ({%- -%}) never eats a newline.
CHAT_TEMPLATE = (
    "{%- set mode = thinking_mode | default('adaptive') -%}"
    "{%- set ns = namespace(dev='You are a helpful assistant.', start=0) -%}"
    "{%- if messages and messages[0]['role'] in ['system', 'developer'] -%}"
    "{%- set ns.start = 1 -%}"
    "{%- if messages[0]['content'] is string -%}{%- set ns.dev = messages[0]['content'] -%}"
    "{%- else -%}{%- set ns.dev = messages[0]['content'] | map(attribute='text') | join('') -%}{%- endif -%}"
    "{%- endif -%}"
    "{{- ']~!b[]~b]system\\nYou are MiniMax-M3 (synthetic test checkpoint).\\n<thinking_instructions>Reason "
    "inside <mm:think></mm:think> when useful. Current mode: ' + mode + '.</thinking_instructions>[e~[\\n' -}}"
    "{{- ']~b]developer\\n' + ns.dev -}}"
    "{%- if tools -%}{{- '\\n\\n# Tools' -}}{%- for t in tools -%}{{- '\\n<tool>' + (t | tojson) + '</tool>' -}}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '[e~[\\n' -}}"
    "{%- for m in messages[ns.start:] -%}"
    "{%- if m['content'] is string -%}{%- set text = m['content'] -%}"
    "{%- elif m['content'] -%}{%- set text = m['content'] | map(attribute='text') | join('') -%}"
    "{%- else -%}{%- set text = '' -%}{%- endif -%}"
    "{%- set role = {'user': 'user', 'assistant': 'ai', 'tool': 'tool'}.get(m['role'], m['role']) -%}"
    "{{- ']~b]' + role + '\\n' + text -}}"
    "{%- if m['role'] == 'assistant' and m.get('tool_calls') -%}"
    "{{- ']<]minimax[>[<tool_call>\\n' -}}"
    "{%- for c in m['tool_calls'] -%}{%- set f = c['function'] if 'function' in c else c -%}"
    "{{- ']<]minimax[>[<invoke name=\"' + f['name'] + '\">\\n' -}}"
    "{%- if f['arguments'] is mapping -%}{%- for k, v in f['arguments'].items() -%}"
    "{{- ']<]minimax[>[<' + k + '>' + (v | string) + ']<]minimax[>[</' + k + '>\\n' -}}{%- endfor -%}"
    "{%- else -%}{{- f['arguments'] ~ '\\n' -}}{%- endif -%}"
    "{{- ']<]minimax[>[</invoke>\\n' -}}{%- endfor -%}"
    "{{- ']<]minimax[>[</tool_call>' -}}"
    "{%- endif -%}"
    "{{- '[e~[\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- ']~b]ai\\n' -}}"
    "{%- if mode == 'enabled' -%}{{- '<mm:think>' -}}{%- elif mode == 'disabled' -%}{{- '</mm:think>' -}}{%- endif -%}"
    "{%- endif -%}"
)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable Latin-1 bytes map to themselves, the other 68 to chr(256 + n)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def special_ids(vocab_size: int, bos_id: int, eos_id: int) -> dict[str, int]:
    """Where each special token lives. bos/eos as configured; the others next to them (small vocabs) or at
    their release ids (full-size vocabs)."""
    if vocab_size > 200060 and (bos_id, eos_id) == (RELEASE_IDS[BOS], RELEASE_IDS[EOS]):
        ids, nxt = dict(RELEASE_IDS), 200021
    else:
        ids, nxt = {BOS: bos_id, EOS: eos_id}, 0
    for tok in SPECIALS:
        if tok not in ids:
            while nxt in ids.values():
                nxt += 1
            ids[tok] = nxt
            nxt += 1
    assert max(ids.values()) < vocab_size, f"vocab {vocab_size} too small for the special tokens"
    return ids


def _merges(alphabet: list[str], count: int) -> list[tuple[str, str]]:
    """`count` deterministic merges, level by level: (token of length L, common char) pairs, most common first."""
    common = "Ġetaoinsrhldcumfpgwybvkxjqz.,'-ETAISONRHLDCMBPFGW0123456789:;!?()\"Ċ"
    chars = [c for c in common if c in alphabet] + [c for c in alphabet if c not in common]
    rank = {c: i for i, c in enumerate(chars)}
    merges: list[tuple[str, str]] = []
    prev = chars
    while len(merges) < count:
        cands = sorted(((i + rank[c], i, x, c) for i, x in enumerate(prev) for c in chars[:96]))
        cands = cands[: count - len(merges)]
        merges.extend((x, c) for _, _, x, c in cands)
        prev = [x + c for _, _, x, c in cands]
    return merges


def build_tokenizer(vocab_size: int, bos_id: int, eos_id: int) -> Tokenizer:
    """A byte-level BPE `Tokenizer` with exactly `vocab_size` ids (specials included)."""
    sp = special_ids(vocab_size, bos_id, eos_id)
    taken = set(sp.values())
    alphabet = [byte_to_unicode()[b] for b in range(256)]
    n_merge = vocab_size - len(sp) - len(alphabet)
    assert n_merge >= 0, f"vocab_size {vocab_size} below {len(sp) + 256}"
    merges = _merges(alphabet, n_merge)
    normal = alphabet + [a + b for a, b in merges]
    free_ids = (i for i in range(vocab_size) if i not in taken)
    vocab = {tok: next(free_ids) for tok in normal}
    vocab.update(sp)
    assert len(vocab) == vocab_size, "duplicate token strings in the synthetic vocabulary"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def write_tokenizer(out_dir: str, vocab_size: int, bos_id: int, eos_id: int, model_max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json (with chat_template), chat_template.jinja, special_tokens_map.json."""
    tok = build_tokenizer(vocab_size, bos_id, eos_id)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    sp = special_ids(vocab_size, bos_id, eos_id)
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": "]<]pad[>[",
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length, "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(i): {"content": s, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False} for s, i in sp.items()},
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": "]<]pad[>["}, f, indent=1)

"""Turning parsed flags into requests: tokenizer choice, dataset sampling, agentic sessions.

Tokenizer rule: a local tokenizer when `--tokenizer DIR` is given (or `--model` is a local directory with tokenizer
files), else the server's /tokenize and /detokenize. Agentic replay sends token ids and needs neither, only a
vocabulary size (local tokenizer, `--agentic-vocab-size`, /version, or the server tokenizer's discovery).
Runs synchronously (called through `asyncio.to_thread`).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import httpx

from ladle.bench import agentic, datasets
from ladle.bench.tokenizer import BenchTokenizer, LocalTokenizer, ServerTokenizer


@dataclass
class Workload:
    """requests: for random/sharegpt/custom; sessions: for agentic (requests is then empty)."""

    requests: list[datasets.SampleRequest] = field(default_factory=list)
    sessions: list[agentic.AgenticSession] = field(default_factory=list)
    tokenizer: BenchTokenizer | None = None
    tokenizer_id: str | None = None
    vocab_size: int | None = None
    info: dict[str, Any] = field(default_factory=dict)


def _local_tokenizer_path(args: argparse.Namespace) -> str | None:
    if args.tokenizer:
        return args.tokenizer
    m = args.model
    if m and os.path.isdir(m) and any(os.path.exists(os.path.join(m, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return m
    return None


def _server_tokenizer(base_url: str, model: str) -> ServerTokenizer | None:
    try:
        return ServerTokenizer(base_url, model)
    except (httpx.HTTPError, KeyError, ValueError) as e:
        served = _served_models(base_url)
        if served is not None and model not in served:  # the 404 was the model name's, not a missing /tokenize
            raise ValueError(f"--model {model}: the server does not serve it; it serves {', '.join(served)}") from e
        print(f"WARNING: the server's /tokenize is unavailable ({type(e).__name__}: {e})", file=sys.stderr)
        return None


def _served_models(base_url: str) -> list[str] | None:
    """The model ids of the server's /v1/models, or None when it cannot be read."""
    try:
        r = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=30)
        r.raise_for_status()
        return [m["id"] for m in r.json()["data"]]
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return None


def make_tokenizer(args: argparse.Namespace, base_url: str, model: str) -> tuple[BenchTokenizer | None, str | None]:
    path = _local_tokenizer_path(args)
    if path:
        return LocalTokenizer(path), path
    tok = _server_tokenizer(base_url, model)
    return tok, (f"server:{base_url}/tokenize" if tok else None)


def build_workload(args: argparse.Namespace, base_url: str, model: str, version: Any) -> Workload:
    """Raises ValueError for flag combinations that cannot produce a workload."""
    if args.dataset_name == "agentic":
        return _agentic(args, base_url, model, version)
    tok, tok_id = make_tokenizer(args, base_url, model)
    if tok is None:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --tokenizer DIR or a server with /tokenize")
    wl = Workload(tokenizer=tok, tokenizer_id=tok_id, vocab_size=tok.vocab_size)
    if args.dataset_name == "random":
        if args.dataset_path:
            raise ValueError("--dataset-name random takes no --dataset-path")
        wl.requests = datasets.sample_random(
            tok, args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
            args.random_prefix_len, args.seed, args.random_range_mode,
        )
        if isinstance(tok, LocalTokenizer):
            server_tok = _server_tokenizer(base_url, model)
            if server_tok is not None:
                wl.requests = datasets.align_to_server(server_tok, wl.requests)
        drawn_bounds = datasets.random_length_bounds(args.random_input_len, args.random_output_len,
                                                     args.random_range_ratio, tok.num_special_tokens_to_add,
                                                     args.random_range_mode)
        wl.info.update(range_mode=args.random_range_mode, num_special_tokens=tok.num_special_tokens_to_add,
                       length_bounds=dict(zip(("input_low", "input_high", "output_low", "output_high"),
                                              drawn_bounds)))
    elif args.dataset_name == "sharegpt":
        _need_path(args)
        wl.requests = datasets.sample_sharegpt(tok, args.dataset_path, args.num_prompts, args.sharegpt_output_len,
                                               args.seed, not args.no_oversample)
    elif args.dataset_name == "custom":
        _need_path(args)
        wl.requests = datasets.sample_custom(tok, args.dataset_path, args.num_prompts, args.custom_output_len,
                                             args.seed, not args.disable_shuffle, not args.skip_chat_template,
                                             not args.no_oversample)
    else:
        raise ValueError(f"unknown --dataset-name {args.dataset_name}")
    if not wl.requests:
        raise ValueError("the dataset produced no request")
    wl.info["prompt_len_mean"] = sum(r.prompt_len for r in wl.requests) / len(wl.requests)
    return wl


def _need_path(args: argparse.Namespace) -> None:
    if not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")


def _agentic(args: argparse.Namespace, base_url: str, model: str, version: Any) -> Workload:
    from ladle.bench.server_info import find_key  # the same recursive lookup as for block_size

    path = args.dataset_path or os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data",
                                             "agentic_traces")
    sessions = agentic.load_traces(path, args.num_prompts, args.agentic_length_scale, args.seed)
    local = _local_tokenizer_path(args)
    tok: BenchTokenizer | None = LocalTokenizer(local) if local else None
    vocab = args.agentic_vocab_size or (tok.vocab_size if tok else None) or find_key(version, "vocab_size")
    max_len = args.max_model_len or find_key(version, "max_model_len")
    if not vocab or not max_len:
        server_tok = _server_tokenizer(base_url, model)
        if server_tok is not None:
            vocab = vocab or server_tok.vocab_size
            max_len = max_len or server_tok.max_model_len
            tok = tok or server_tok
    if not vocab:
        vocab = 32000
        print("WARNING: vocabulary size unknown; agentic token ids drawn below 32000", file=sys.stderr)
    dropped = agentic.apply_max_model_len(sessions, max_len)
    salt = args.agentic_salt if args.agentic_salt is not None else random.SystemRandom().randrange(1 << 31)
    return Workload(sessions=sessions, tokenizer=tok, tokenizer_id=local, vocab_size=int(vocab),
                    info={"max_model_len": max_len, "num_dropped_too_long": dropped, "salt": salt,
                          "trace_path": os.path.abspath(path)})

"""A minimal paged-cache driver for running a model without the engine (tests, notebooks, quick checks).

It does what the runner does, in the smallest form: allocate K/V/index-K caches from `kv_cache_specs()`, hand
out physical blocks (in a shuffled order, so logical != physical ids and a block-table bug shows), build an
`AttentionMetadata` for a step of (sequence, new tokens) chunks, and run `forward` + `compute_logits` inside a
forward context. Prefill, chunked prefill, decode and prefix sharing are all just steps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

import torch

from ladle.layers.attention.metadata import AttentionMetadata, ForwardContext, LayerKVCache, OpBackends, set_forward_context


@dataclass
class _Seq:
    tokens: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0


class PagedDriver:
    """Caches + block allocator for one model. Block 0 is the null block and is never handed out."""

    def __init__(self, model, num_blocks: int, block_size: int | None = None, seed: int = 0,
                 backends: Optional[OpBackends] = None, kv_cache_dtype: Optional[torch.dtype] = None):
        """kv_cache_dtype: the K/V and index-K cache dtype (default the model's; FP8 with scales 1.0)."""
        self.model = model
        self.backends = backends or OpBackends.reference()
        self.block_size = block_size or model.config.index_block_size
        dev, dt = model.device, kv_cache_dtype or model.dtype
        self.caches = []
        for s in model.kv_cache_specs():
            shape = (num_blocks, self.block_size, s.num_kv_heads, s.head_dim)
            ik = torch.zeros(num_blocks, self.block_size, s.index_head_dim, dtype=dt, device=dev) \
                if s.index_head_dim else None
            self.caches.append(LayerKVCache(torch.zeros(shape, dtype=dt, device=dev),
                                            torch.zeros(shape, dtype=dt, device=dev), ik))
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.seqs: dict[object, _Seq] = {}

    def add(self, seq_id: object) -> None:
        self.seqs[seq_id] = _Seq()

    def share_prefix(self, dst: object, src: object, num_tokens: int) -> int:
        """Give `dst` the whole blocks of `src` covering its first `num_tokens` tokens (a prefix-cache hit).
        Returns the number of tokens now cached for dst (a multiple of the block size)."""
        s, n_blocks = self.seqs[src], num_tokens // self.block_size
        d = self.seqs.setdefault(dst, _Seq())
        assert not d.tokens, "share_prefix into a fresh sequence only"
        d.block_ids = list(s.block_ids[:n_blocks])
        d.tokens = list(s.tokens[: n_blocks * self.block_size])
        d.num_computed = len(d.tokens)
        return d.num_computed

    def _metadata(self, chunks: list[tuple[object, list[int]]]) -> tuple[AttentionMetadata, torch.Tensor]:
        bs, dev = self.block_size, self.model.device
        qsl, seq_lens, ctx_lens, slots, positions, ids, tables = [0], [], [], [], [], [], []
        for seq_id, new in chunks:
            s = self.seqs.setdefault(seq_id, _Seq())
            assert s.num_computed == len(s.tokens), "feed every token exactly once, in order"
            start = s.num_computed
            s.tokens.extend(new)
            while len(s.block_ids) * bs < len(s.tokens):
                s.block_ids.append(self.free.pop())
            for p in range(start, len(s.tokens)):
                slots.append(s.block_ids[p // bs] * bs + p % bs)
                positions.append(p)
            ids.extend(new)
            qsl.append(qsl[-1] + len(new))
            seq_lens.append(len(s.tokens))
            ctx_lens.append(start)
            tables.append(list(s.block_ids))
            s.num_computed = len(s.tokens)
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        md = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, **i32), seq_lens=torch.tensor(seq_lens, **i32),
            context_lens=torch.tensor(ctx_lens, **i32), block_table=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev), block_size=bs,
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])), max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, context_lens_cpu=ctx_lens, num_actual_tokens=qsl[-1])
        return md, torch.tensor(ids, dtype=torch.int64, device=dev)

    def step(self, chunks: list[tuple[object, list[int]]], record_selection: bool = False,
             ) -> tuple[torch.Tensor, dict]:
        """Run one forward over the given (seq_id, new token ids) chunks.

        Returns (logits [T, vocab] float32 for every new token in chunk order, the forward context's extras).
        """
        md, input_ids = self._metadata(chunks)
        ctx = ForwardContext(attn_metadata=md, kv_caches=self.caches, backends=self.backends,
                             extras={"record_msa_selection": record_selection})
        with set_forward_context(ctx):
            hidden = self.model.forward(input_ids, md.positions)
            logits = self.model.compute_logits(hidden)
        return logits, ctx.extras

    def prefill(self, seq_id: object, tokens: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """(Chunked) prefill of a new or partially cached sequence; returns logits [len(tokens), vocab]."""
        if seq_id not in self.seqs:
            self.add(seq_id)
        step = chunk_size or max(1, len(tokens))
        outs = [self.step([(seq_id, tokens[i:i + step])])[0] for i in range(0, len(tokens), step)]
        return torch.cat(outs)

    def greedy(self, prompts: dict[object, list[int]], max_new_tokens: int) -> dict[object, list[int]]:
        """Greedy continuations: one batched prefill step, then batched decode steps. Returns new tokens."""
        for sid in prompts:
            self.add(sid)
        logits, _ = self.step(list(prompts.items()))
        ends = torch.tensor([len(p) for p in prompts.values()]).cumsum(0) - 1
        nxt = logits[ends].argmax(-1).tolist()
        out = {sid: [t] for sid, t in zip(prompts, nxt)}
        for _ in range(max_new_tokens - 1):
            logits, _ = self.step([(sid, [out[sid][-1]]) for sid in prompts])
            for sid, t in zip(prompts, logits.argmax(-1).tolist()):
                out[sid].append(t)
        return out


def load_m3_dir(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Build a MiniMaxM3ForCausalLM from a checkpoint directory (config.json + *.safetensors), without the
    engine's loader, in the checkpoint's quant config as the loader builds it (FP8 / MXFP8 / MXFP4 kept as stored).
    Raises ValueError if a parameter is left unwritten."""
    import glob
    import json
    import os

    from safetensors.torch import load_file

    from ladle.config import ModelConfig
    from ladle.layers.quant_slot import quant_config_scope
    from ladle.models.minimax_m3 import MiniMaxM3ForCausalLM
    from ladle.quant.config import quant_config_of

    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    with quant_config_scope(quant_config_of(ModelConfig(), hf_config)):
        model = MiniMaxM3ForCausalLM(hf_config, dtype, device)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    loaded = model.load_weights(kv for fn in files for kv in load_file(fn).items())
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"{path}: parameters not written by the checkpoint: {sorted(missing)[:5]}")
    return model

"""ModelRunner: loads the model, sizes and allocates the KV cache, and executes one step.

execute(SchedulerOutput) -> RunnerOutput:
    update per-request state (new / finished / preempted) -> build inputs (input_batch.py) ->
    model.forward under set_forward_context -> logits at logits_indices -> sampler ->
    ONE device->host copy (sampled ids, and logprobs packed into the same float32 buffer when asked).

KV capacity (ARCHITECTURE.md "Capacity and admission"): `--kv-cache-memory-bytes` when given (the CPU
default is filled in by config resolution); on CUDA otherwise a dummy forward at max_num_batched_tokens is
profiled and the cache gets `gpu_memory_utilization * total - (peak torch memory + non-torch memory)`.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Optional, Sequence

import torch

from ladle.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig
from ladle.core.outputs import RunnerOutput, ScheduledChunk, SchedulerOutput
from ladle.core.sampling_params import SamplingParams
from ladle.layers.attention.metadata import ForwardContext, set_forward_context
from ladle.runner.input_batch import BatchInputs, build_batch_inputs
from ladle.runner.kv_cache import (allocate_kv_caches, bytes_per_block, check_fits_max_model_len,
                                   num_blocks_for_bytes)
from ladle.runner.request_state import RequestState, build_sampling_tensors
from ladle.runner.sampler import Sampler, compute_logprobs, unpack_logprobs

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """Owns the model, the KV caches, the sampler and per-request sampling state.

    Args (all resolved: device/dtype/max_model_len/block_size concrete; see engine/config_resolve.py):
        model_config, cache_config, scheduler_config, runner_config: the engine's component configs.
        model: the loaded model (models/loader.py `load_model`), a CausalLM (models/interface.py).
        eos_token_ids: masked (with stop_token_ids) while a request has fewer than min_tokens outputs.
    Raises KVCacheTooSmall when one max_model_len sequence cannot fit the pool.
    """

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 runner_config: RunnerConfig, model: torch.nn.Module, eos_token_ids: Sequence[int] = ()) -> None:
        self.device = torch.device(model_config.device)
        self.dtype = _DTYPES[model_config.dtype]
        self.max_model_len = int(model_config.max_model_len)
        self.block_size = cache_config.block_size
        self.scheduler_config = scheduler_config
        self.runner_config = runner_config
        self.model = model
        self.eos_token_ids = tuple(eos_token_ids)
        self.kv_cache_specs = model.kv_cache_specs()
        self.sampler = Sampler(self.device, seed=model_config.seed)
        self.requests: dict[str, RequestState] = {}
        self.attn_backend = "triton" if self.device.type == "cuda" else "torch"

        capacity = cache_config.kv_cache_memory_bytes
        if capacity is None:
            capacity = self._profile_available_bytes(cache_config.gpu_memory_utilization)
        self.kv_cache_bytes = int(capacity)
        self.num_blocks = num_blocks_for_bytes(self.kv_cache_specs, self.block_size, self.dtype, self.kv_cache_bytes)
        check_fits_max_model_len(self.num_blocks, self.block_size, self.max_model_len, self.kv_cache_bytes,
                                 on_gpu=self.device.type == "cuda" and cache_config.kv_cache_memory_bytes is None)
        self.kv_caches = allocate_kv_caches(self.kv_cache_specs, self.num_blocks, self.block_size, self.dtype,
                                            self.device)
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB, %d bytes/block)", self.num_blocks,
                    self.block_size, self.kv_cache_bytes / 2**20,
                    bytes_per_block(self.kv_cache_specs, self.block_size, self.dtype))
        self.graphs = self._maybe_capture_graphs()

    def _maybe_capture_graphs(self):
        """Decode CUDA graphs (ladle/runner/cuda_graph.py) on CUDA with the graph-safe Triton attention,
        unless --enforce-eager. None means every step runs eagerly."""
        if self.device.type != "cuda" or self.runner_config.enforce_eager or self.attn_backend != "triton":
            return None
        if importlib.util.find_spec("ladle.kernels.paged_attention") is None:
            logger.warning("no Triton paged attention kernel: CUDA graphs disabled")
            return None
        from ladle.runner.cuda_graph import CudaGraphRunner

        graphs = CudaGraphRunner(self.model, self.kv_caches, max_batch_size=self.scheduler_config.max_num_seqs,
                                 max_blocks_per_seq=-(-self.max_model_len // self.block_size),
                                 block_size=self.block_size, device=self.device, attn_backend=self.attn_backend)
        graphs.capture()
        return graphs

    # ---- capacity ----------------------------------------------------------------------------------

    def _profile_available_bytes(self, utilization: float) -> int:
        """CUDA only: run a dummy step at max_num_batched_tokens with a scratch cache, then
        KV bytes = utilization * total - (peak allocated by torch + memory used outside torch)."""
        assert self.device.type == "cuda", "KV capacity on CPU comes from --kv-cache-memory-bytes"
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        scratch_bytes = self._dummy_step(self.scheduler_config.max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch_bytes
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(self.device))
        torch.cuda.empty_cache()
        available = int(utilization * total - peak - non_torch)
        logger.info("memory profile: total %.2f GiB, peak torch %.2f GiB, non-torch %.2f GiB -> KV %.2f GiB",
                    total / 2**30, peak / 2**30, non_torch / 2**30, available / 2**30)
        if available <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: {utilization} x {total} bytes minus {peak} bytes peak and "
                f"{non_torch} bytes outside torch is {available}; raise --gpu-memory-utilization or lower "
                f"--max-num-batched-tokens")
        return available

    @torch.inference_mode()
    def _dummy_step(self, num_tokens: int) -> int:
        """The worst step for memory: a forward over `num_tokens` prompt tokens (scratch KV cache), logits for
        min(max_num_seqs, num_tokens) rows, the sampler with penalties and every filter, 20 top logprobs.
        Returns the scratch cache's bytes (not part of the peak that the real cache must leave room for)."""
        chunks = self._dummy_chunks(num_tokens)
        num_scratch = 1 + sum(len(c.block_ids) for c in chunks)
        scratch = allocate_kv_caches(self.kv_cache_specs, num_scratch, self.block_size, self.dtype, self.device)
        batch = build_batch_inputs(chunks, self.block_size, self.device)
        hidden = self._forward(batch, scratch)
        n = min(self.scheduler_config.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:n])
        worst = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1, logprobs=20)
        states = [RequestState(f"profile-{i}", [0], [0], worst, i) for i in range(n)]
        tensors = build_sampling_tensors(states, [1] * n, logits.shape[1], self.device)
        compute_logprobs(logits, self.sampler.sample(logits, tensors), 20)
        return sum(t.numel() * t.element_size() for c in scratch
                   for t in (c.key_cache, c.value_cache, c.index_key_cache) if t is not None)

    def _dummy_chunks(self, num_tokens: int) -> list[ScheduledChunk]:
        """Split `num_tokens` into prefill chunks of at most max_model_len, scratch blocks numbered from 1."""
        chunks, next_block, left, i = [], 1, num_tokens, 0
        while left > 0:
            q = min(left, self.max_model_len)
            nb = -(-q // self.block_size)
            chunks.append(ScheduledChunk(f"profile-{i}", [0] * q, 0, list(range(next_block, next_block + nb)), True))
            next_block, left, i = next_block + nb, left - q, i + 1
        return chunks

    # ---- step --------------------------------------------------------------------------------------

    def _forward(self, batch: BatchInputs, kv_caches) -> torch.Tensor:
        """hidden states [T, H]: a CUDA-graph replay for eligible decode steps, else eager."""
        graphs = getattr(self, "graphs", None)
        if graphs is not None and kv_caches is self.kv_caches and graphs.can_run(batch.attn_metadata):
            return graphs.run(batch.input_ids, batch.positions, batch.attn_metadata)
        ctx = ForwardContext(attn_metadata=batch.attn_metadata, kv_caches=kv_caches, attn_backend=self.attn_backend)
        with set_forward_context(ctx):
            return self.model(batch.input_ids, batch.positions)

    def _update_states(self, out: SchedulerOutput) -> None:
        for rid in out.finished_request_ids:
            self.requests.pop(rid, None)
        for rid in out.preempted_request_ids:
            self.requests.pop(rid, None)
        for new in out.new_requests:
            self.requests[new.request_id] = RequestState.from_new(new, self.eos_token_ids, self.sampler.draw_seed())

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step. Returns sampled tokens for sample=True chunks, logprobs when requested.

        Raises whatever the model raises; the engine then fails this step's requests. Per-request state is
        only changed (token appended) after the host copy succeeded.
        """
        self._update_states(scheduler_output)
        chunks = scheduler_output.chunks
        if not chunks:
            return RunnerOutput()
        for c in chunks:
            assert c.request_id in self.requests, f"runner has no state for {c.request_id}"
        batch = build_batch_inputs(chunks, self.block_size, self.device)
        hidden = self._forward(batch, self.kv_caches)  # [T, H]
        if not batch.logits.num_logits_per_req or sum(batch.logits.num_logits_per_req) == 0:
            return RunnerOutput()
        logits = self.model.compute_logits(hidden[batch.logits.logits_indices])  # [num_logits, V] float32
        return self._sample(chunks, batch, logits)

    def _sample(self, chunks: list[ScheduledChunk], batch: BatchInputs, logits: torch.Tensor) -> RunnerOutput:
        layout = batch.logits
        sample_chunks = [c for c in chunks if c.sample]
        states = [self.requests[c.request_id] for c in sample_chunks]
        packs: list[torch.Tensor] = []
        sampled = None
        num_top = 0
        if sample_chunks:
            rows = logits[torch.tensor(layout.sample_rows, device=logits.device)]
            positions = [c.start_position + len(c.token_ids) for c in sample_chunks]
            tensors = build_sampling_tensors(states, positions, logits.shape[1], self.device)
            sampled = self.sampler.sample(rows, tensors)
            want = [s.sampling_params.logprobs is not None for s in states]
            if any(want):
                num_top = max(s.sampling_params.logprobs or 0 for s in states)
                packs.append(compute_logprobs(rows, sampled, num_top).flatten())
        prompt_specs = self._prompt_logprob_specs(chunks, layout.prompt_rows)
        for _, first, count, targets, k in prompt_specs:
            target_t = torch.tensor(targets, dtype=torch.int64).to(self.device)
            packs.append(compute_logprobs(logits[first:first + count], target_t, k).flatten())
        if packs:
            ids_f = sampled.to(torch.float32) if sampled is not None else logits.new_zeros(0)
            flat = torch.cat([ids_f] + packs).tolist()  # the one device->host copy
            ids = [int(x) for x in flat[:len(sample_chunks)]]
            rest = flat[len(sample_chunks):]
        else:
            ids = sampled.tolist() if sampled is not None else []  # the one device->host copy
            rest = []
        out = RunnerOutput()
        pos = 0
        if sample_chunks and any(s.sampling_params.logprobs is not None for s in states):
            width = 3 + 2 * num_top
            for j, (c, s) in enumerate(zip(sample_chunks, states)):
                if s.sampling_params.logprobs is not None:
                    out.logprobs[c.request_id] = unpack_logprobs(rest[j * width:(j + 1) * width],
                                                                 s.sampling_params.logprobs)
            pos = width * len(sample_chunks)
        for rid, _, count, _, k in prompt_specs:
            width = 3 + 2 * k
            out.prompt_logprobs[rid] = [unpack_logprobs(rest[pos + r * width:pos + (r + 1) * width], k)
                                        for r in range(count)]
            pos += width * count
        for c, s, token in zip(sample_chunks, states, ids):
            out.sampled_token_ids[c.request_id] = token
            s.output_token_ids.append(token)
        return out

    def _prompt_logprob_specs(self, chunks, prompt_rows) -> list[tuple[str, int, int, list[int], int]]:
        """(request_id, first logits row, count, target token ids, num_top) per chunk with prompt logprobs.
        The target of fed position p is the prompt token at p + 1."""
        specs = []
        for i, (first, count) in prompt_rows.items():
            c = chunks[i]
            state = self.requests[c.request_id]
            targets = [state.token_at(c.start_position + r + 1) for r in range(count)]
            specs.append((c.request_id, first, count, targets, state.sampling_params.prompt_logprobs or 0))
        return specs

    # ---- introspection -----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> Optional[int]:
        return getattr(self.model, "vocab_size", None)

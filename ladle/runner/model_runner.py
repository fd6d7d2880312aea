"""ModelRunner: loads the model, sizes and allocates the KV cache, and executes one step.

execute(SchedulerOutput) -> RunnerOutput (ladle/core/outputs.py, the step contract) = wait(launch(SchedulerOutput)):
    launch: update per-request state (new / finished / preempted) -> build inputs from the ScheduledChunks
    (input_batch.py: token ids, positions, AttentionMetadata) -> fill placeholder tokens on the device from the
    previous launched step's sampled ids -> model.forward under set_forward_context(ForwardContext(metadata, KV
    caches, OpBackends)) or a CUDA-graph replay -> logits at logits_indices -> sampler -> start ONE device->host
    copy (sampled ids, and logprobs packed into the same float32 buffer when asked) -> a LaunchedStep;
    wait: the copy done, tokens appended to the request states -> RunnerOutput (launched_step.py).
Asynchronous scheduling (EngineCore) launches step N+1 before waiting for step N; placeholders of step N+1 always
refer to the step launched just before it.

Op backends (`--attention-backend`, `--moe-backend`, `--fused-norms`) and the CUDA graph sizes come resolved in
RunnerConfig (ladle/runner/op_backends.py); `self.backends` is the one OpBackends every forward context carries.

Per-step host work is kept proportional to what changed: each live request owns a row of a persistent host
block table that only gets its new block ids appended; the per-request sampling parameters go to the device
once per batch composition (cached by the requests' state serials) and only positions change per step; a
decode step that samples every request computes logits from the hidden states without a gather.

KV capacity (ARCHITECTURE.md "Capacity and admission"): `--kv-cache-memory-bytes` when given (the CPU
default is filled in by config resolution); on CUDA otherwise a dummy forward at max_num_batched_tokens is
profiled and the cache gets `gpu_memory_utilization * total - (peak torch memory + non-torch memory)`. Under tensor
parallelism each rank sizes its own pool and all take the minimum over ranks (the scheduler has one block pool).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ladle.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig
from ladle.core.outputs import RunnerOutput, ScheduledChunk, SchedulerOutput
from ladle.core.sampling_params import SamplingParams
from ladle.distributed.parallel_state import all_reduce_min_int
from ladle.layers.attention.metadata import ForwardContext, set_forward_context
from ladle.runner.input_batch import BatchInputs, build_batch_inputs, table_width, to_device
from ladle.runner.kv_cache import (allocate_kv_caches, bytes_per_block, check_fits_max_model_len,
                                   kv_cache_torch_dtype, num_blocks_for_bytes)
from ladle.runner.launched_step import LaunchedStep
from ladle.runner.op_backends import op_backends
from ladle.runner.request_state import RequestState, StaticSampling, build_sampling_tensors, build_static_sampling
from ladle.runner.sampler import Sampler, compute_logprobs
from ladle.runner.warmup import step_chunks, warm_up_kernels

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """Owns the model, the KV caches, the sampler and per-request sampling state.

    Args (all resolved: device/dtype/max_model_len/block_size concrete; see engine/config_resolve.py):
        model_config, cache_config, scheduler_config, runner_config: the engine's component configs; runner_config
            as returned by `ladle.runner.op_backends.resolve_runner_config` (concrete backends, the CUDA graph
            sizes to capture, empty for none).
        model: the loaded model (models/loader.py `load_model`), a CausalLM (models/interface.py).
        eos_token_ids: masked (with stop_token_ids) while a request has fewer than min_tokens outputs.
        record_step_events: `launch` records each step's CUDA timing events (LaunchedStep.begin_event / done_event,
            None off CUDA). Their one reader is EngineCore's "device_idle" under asynchronous scheduling with the
            runner in process (engine_factory asks for them there); off by default, e.g. in synchronous mode and on
            tensor-parallel ranks, where nobody reads them and each step would pay for two event records.
    Raises KVCacheTooSmall when one max_model_len sequence cannot fit the pool.
    """

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 runner_config: RunnerConfig, model: torch.nn.Module, eos_token_ids: Sequence[int] = (),
                 record_step_events: bool = False) -> None:
        self.device = torch.device(model_config.device)
        self.dtype = _DTYPES[model_config.dtype]
        self.max_model_len = int(model_config.max_model_len)
        self.block_size = cache_config.block_size
        self.scheduler_config = scheduler_config
        self.runner_config = runner_config
        self.model = model
        self.eos_token_ids = tuple(eos_token_ids)
        self.record_step_events = record_step_events
        self.kv_cache_specs = model.kv_cache_specs()
        self.kv_dtype = kv_cache_torch_dtype(cache_config.kv_cache_dtype, self.dtype)  # --kv-cache-dtype
        scales = getattr(model, "kv_cache_scales", None)  # per layer (k_scale, v_scale) from the checkpoint
        self.kv_scales = scales() if callable(scales) and self.kv_dtype != self.dtype else None
        self.sampler = Sampler(self.device, seed=model_config.seed)
        self.requests: dict[str, RequestState] = {}
        # Persistent host block table: one row per live request, written incrementally (block lists only grow
        # while the runner holds a request's state), gathered per step. Padding entries are 0 (null block).
        self._block_table_cpu = np.zeros((max(1, scheduler_config.max_num_seqs), self._max_table_width()), np.int32)
        self._free_rows = list(range(self._block_table_cpu.shape[0] - 1, -1, -1))
        # (serials of the sampling rows, their StaticSampling, max top logprobs or None when none asked)
        self._static_cache: Optional[tuple[tuple[int, ...], StaticSampling, Optional[int]]] = None
        self.backends = op_backends(runner_config)  # in every ForwardContext this runner builds
        self.graphs = None  # captured last, after the profiling forward
        self._last_step: Optional[LaunchedStep] = None  # the latest launch: the source of the next placeholders

        capacity = cache_config.kv_cache_memory_bytes
        if capacity is None:
            capacity = self._profile_available_bytes(cache_config.gpu_memory_utilization)
        self.kv_cache_bytes = int(capacity)
        self.num_blocks = num_blocks_for_bytes(self.kv_cache_specs, self.block_size, self.kv_dtype,
                                               self.kv_cache_bytes)
        # tensor parallelism: every rank holds the same blocks, so the pool is the smallest rank's (identity alone)
        self.num_blocks = all_reduce_min_int(self.num_blocks, self.device)
        check_fits_max_model_len(self.num_blocks, self.block_size, self.max_model_len, self.kv_cache_bytes,
                                 on_gpu=self.device.type == "cuda" and cache_config.kv_cache_memory_bytes is None)
        self.kv_caches = allocate_kv_caches(self.kv_cache_specs, self.num_blocks, self.block_size, self.kv_dtype,
                                            self.device, self.kv_scales)
        logger.info("KV cache: %d tokens in %d blocks x %d tokens (%s, %.1f MiB, %d bytes/block)",
                    (self.num_blocks - 1) * self.block_size, self.num_blocks, self.block_size, self.kv_dtype,
                    self.kv_cache_bytes / 2**20, bytes_per_block(self.kv_cache_specs, self.block_size, self.kv_dtype))
        self.graphs = self._maybe_capture_graphs()
        if self.device.type == "cuda":  # compile the served steps' Triton variants now (ladle/runner/warmup.py)
            steps, seconds = warm_up_kernels(self)
            logger.info("kernel warm-up: %d step shapes up to %d tokens in %.1f s", steps,
                        scheduler_config.max_num_batched_tokens, seconds)

    def _max_table_width(self) -> int:
        """Block-table columns of a max_model_len sequence, aligned as every step's table is (input_batch.py)."""
        return table_width(-(-self.max_model_len // self.block_size))

    def _maybe_capture_graphs(self):
        """Decode CUDA graphs (ladle/runner/cuda_graph.py) for the resolved --cuda-graph-sizes (empty on CPU, with
        --enforce-eager, or with the TORCH attention backend, which is not graph-safe). None means every step runs
        eagerly."""
        sizes = self.runner_config.cuda_graph_sizes
        if not sizes or self.device.type != "cuda" or not self.backends.graph_safe:
            return None
        from ladle.runner.cuda_graph import CudaGraphRunner

        graphs = CudaGraphRunner(self.model, self.kv_caches, sizes=sizes,
                                 max_blocks_per_seq=self._max_table_width(),
                                 block_size=self.block_size, device=self.device, backends=self.backends)
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
        scratch = allocate_kv_caches(self.kv_cache_specs, num_scratch, self.block_size, self.kv_dtype, self.device)
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
        full, rest = divmod(num_tokens, self.max_model_len)
        step = [(0, self.max_model_len)] * full + ([(0, rest)] if rest else [])
        return step_chunks(step, self.block_size, prefix="profile")

    # ---- step --------------------------------------------------------------------------------------

    def _forward(self, batch: BatchInputs, kv_caches) -> torch.Tensor:
        """hidden states [T, H]: a CUDA-graph replay for eligible decode steps, else eager."""
        graphs = self.graphs
        if graphs is not None and kv_caches is self.kv_caches and graphs.can_run(batch.attn_metadata):
            return graphs.run(batch.input_ids, batch.positions, batch.attn_metadata)
        ctx = ForwardContext(attn_metadata=batch.attn_metadata, kv_caches=kv_caches, backends=self.backends)
        with set_forward_context(ctx):
            return self.model(batch.input_ids, batch.positions)

    def _update_states(self, out: SchedulerOutput) -> None:
        for rid in out.finished_request_ids:
            self._drop_state(rid)
        for rid in out.preempted_request_ids:
            self._drop_state(rid)
        for new in out.new_requests:
            self._drop_state(new.request_id)
            self.requests[new.request_id] = RequestState.from_new(new, self.eos_token_ids, self.sampler.draw_seed())

    def _drop_state(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None and state.table_row >= 0:
            self._free_rows.append(state.table_row)

    def _take_row(self) -> int:
        """A zeroed row of the persistent block table. Rows of states dropped from `requests` without
        `_drop_state` (e.g. a step that raised before applying its finished ids) are reclaimed when the free
        list runs dry; the table grows beyond max_num_seqs rows only when that many states are live (tests
        driving the runner directly)."""
        table = self._block_table_cpu
        if not self._free_rows:
            used = {s.table_row for s in self.requests.values()}
            self._free_rows = [r for r in range(table.shape[0] - 1, -1, -1) if r not in used]
        if not self._free_rows:
            self._free_rows = list(range(2 * table.shape[0] - 1, table.shape[0] - 1, -1))
            self._block_table_cpu = np.concatenate([table, np.zeros_like(table)])
        row = self._free_rows.pop()
        self._block_table_cpu[row] = 0
        return row

    def _table_row(self, state: RequestState, block_ids: list[int]) -> int:
        """The state's row of the persistent block table, updated to `block_ids` (appending only the new
        ids; a list that shrank or whose last known id changed is rewritten whole)."""
        if state.table_row < 0:
            state.table_row, state.num_table_blocks, state.table_last_block = self._take_row(), 0, -1
        table = self._block_table_cpu
        n = len(block_ids)
        if n > table.shape[1]:
            table = self._block_table_cpu = np.concatenate(
                [table, np.zeros((table.shape[0], n - table.shape[1]), np.int32)], axis=1)
        row, have = state.table_row, state.num_table_blocks
        if n != have or (n and state.table_last_block != block_ids[-1]):
            if n < have or (have and state.table_last_block != block_ids[have - 1]):
                table[row] = 0
                have = 0
            table[row, have:n] = block_ids[have:]
            state.num_table_blocks, state.table_last_block = n, (block_ids[-1] if n else -1)
        return row

    def _prepare_inputs(self, chunks: list[ScheduledChunk], placeholder_chunks: list[int]) -> BatchInputs:
        requests, rows, width = self.requests, [], 0
        for c in chunks:
            state, block_ids = requests[c.request_id], c.block_ids
            n = len(block_ids)
            # the usual decode step leaves a row as it was: check that inline, without a call per request
            if not n or n != state.num_table_blocks or state.table_last_block != block_ids[-1] or state.table_row < 0:
                self._table_row(state, block_ids)
            rows.append(state.table_row)
            if n > width:  # gather only the used columns, not max_model_len's worth
                width = n
        placeholders = None
        if placeholder_chunks:
            last = self._last_step
            assert last is not None and last.sampled is not None, "placeholders without a launched step to fill them"
            ids = [chunks[i].request_id for i in placeholder_chunks]
            # the usual decode step feeds the previous step's sampled rows in their order
            placeholders = (placeholder_chunks,
                            np.arange(len(ids)) if ids == last.sample_ids else [last.row_of(rid) for rid in ids])
        table = self._block_table_cpu[rows, :table_width(width)]
        batch = build_batch_inputs(chunks, self.block_size, self.device, table, placeholders)
        if placeholders:  # on the device, stream-ordered after the step that samples them: no host round trip
            batch.input_ids.index_copy_(0, batch.placeholder_dst,
                                        self._last_step.sampled.index_select(0, batch.placeholder_src))
        return batch

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step synchronously (`wait(launch(scheduler_output))`). Returns sampled tokens for sample=True
        chunks, logprobs when requested.

        Raises whatever the model raises; the engine then fails this step's requests. Per-request state is
        only changed (token appended) after the host copy succeeded.
        """
        return self.wait(self.launch(scheduler_output))

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        """Queue one step on the device and start the copy of its results (module docstring); returns without
        waiting for the device. Placeholder chunks (`scheduler_output.placeholder_chunks`) take the tokens sampled
        by the previous launch. Raises whatever building inputs or the model raises."""
        self._update_states(scheduler_output)
        chunks = scheduler_output.chunks
        if not chunks:
            return LaunchedStep()
        for c in chunks:
            assert c.request_id in self.requests, f"runner has no state for {c.request_id}"
        begin = self._timing_event() if self.record_step_events else None  # before the step's first device work
        batch = self._prepare_inputs(chunks, scheduler_output.placeholder_chunks)
        hidden = self._forward(batch, self.kv_caches)  # [T, H]
        layout = batch.logits
        if layout.num_logits == 0:
            step = LaunchedStep()
        else:
            # a decode step sampling every request reads every token's hidden state, in order: no gather needed
            every_token = layout.every_token and hidden.shape[0] == layout.num_logits
            logits = self.model.compute_logits(hidden if every_token else hidden[layout.logits_indices])  # [L, V]
            step = self._sample(chunks, batch, logits)
        if self.record_step_events:
            step.begin_event, step.done_event = begin, self._timing_event()
        self._last_step = step
        return step

    def _timing_event(self) -> Any:
        """A CUDA timing event recorded now on the current stream (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wait(self, step: LaunchedStep) -> RunnerOutput:
        """Block until `step`'s results are on the host; append its tokens to the request states; its
        RunnerOutput."""
        return step.finish()

    def _sampling_tensors(self, states: list[RequestState], positions, vocab_size: int):
        """SamplingTensors for these rows; the per-composition part is reused while the batch's requests (the
        same state objects, in order) stay the same. Returns (tensors, max top logprobs or None)."""
        key = tuple([s.serial for s in states])  # a list comprehension is faster than a generator here
        if self._static_cache is None or self._static_cache[0] != key:
            wanted = [s.sampling_params.logprobs for s in states if s.sampling_params.logprobs is not None]
            self._static_cache = (key, build_static_sampling(states, vocab_size, self.device),
                                  max(wanted) if wanted else None)
        _, static, num_top = self._static_cache
        return build_sampling_tensors(states, positions, vocab_size, self.device, static), num_top

    def _sample(self, chunks: list[ScheduledChunk], batch: BatchInputs, logits: torch.Tensor) -> LaunchedStep:
        layout = batch.logits
        sample_chunks = chunks if len(layout.sample_rows) == len(chunks) else [c for c in chunks if c.sample]
        sample_ids = [c.request_id for c in sample_chunks]
        states = [self.requests[rid] for rid in sample_ids]
        packs: list[torch.Tensor] = []
        sampled = None
        num_top = None
        if sample_chunks:
            # without prompt-logprob rows the logits rows are exactly the sampling chunks', in order
            rows = logits
            if layout.prompt_rows:
                rows = logits[to_device(torch.tensor(layout.sample_rows, dtype=torch.int64), logits.device)]
            positions = layout.sample_positions
            if positions is None:
                positions = [c.start_position + len(c.token_ids) for c in sample_chunks]
            tensors, num_top = self._sampling_tensors(states, positions, logits.shape[1])
            sampled = self.sampler.sample(rows, tensors)
            if num_top is not None:
                packs.append(compute_logprobs(rows, sampled, num_top).flatten())
        prompt_specs = self._prompt_logprob_specs(chunks, layout.prompt_rows)
        for _, first, count, targets, k in prompt_specs:
            target_t = to_device(torch.tensor(targets, dtype=torch.int64), self.device)
            packs.append(compute_logprobs(logits[first:first + count], target_t, k).flatten())
        return LaunchedStep.start(sample_ids, states, sampled, packs, num_top,
                                  [(rid, count, k) for rid, _, count, _, k in prompt_specs])

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

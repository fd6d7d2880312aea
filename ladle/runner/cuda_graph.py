"""Decode CUDA graphs: one captured `model.forward` per batch-size bucket, static input buffers, padding.

Hook (ModelRunner; eager stays available and is the only path with --enforce-eager):

    self.graphs = None
    if runner_config.cuda_graph_sizes:              # resolved: empty on CPU, --enforce-eager, non-graph-safe backends
        self.graphs = CudaGraphRunner(self.model, self.kv_caches, sizes=runner_config.cuda_graph_sizes,
                                      max_blocks_per_seq=cdiv(max_model_len, block_size), block_size=block_size,
                                      device=self.device, backends=self.backends)
        self.graphs.capture()                       # after the KV caches exist; ~1-2 s per bucket
    ...
    md = batch.attn_metadata
    if self.graphs is not None and self.graphs.can_run(md):
        hidden = self.graphs.run(batch.input_ids, batch.positions, md)   # [B, hidden], valid until next run
    else:
        hidden = <eager forward under set_forward_context>

How a replay is made correct for any batch of B <= bucket decode requests: `run` copies the step's ids,
positions, slot_mapping, seq_lens, context_lens and block table into the first B rows of static buffers; rows
B..bucket-1 become padding (token 0, position 0, slot -1 so nothing is written to the cache, seq_len 0 so
attention returns zeros); query_start_loc is the constant arange (one query per request). Every kernel in the
captured forward must take its launch grid from shapes only and never read host mirrors (`*_cpu`) — true of the
Triton backend (ladle.kernels.paged_attention), not of the torch reference, hence the `OpBackends.graph_safe` condition.
The AttentionMetadata built for capture carries capture-time host mirrors; they are meaningless during replay.

Dispatch record: op "cuda_graph_decode", one `executed` per replay; ops inside the graph are counted only while
capturing (3 calls per bucket: the 2 warm-up runs and the capture), never per replay.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from ladle.layers.attention.metadata import AttentionMetadata, ForwardContext, OpBackends, set_forward_context
from ladle.observe import dispatch, op_timing

logger = logging.getLogger(__name__)

dispatch.register("cuda_graph_decode", "cuda_graph",
                  "cuda; decode-only step (max_query_len == 1); num_reqs <= largest captured bucket (--cuda-graph-sizes); "
                  "block table width <= max_blocks_per_seq; not --enforce-eager")


class CudaGraphRunner:
    """Captures and replays decode steps of `model` (a CausalLM: forward(input_ids [T], positions [T]) -> [T, H]).

    Args:
        model: the model; its forward reads metadata and caches through `get_forward_context()`.
        kv_caches: the runner's list of LayerKVCache (static tensors; captured by address).
        sizes: the batch sizes to capture (the buckets; the runner passes the resolved --cuda-graph-sizes); the
            largest sizes the static buffers.
        max_blocks_per_seq: block-table width of the static buffer (cdiv(max_model_len, block_size)).
        block_size: KV block size in tokens.
        device: the CUDA device.
        backends: the OpBackends written into the captured ForwardContext; must be graph-safe.
    """

    def __init__(self, model, kv_caches: list, *, sizes: Sequence[int], max_blocks_per_seq: int, block_size: int,
                 device: torch.device, backends: OpBackends) -> None:
        assert torch.device(device).type == "cuda", "CUDA graphs need a CUDA device"
        assert sizes and min(sizes) >= 1, f"batch sizes to capture must be positive: {sizes}"
        assert backends.graph_safe, f"backends {backends} cannot be captured"
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.device = torch.device(device)
        self.backends = backends
        self.buckets = sorted(set(int(s) for s in sizes))
        n = self.buckets[-1]
        dev = self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)  # [n] int64
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)  # [n] int64
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)  # [n] int64
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)  # [n] int32
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)  # [n] int32
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)  # [n+1] int32, constant
        self.block_table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)  # [n, max_blocks]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._pool = None

    # ---- capture -----------------------------------------------------------------------------------

    def _metadata(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bucket + 1], seq_lens=self.seq_lens[:bucket],
            context_lens=self.context_lens[:bucket], block_table=self.block_table[:bucket],
            slot_mapping=self.slot_mapping[:bucket], positions=self.positions[:bucket], block_size=self.block_size,
            max_query_len=1, max_seq_len=self.max_blocks * self.block_size,
            query_start_loc_cpu=list(range(bucket + 1)), seq_lens_cpu=[1] * bucket, context_lens_cpu=[0] * bucket,
            num_actual_tokens=bucket,
        )

    def _forward(self, bucket: int) -> torch.Tensor:
        ctx = ForwardContext(attn_metadata=self._metadata(bucket), kv_caches=self.kv_caches,
                             backends=self.backends)
        with set_forward_context(ctx):
            return self.model(self.input_ids[:bucket], self.positions[:bucket])

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiles the Triton kernels) and capture every bucket, largest first, in one memory pool.
        Capture-time inputs: one token per row at position 0 attending to itself in the null block 0, slot -1
        (no cache write). Call once, after the KV caches are allocated."""
        self.seq_lens.fill_(1)
        self.block_table.zero_()
        self.slot_mapping.fill_(-1)
        for bucket in reversed(self.buckets):
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(bucket)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._forward(bucket)
            self._pool = graph.pool()
            self.graphs[bucket] = graph
            self.outputs[bucket] = out
        torch.cuda.synchronize(self.device)
        self.seq_lens.zero_()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    # ---- replay ------------------------------------------------------------------------------------

    def bucket_for(self, num_reqs: int) -> Optional[int]:
        """Smallest captured bucket >= num_reqs, or None."""
        for b in self.buckets:
            if b >= num_reqs:
                return b
        return None

    def ineligible_reason(self, md: AttentionMetadata) -> Optional[str]:
        """The eligibility rule as code: None when a replay can serve this step."""
        if not self.graphs:
            return "not captured"
        if md.max_query_len != 1:
            return "not decode-only"
        if self.bucket_for(md.seq_lens.shape[0]) is None:
            return f"batch {md.seq_lens.shape[0]} > largest bucket {self.buckets[-1]}"
        if md.block_table.shape[1] > self.max_blocks:
            return f"block table width {md.block_table.shape[1]} > {self.max_blocks}"
        if md.block_size != self.block_size:
            return "block size differs"
        return None

    def can_run(self, md: AttentionMetadata) -> bool:
        """Whether `run` may serve this step; records the decision (configured: this runner exists)."""
        num_reqs = md.seq_lens.shape[0]
        reason = self.ineligible_reason(md)
        return dispatch.decide("cuda_graph_decode", dispatch.tokens_bucket(num_reqs), configured=True,
                               ineligible_reason=reason)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Replay the bucket for this decode step. input_ids, positions [B] int64; md as built by the runner
        (query_start_loc must be arange(B+1)). Returns hidden states [B, hidden] — a view of the graph's static
        output, overwritten by the next replay of that bucket (copy it if it must live longer)."""
        num_reqs = md.seq_lens.shape[0]
        bucket = self.bucket_for(num_reqs)
        assert bucket is not None and input_ids.shape[0] == num_reqs == positions.shape[0]
        width = md.block_table.shape[1]
        self.input_ids[:num_reqs].copy_(input_ids, non_blocking=True)
        self.positions[:num_reqs].copy_(positions, non_blocking=True)
        self.slot_mapping[:num_reqs].copy_(md.slot_mapping[:num_reqs], non_blocking=True)
        self.seq_lens[:num_reqs].copy_(md.seq_lens, non_blocking=True)
        self.context_lens[:num_reqs].copy_(md.context_lens, non_blocking=True)
        self.block_table[:num_reqs, :width].copy_(md.block_table, non_blocking=True)
        if width < self.max_blocks:
            self.block_table[:num_reqs, width:].zero_()
        if num_reqs < bucket:  # padding rows: no cache write, nothing to attend to
            self.input_ids[num_reqs:bucket].zero_()
            self.positions[num_reqs:bucket].zero_()
            self.slot_mapping[num_reqs:bucket].fill_(-1)
            self.seq_lens[num_reqs:bucket].zero_()
        op_timing.note_graph_replay(dispatch.tokens_bucket(num_reqs))  # per-op times come from eager steps only
        self.graphs[bucket].replay()
        return self.outputs[bucket][:num_reqs]
